"""Pack assembly from installed chunk packages: found, checked, cached; clear errors otherwise."""

import hashlib
import sys

import pytest

from specdecode import packs
from specdecode.errors import SpecDecodeError


@pytest.fixture
def fake_pack(tmp_path, monkeypatch):
    """Three installed parts of a fake pack on sys.path, and a cache in tmp_path."""
    chunks = [bytes([i]) * (1000 + i) for i in range(1, 4)]
    site = tmp_path / "site"
    for i, chunk in enumerate(chunks, start=1):
        pkg = site / f"fakepack_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    blob = b"".join(chunks)
    pack = packs.ModelPack("fake-pack", "test", "fakepack_part", "fakepack-part", "0", 3, len(blob),
                           hashlib.sha256(blob).hexdigest())
    return pack, blob, site


def test_assembles_once_and_checks(fake_pack):
    pack, blob, _ = fake_pack
    assert packs.installed(pack) and not packs.is_assembled(pack)
    path = packs.ensure_assembled(pack, progress=False)
    assert path.read_bytes() == blob and packs.is_assembled(pack)
    mtime = path.stat().st_mtime_ns
    assert packs.ensure_assembled(pack, progress=False) == path and path.stat().st_mtime_ns == mtime


def test_missing_part_names_the_install_command(fake_pack):
    pack, _, site = fake_pack
    (site / "fakepack_part2" / "data" / "part02.bin").unlink()
    with pytest.raises(SpecDecodeError, match=r"missing fakepack-part2.*pip install"):
        packs.ensure_assembled(pack, progress=False)


def test_corrupt_part_is_detected_and_not_cached(fake_pack):
    pack, _, site = fake_pack
    (site / "fakepack_part3" / "data" / "part03.bin").write_bytes(b"\x00" * 1003)
    with pytest.raises(SpecDecodeError, match="corrupt"):
        packs.ensure_assembled(pack, progress=False)
    assert not packs.assembled_path(pack).exists()


def test_unknown_pack_path_command(capsys):
    from specdecode.cli import main

    assert main(["models", "path", "no-such-pack"]) == 2
    assert "unknown model pack" in capsys.readouterr().err


def test_default_packs_are_declared_with_their_checksums():
    target, draft = packs.PACKS[packs.DEFAULT_TARGET], packs.PACKS[packs.DEFAULT_DRAFT]
    assert (target.parts, target.size) == (22, 1_117_320_768)
    assert (draft.parts, draft.size) == (6, 491_400_064)


@pytest.mark.parametrize("q8_0", [False, True], ids=["f32", "q8_0"])
def test_streamed_conversion_loads_as_transformers_own(tmp_path, monkeypatch, q8_0):
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from helpers import char_tokenizer, tiny_model, write_gguf

    tok = char_tokenizer()
    write_gguf(tiny_model("qwen2", seed=3, vocab_size=len(tok.get_vocab()), dtype=torch.float32), tok,
               tmp_path / "m.gguf", q8_0=q8_0, merges=())
    packs.convert_gguf(tmp_path / "m.gguf", tmp_path / "streamed", progress=False)
    monkeypatch.setattr(packs, "STREAMED_ARCHITECTURES", ())
    packs.convert_gguf(tmp_path / "m.gguf", tmp_path / "whole", progress=False)
    streamed, whole = (AutoModelForCausalLM.from_pretrained(tmp_path / f, dtype=torch.float32).state_dict()
                       for f in ("streamed", "whole"))
    assert streamed.keys() == whole.keys() and all(torch.equal(streamed[k], whole[k]) for k in whole)
    assert not torch.equal(whole["model.layers.0.mlp.up_proj.weight"], torch.zeros(64, 32))
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        a, b = (json.loads((tmp_path / f / name).read_text()) for f in ("streamed", "whole"))
        skip = ("transformers_version", "quantization_config")  # the whole model's config also names the GGUF it came from
        assert {k: v for k, v in a.items() if k not in skip} == {k: v for k, v in b.items() if k not in skip}, name


def test_streamed_conversion_names_a_missing_tensor(tmp_path):
    import torch
    from gguf import GGUFReader, GGUFWriter

    from helpers import char_tokenizer, tiny_model, write_gguf

    tok = char_tokenizer()
    write_gguf(tiny_model("qwen2", seed=3, vocab_size=len(tok.get_vocab()), dtype=torch.float32), tok, tmp_path / "m.gguf", merges=())
    reader = GGUFReader(str(tmp_path / "m.gguf"))
    writer = GGUFWriter(str(tmp_path / "cut.gguf"), "qwen2")
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            writer.add_key_value(field.name, field.contents(), field.types[0],
                                 sub_type=field.types[-1] if len(field.types) > 1 else None)
    for tensor in reader.tensors:
        if tensor.name != "blk.1.ffn_up.weight":
            writer.add_tensor(tensor.name, tensor.data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(SpecDecodeError, match="model.layers.1.mlp.up_proj.weight"):
        packs.convert_gguf(tmp_path / "cut.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_a_gguf_tokenizer_is_read_from_the_file_once(tmp_path, monkeypatch):
    import torch
    import transformers

    from specdecode import models
    from helpers import char_tokenizer, tiny_model, write_gguf

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    tok = char_tokenizer()
    write_gguf(tiny_model("qwen2", seed=3, vocab_size=len(tok.get_vocab()), dtype=torch.float32), tok,
               tmp_path / "m.gguf", merges=())
    reads = []
    load = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: reads.append(k.get("gguf_file")) or load(*a, **k))
    first, second = models.gguf_tokenizer(tmp_path / "m.gguf"), models.gguf_tokenizer(tmp_path / "m.gguf")
    assert reads == ["m.gguf", None]  # the second comes from the cached copy
    text = "def f(x): return x"
    assert first.encode(text) == second.encode(text) and second.eos_token == first.eos_token
    (tmp_path / "m.gguf").touch()  # a changed file is read again
    models.gguf_tokenizer(tmp_path / "m.gguf")
    assert reads[-1] == "m.gguf"
