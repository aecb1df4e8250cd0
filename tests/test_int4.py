"""The int4 path: the kernel equals the torch reference bit for bit, a token's logits do not
depend on its block, the weight cache stores the packed layout, speculation stays exact."""

import copy
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import decode, perturbed, tiny_model
from specdecode.config import SamplingParams, SpecConfig
from specdecode.drafters import ModelDrafter
from specdecode.engine import SpecEngine
from specdecode.errors import SpecDecodeError
from specdecode.runners import factory, int4, weight_cache
from specdecode.runners.int4 import (FusedInt4Member, Int4Rows, PerTokenInt4Linear, gguf_rows, kernel_linear, pack,
                                     prepare_int4, quantize_rows, quantize_weight, reference_linear, unpack)
from specdecode.runners.lean import LeanForward


def kernel_or_skip():
    module = int4.int4_kernel()
    if module is None:
        pytest.skip("the int4 kernel does not build or run here (the reference is tested on its own)")
    return kernel_linear(module)


def matmuls():
    yield pytest.param(lambda: reference_linear, id="reference")
    yield pytest.param(kernel_or_skip, id="kernel")


def int4_model(arch, seed=1, matmul=None):
    return prepare_int4(tiny_model(arch, seed=seed, dtype=torch.float32), matmul=matmul)


def random_weight(out, width, seed):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, width, generator=g) * 0.05
    weight[min(3, out - 1)] *= 20  # an outlier row
    weight[:, min(5, width - 1)] *= 8  # an outlier column
    if out > 8:
        weight[8] = 0.0  # a zero row
    return weight


@pytest.mark.parametrize("out,width", [(16, 32), (37, 50), (100, 96), (48, 1000), (20, 512)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_the_reference_bit_for_bit(out, width, bias):
    kernel = kernel_or_skip()
    weight = quantize_weight(random_weight(out, width, seed=out + width))
    b = torch.randn(out) if bias else None
    g = torch.Generator().manual_seed(1)
    for tokens in (1, 2, 7, 8, 9, 16, 23, 64):
        x = torch.randn(tokens, width, generator=g) * torch.rand(tokens, 1, generator=g) * 10
        x[0, 0] = 300.0  # a token with an outlier
        if tokens > 2:
            x[2] = 0.0  # an all-zero token
        assert torch.equal(kernel(x, weight, b), reference_linear(x, weight, b)), tokens


@pytest.mark.parametrize("make", list(matmuls()))
def test_a_token_gets_the_same_bits_alone_and_in_any_block(make):
    matmul = make()
    width = 200
    weight = quantize_weight(random_weight(70, width, seed=3))
    x = torch.randn(64, width, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([matmul(x[t : t + 1], weight, None) for t in range(64)])
    g = torch.Generator().manual_seed(4)
    start = 0
    while start < 64:
        size = int(torch.randint(1, 65, (1,), generator=g))
        block = matmul(x[start : start + size], weight, None)
        assert torch.equal(block, alone[start : start + size])
        start += size
    assert torch.equal(matmul(x, weight, None), alone)


def test_quantised_weights_are_close_to_the_float_ones_and_pack_round_trips():
    weight = random_weight(50, 96, seed=5)
    rows = quantize_rows(weight)
    assert rows.codes.shape == (50, 256) and rows.scales.shape == (50, 8) and rows.d.shape == (50, 1)  # one super-block
    assert rows.codes.max() <= 15 and rows.scales.max() <= 63 and rows.mins.max() <= 63
    packed = pack(rows)
    again = unpack(packed)
    assert again.codes.shape == (64, 256)  # rows padded to whole blocks of 16
    assert all(torch.equal(a[:50], b) for a, b in zip(again, rows))
    assert all((field[50:] == 0).all() for field in again)
    values = rows.values()[:, :96]
    assert torch.equal(rows.values()[:, 96:], torch.zeros(50, 160))  # padding inputs are zero
    per_row = weight.abs().amax(-1).clamp(min=1e-12)
    assert ((values - weight).abs().amax(-1) / per_row).max() < 0.15
    assert ((values - weight).norm() / weight.norm()) < 0.1  # an outlier column widens its groups' steps
    assert torch.equal(values[8], torch.zeros(96))  # a zero row stays zero
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0))
    ref = x @ weight.T
    assert ((reference_linear(x, packed, None) - ref).norm() / ref.norm()) < 0.1


def random_q4k_blocks(count, seed):
    """Raw Q4_K blocks with random fields (every byte pattern is a valid block), fp16 super-scales kept finite."""
    import numpy as np

    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(count, 144), dtype=np.uint8)
    scales = (rng.standard_normal((count, 2)) * [0.01, 0.005]).astype(np.float16)
    raw[:, 0:4] = np.abs(scales).view(np.uint8).reshape(count, 4)
    return raw


