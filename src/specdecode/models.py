"""Resolving a model reference to a loaded transformers model and tokenizer.

Glossary: a *model reference* is one of
- a pack name (``specdecode models list``), assembled and converted from installed parts;
- a path to a ``.gguf`` file, converted once into the cache;
- a local directory that ``from_pretrained`` reads;
- a hub id (``org/name``), downloaded by transformers when the network allows.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from . import packs
from .errors import SpecDecodeError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
DEVICES = ("cpu", "cuda")


@dataclass
class LoadedModel:
    name: str
    model: object  # transformers PreTrainedModel
    tokenizer: object  # transformers tokenizer


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise SpecDecodeError(f"unknown dtype '{name}' (choose from {', '.join(DTYPES)})", field="dtype")
    return DTYPES[name]


def parse_device(name: str) -> torch.device:
    if name.split(":")[0] not in DEVICES:
        raise SpecDecodeError(f"unknown device '{name}' (choose from cpu, cuda)", field="device")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SpecDecodeError("device 'cuda' requested but no CUDA device is available", field="device")
    return torch.device(name)


def resolve(reference: str, progress: bool = True) -> tuple[str, dict]:
    """Map a reference to (from_pretrained location, extra kwargs), preparing packs on the way."""
    pack = packs.get_pack(reference)
    if pack is not None:
        return str(packs.ensure_converted(pack, progress)), {}
    path = Path(reference).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(_converted_gguf(path, progress)), {}
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SpecDecodeError(f"model directory '{reference}' has no config.json")
        return str(path), {}
    if path.exists() or reference.startswith((".", "/", "~")) or reference.endswith(".gguf"):
        raise SpecDecodeError(f"unknown model '{reference}': no such model file or directory")
    return reference, {}  # a hub id


def load(reference: str, device: torch.device, dtype: torch.dtype, progress: bool = True) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    location, extra = resolve(reference, progress)
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, **extra)
        model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, **extra)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpecDecodeError(
            f"unknown model '{reference}': not a model pack (see `specdecode models list`), local path, "
            f"or loadable hub id ({first[:200]})"
        ) from None
    return LoadedModel(reference, model.to(device).eval(), tokenizer)


def _converted_gguf(path: Path, progress: bool) -> Path:
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = packs.cache_dir() / "converted" / f"{path.stem}-{key}"
    if not (out / "model.safetensors").is_file():
        packs.convert_gguf(path, out, progress)
    return out


def eos_token_ids(loaded: LoadedModel) -> list[int]:
    """Every id the model or its tokenizer declares as end of sequence."""
    ids: set[int] = set()
    for source in (loaded.model.config, getattr(loaded.model, "generation_config", None)):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if getattr(loaded.tokenizer, "eos_token_id", None) is not None:
        ids.add(int(loaded.tokenizer.eos_token_id))
    return sorted(ids)


def same_vocabulary(target_tokenizer, draft_tokenizer) -> bool:
    return target_tokenizer.get_vocab() == draft_tokenizer.get_vocab()


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
