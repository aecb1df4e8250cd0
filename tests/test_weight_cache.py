"""The packed-weight cache of the int8 path: a hit gives the logits of a cold build bit for bit;
a changed source or format misses; a damaged entry is rebuilt with a warning; it can be off."""

import copy
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import tiny_model
from specdecode import models
from specdecode.runners import factory, weight_cache
from specdecode.runners.int8 import int8_available, int8_matrices, prepare_int8

pytestmark = pytest.mark.skipif(not int8_available(), reason="needs fbgemm's int8 linear")

LOGGER = "specdecode.runners.weight_cache"


def saved(tmp_path, arch="qwen2", seed=5, shard=None):
    """A tiny float32 model saved as a safetensors checkpoint; (folder, the model)."""
    model = tiny_model(arch, seed=seed, dtype=torch.float32)
    folder = tmp_path / f"{arch}-{seed}"
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return folder, model


def prepared(folder, cache_root):
    """The checkpoint loaded as models does it (mapped from the file), on the int8 path."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return factory.prepare_weights(model, "int8", folder, cache_root)


def logits(model):  # a prompt prefill, then blocks of 1 and 5 tokens: [1, V] and [1, S, V]
    runner = factory.hf_runner(model)
    ids = torch.randint(0, runner.vocab_size, (1, 30), generator=torch.Generator().manual_seed(0))
    return [runner.prefill(ids[:, :20]), runner.forward(ids[:, 20:21]), runner.forward(ids[:, 21:26])]


def assert_same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def entries(cache_root):
    return sorted(p.name for p in (cache_root / "int8").iterdir()) if (cache_root / "int8").is_dir() else []


@pytest.mark.parametrize("arch,shard", [("qwen2", None), ("llama", None), ("llama", "20KB")],
                         ids=["qwen2-tied-head", "llama", "llama-sharded"])
def test_hit_gives_the_logits_of_a_cold_build_and_of_quantising_in_memory(tmp_path, monkeypatch, arch, shard):
    folder, model = saved(tmp_path, arch, shard=shard)
    cache_root = tmp_path / "cache"
    in_memory = logits(prepare_int8(copy.deepcopy(model)))  # from the model's own float weights
    cold = logits(prepared(folder, cache_root))
    assert len(entries(cache_root)) == 1
    monkeypatch.setattr(weight_cache, "quantize_weight", lambda weight: pytest.fail("a hit quantised a weight"))
    hit = logits(prepared(folder, cache_root))
    assert_same(cold, in_memory)
    assert_same(hit, cold)
    assert len(entries(cache_root)) == 1


def test_a_changed_source_or_format_version_misses(tmp_path, monkeypatch):
    folder, _ = saved(tmp_path, seed=5)
    cache_root = tmp_path / "cache"
    prepared(folder, cache_root)
    first = entries(cache_root)
    other = tiny_model("qwen2", seed=6, dtype=torch.float32)
    other.save_pretrained(folder)  # the same folder, new weights
    rebuilt = logits(prepared(folder, cache_root))
    assert len(entries(cache_root)) == 2 and first[0] in entries(cache_root)
    assert_same(rebuilt, logits(prepare_int8(other)))
    monkeypatch.setattr(weight_cache, "FORMAT", weight_cache.FORMAT + "-next")
    prepared(folder, cache_root)
    assert len(entries(cache_root)) == 3


@pytest.mark.parametrize("damage", ["truncated", "empty", "foreign"])
def test_a_damaged_entry_is_rebuilt_with_a_warning(tmp_path, caplog, damage):
    folder, _ = saved(tmp_path)
    cache_root = tmp_path / "cache"
    cold = logits(prepared(folder, cache_root))
    (entry,) = (cache_root / "int8").iterdir()
    blob = entry.read_bytes()
    entry.write_bytes({"truncated": blob[: len(blob) - 100], "empty": b"", "foreign": b"\x10" + blob[1:]}[damage])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        rebuilt = logits(prepared(folder, cache_root))
    assert f"the int8 weight cache file {entry}" in caplog.text and "rebuilding it" in caplog.text
    assert_same(rebuilt, cold)
    assert entry.read_bytes() == blob and entries(cache_root) == [entry.name]


def test_an_interrupted_build_leaves_no_entry(tmp_path, monkeypatch):
    folder, _ = saved(tmp_path)
    cache_root = tmp_path / "cache"
    calls = []

    def failing(qweight):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return torch.ops.quantized.linear_prepack(qweight, None)

    monkeypatch.setattr("specdecode.runners.int8._pack", failing)
    with pytest.raises(KeyboardInterrupt):
        prepared(folder, cache_root)
    assert entries(cache_root) == []  # neither the entry nor its temporary file


def test_an_unwritable_cache_is_a_warning_and_the_load_goes_on(tmp_path, caplog):
    folder, model = saved(tmp_path)
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder would be")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        out = logits(prepared(folder, blocked))
    assert "cannot write the int8 weight cache file" in caplog.text
    assert_same(out, logits(prepare_int8(model)))


def test_the_cache_is_off_with_the_environment_variable_or_no_cache_root(tmp_path, monkeypatch):
    folder, model = saved(tmp_path)
    cache_root = tmp_path / "cache"
    monkeypatch.setenv("SPECDECODE_CACHE", str(cache_root))
    monkeypatch.setenv(weight_cache.CACHE_ENV, "off")
    off, _ = models._load_transformers(str(folder), torch.device("cpu"), torch.float32, False, "int8")
    assert entries(cache_root) == []
    assert_same(logits(prepared(folder, None)), logits(off))
    assert entries(cache_root) == []
    monkeypatch.delenv(weight_cache.CACHE_ENV)
    on, _ = models._load_transformers(str(folder), torch.device("cpu"), torch.float32, False, "int8")
    assert len(entries(cache_root)) == 1
    assert_same(logits(on), logits(off))


def test_an_entry_holds_every_matrix_of_the_model(tmp_path):
    folder, model = saved(tmp_path, "llama")
    cache_root = tmp_path / "cache"
    matrices = int8_matrices(copy.deepcopy(model))
    prepared(folder, cache_root)
    (entry,) = (cache_root / "int8").iterdir()
    assert weight_cache.entry_problem(entry, matrices) is None
    assert [m.name for m in matrices[:2]] == ["model.layers.0.self_attn.q_proj+k_proj+v_proj", "model.layers.0.mlp.gate_proj+up_proj"]
    assert weight_cache.entry_problem(entry, matrices[:-1]) == "holds other matrices than this model's"