def test_gguf_q4k_blocks_are_taken_exactly():
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    raw = random_q4k_blocks(6 * 3, seed=1)  # a [6, 768] tensor
    rows = gguf_rows(raw, 6, 768)
    expected = quants.dequantize(raw, GGMLQuantizationType.Q4_K).reshape(6, 768)
    assert torch.equal(rows.values(), torch.from_numpy(np.ascontiguousarray(expected)))
    assert all(torch.equal(a[:6], b) for a, b in zip(unpack(pack(rows)), rows))
    with pytest.raises(ValueError, match="whole blocks"):
        gguf_rows(raw, 6, 700)
    with pytest.raises(ValueError, match="cannot hold"):
        gguf_rows(raw, 7, 768)


def test_bad_input_is_a_clear_error():
    packed = quantize_weight(random_weight(20, 64, seed=6))
    with pytest.raises(ValueError, match="inputs where the int4 weight has 8 groups"):
        reference_linear(torch.randn(3, 300), packed, None)
    with pytest.raises(ValueError, match="float32 rows"):
        reference_linear(torch.randn(3, 64, dtype=torch.float64), packed, None)
    with pytest.raises(ValueError, match="bias"):
        reference_linear(torch.randn(3, 64), packed, torch.zeros(7))
    bad = quantize_rows(torch.randn(16, 256))
    with pytest.raises(ValueError, match="codes must lie"):
        pack(bad._replace(codes=torch.full((16, 256), 16, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="do not describe one matrix"):
        pack(bad._replace(d=torch.ones(16, 2)))
    with pytest.raises(ValueError, match="cannot replace"):
        PerTokenInt4Linear(torch.nn.Linear(64, 21), packed, reference_linear)
    with pytest.raises(SpecDecodeError, match="CPU-only"):
        factory.choose_runner("int4", torch.device("cuda"), torch.float32, "target")
    with pytest.raises(SpecDecodeError, match="int4 runner quantises from float32"):
        factory.check_dtype("int4", torch.float64)


def test_int4_is_the_automatic_target_where_its_kernel_runs(monkeypatch):
    cpu = torch.device("cpu")
    assert "int4" in factory.RUNNERS
    assert factory.choose_runner("int4", cpu, torch.float32, "target") == "int4"
    expected = "int4" if int4.kernel_problem() is None else "int8"
    assert factory.choose_runner("auto", cpu, torch.float32, "target") == expected
    assert factory.choose_runner("auto", cpu, torch.float32, "draft") != "int4"
    assert factory.choose_runner("auto", cpu, torch.float64, "target") == "hf"
    monkeypatch.setattr(factory, "kernel_problem", lambda: "this CPU lacks avx512_vnni")
    assert factory.choose_runner("auto", cpu, torch.float32, "target") == ("int8" if factory.int8_available() else "hf")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_linear_is_replaced_and_the_lean_loop_takes_the_model(arch):
    model = int4_model(arch, matmul=reference_linear)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, FusedInt4Member) and isinstance(model.lm_head, PerTokenInt4Linear)
    assert LeanForward.supports(model)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_are_bit_identical_alone_and_in_blocks_of_1_to_64(arch):
    runner = factory.hf_runner(int4_model(arch, seed=2))
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, runner.vocab_size, (1, 200), generator=g)
    prefix = 10
    position = prefix
    for _ in range(4):
        size = int(torch.randint(1, 65, (1,), generator=g))
        runner.prefill(ids[:, :position])
        block = runner.forward(ids[:, position : position + size])[0]  # [size, V]
        for i in range(size):
            runner.truncate(torch.tensor([position + i]))
            alone = runner.forward(ids[:, position + i : position + i + 1])[0, 0]
            assert torch.equal(block[i], alone), (size, i)
        position += size


def test_kernel_and_reference_give_the_same_logits_through_the_model():
    kernel = kernel_or_skip()
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(8))
    results = []
    for matmul in (kernel, reference_linear):
        runner = factory.hf_runner(int4_model("qwen2", seed=3, matmul=matmul))
        runner.reset(2)
        results.append([runner.prefill(ids[:1, :30], rows=[0]), runner.prefill(ids[1:, :25], rows=[1]),
                        runner.forward(ids[:, 30:36], rows=[0, 1], counts=[6, 3])])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("gamma", [1, 4])
def test_speculative_greedy_over_int4_equals_plain_over_int4(gamma):
    target = int4_model("llama", seed=7)
    draft = prepare_int4(perturbed(tiny_model("llama", seed=7, dtype=torch.float32), 0.03, seed=8))
    plain = SpecEngine(factory.hf_runner(target), None, SpecConfig())
    spec = SpecEngine(factory.hf_runner(target), ModelDrafter(factory.hf_runner(draft)), SpecConfig(gamma=gamma))
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        prompt = torch.randint(0, 96, (1, 12), generator=g)
        params = SamplingParams(max_new_tokens=32)
        assert [t for s in decode(spec, prompt, params) for t in s.tokens] == [t for s in decode(plain, prompt, params) for t in s.tokens]


def _logits(model):
    runner = factory.hf_runner(model)
    ids = torch.randint(0, runner.vocab_size, (1, 30), generator=torch.Generator().manual_seed(0))
    return [runner.prefill(ids[:, :20]), runner.forward(ids[:, 20:26])]


def test_weight_cache_stores_the_packed_layout_and_a_hit_needs_no_quantising(tmp_path, monkeypatch, caplog):
    model = tiny_model("qwen2", seed=5, dtype=torch.float32)  # a head tied to the embedding
    folder, cache_root = tmp_path / "qwen2", tmp_path / "cache"
    model.save_pretrained(folder)

    def load():
        loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        return factory.prepare_weights(loaded, "int4", folder, cache_root)

    in_memory = _logits(prepare_int4(copy.deepcopy(model)))
    cold = _logits(load())
    (entry,) = (cache_root / "int4").iterdir()
    monkeypatch.setattr(weight_cache, "quantize_rows4", lambda weight: pytest.fail("a hit quantised a weight"))
    hit = _logits(load())
    assert all(torch.equal(a, b) for a, b in zip(cold, in_memory))
    assert all(torch.equal(a, b) for a, b in zip(hit, cold))
    assert not (cache_root / "int8").exists()
    monkeypatch.undo()
    blob = entry.read_bytes()
    entry.write_bytes(blob[:-50])
    with caplog.at_level(logging.WARNING, logger="specdecode.runners.weight_cache"):
        rebuilt = _logits(load())
    assert f"the int4 weight cache file {entry}" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(rebuilt, cold)) and entry.read_bytes() == blob


def _q4k_values(raw, out, width):
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(raw, GGMLQuantizationType.Q4_K).reshape(out, width)))


def test_a_checkpoint_converted_from_a_gguf_runs_its_q4k_blocks_and_quantises_the_rest(tmp_path):
    import gguf
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from specdecode.runners.int8 import int8_matrices

    config = Qwen2Config(vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    raw_q, raw_down = random_q4k_blocks(256, seed=2), random_q4k_blocks(512, seed=3)
    layer = model.model.layers[0]
    with torch.no_grad():
        layer.self_attn.q_proj.weight.copy_(_q4k_values(raw_q, 256, 256))  # the file's numbers
        layer.mlp.down_proj.weight.copy_(_q4k_values(raw_down, 256, 512) + 1e-3)  # not the file's numbers
    folder, path = tmp_path / "model", tmp_path / "model.gguf"
    model.save_pretrained(folder)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(1)
    for name, raw, width in (("blk.0.attn_q.weight", raw_q, 256), ("blk.0.ffn_down.weight", raw_down, 512)):
        writer.add_tensor(name, raw.reshape(256, width // 256 * 144), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    source = weight_cache.int4_weights(folder, None, path)
    matrices = {m.keys[0]: m for m in int8_matrices(model)}
    qkv = unpack(source.weight(matrices["model.layers.0.self_attn.q_proj.weight"]))
    exact, kv = gguf_rows(raw_q, 256, 256), quantize_rows(torch.cat([layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight]).detach())
    assert all(torch.equal(a[:256], b) for a, b in zip(qkv, exact))  # the file's own blocks
    assert all(torch.equal(a[256:512], b) for a, b in zip(qkv, kv)) and qkv.codes.shape[0] == 512  # no tensor in the file: quantised
    down = unpack(source.weight(matrices["model.layers.0.mlp.down_proj.weight"]))
    assert all(torch.equal(a[:256], b) for a, b in zip(down, quantize_rows(layer.mlp.down_proj.weight.detach())))
    assert not torch.equal(down.codes[:256], gguf_rows(raw_down, 256, 512).codes)  # the file's blocks were not taken

    cache_root = tmp_path / "cache"
    loaded = [factory.prepare_weights(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), "int4",
                                      folder, cache_root, gguf) for gguf in (path, None, path)]
    weights = [m.model.layers[0].self_attn.q_proj._group.weight4 for m in loaded]
    assert all(torch.equal(a, b) for a, b in zip(unpack(weights[0]), qkv))
    assert not torch.equal(unpack(weights[1]).codes[:256], exact.codes)  # without the file: quantised from the floats
    assert all(torch.equal(a, b) for a, b in zip(unpack(weights[2]), qkv))  # a cache hit keeps the file's blocks
    assert len(list((cache_root / "int4").iterdir())) == 2  # the file is part of the entry's identity
