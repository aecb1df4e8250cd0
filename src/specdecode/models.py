"""Resolving a model reference to a loaded transformers model and tokenizer.

Glossary: a *model reference* is one of
- a pack name (``specdecode models list``), assembled and converted from installed parts;
- a path to a ``.gguf`` file, converted once into the cache;
- a local directory that ``from_pretrained`` reads;
- a hub id (``org/name``), downloaded by transformers when the network allows.

A model for the int8 path takes its quantized weights from the packed-weight cache under the
cache folder (``runners.weight_cache``; ``$SPECDECODE_INT8_CACHE=off`` turns it off). Load
phases are logged at DEBUG on ``specdecode.models``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import packs
from .errors import SpecDecodeError
from .runners import factory, weight_cache

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
DEVICES = ("cpu", "cuda")

RUNNERS = factory.RUNNERS

log = logging.getLogger("specdecode.models")


@dataclass
class LoadedModel:
    name: str
    model: object | None  # transformers PreTrainedModel (None for a llama.cpp draft)
    tokenizer: object  # transformers tokenizer
    runner: str = "hf"  # hf | int8 | llamacpp
    gguf_path: str | None = None  # for the llamacpp runner
    prefill_model: object | None = None  # a llamacpp runner's model on the int8 path, for prompt prefills

    def make_runner(self):
        """This model's runner, built by runners.factory."""
        return factory.build_runner(self.runner, self.model, self.gguf_path, self.prefill_model)


def gguf_source(reference: str) -> Path | None:
    """The GGUF file behind a reference (a pack or a .gguf path), or None."""
    if packs.get_pack(reference) is not None:
        return packs.assembled_path(packs.get_pack(reference))
    path = Path(reference).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


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


def check_reference(reference: str, runner: str, role: str) -> None:
    """Cheap checks before anything is loaded, so a bad draft fails before a slow target load."""
    if packs.get_pack(reference) is not None:
        return
    path = Path(reference).expanduser()
    looks_local = path.exists() or reference.startswith((".", "/", "~")) or reference.endswith(".gguf")
    if looks_local and not (path.is_dir() or (path.is_file() and path.suffix == ".gguf")):
        raise SpecDecodeError(f"unknown model '{reference}': no such model file or directory", field=role)
    if runner == "llamacpp" and gguf_source(reference) is None:
        raise SpecDecodeError(f"the llamacpp runner needs a pack name or a .gguf file, got '{reference}'", field=role)


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
    check_reference(reference, "hf", "model")  # raises for a local path that is not a model
    return reference, {}  # a hub id


def load(reference: str, device: torch.device, dtype: torch.dtype, progress: bool = True,
         runner: str = "hf", role: str = "target", draft_vocab: int | None = None,
         draft_quant: str = "source", draft_prefill: str = "llamacpp") -> LoadedModel:
    """Load a model for the runner runners.factory picks from ``runner`` ('auto' or a kind).

    draft_vocab: a llama.cpp draft scores only its lowest ``draft_vocab`` token ids plus the
    control tokens (None: its whole vocabulary); draft_quant: it runs a copy llama.cpp requantized
    to that type ('source': the GGUF as it is); draft_prefill 'int8': it prefills prompts with the
    same model on the int8 path (runners.llamacpp glossary). Other runners ignore all three."""
    kind = factory.choose_runner(runner, device, dtype, role, gguf_source(reference))
    if kind == "llamacpp":
        loaded = _load_llamacpp(reference, progress)
        draft_file = factory.llamacpp_draft_file(loaded.gguf_path, runner != "auto", draft_quant, draft_vocab,
                                                 packs.cache_dir())
        if draft_file is not None:
            loaded.gguf_path = draft_file
            if factory.prefills_on_int8(draft_prefill, dtype):
                loaded.prefill_model = _load_transformers(reference, device, dtype, progress, "int8")[0]
            return loaded
        kind = factory.fallback_runner(dtype)
    factory.check_dtype(kind, dtype)
    model, tokenizer = _load_transformers(reference, device, dtype, progress, kind)
    return LoadedModel(reference, model, tokenizer, kind)


def _load_transformers(reference: str, device: torch.device, dtype: torch.dtype, progress: bool, runner: str):
    """(model, tokenizer) through transformers, with the weights prepared for that runner kind."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    location, extra = resolve(reference, progress)
    start = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, **extra)
        loaded = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, **extra)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpecDecodeError(
            f"unknown model '{reference}': not a model pack (see `specdecode models list`), local path, "
            f"or loadable hub id ({first[:200]})"
        ) from None
    mapped = time.perf_counter()
    model = prepare_weights(model.to(device).eval(), runner, reference, location)
    log.debug("%s: tokenizer %.1f s, model %.1f s, %s weights %.1f s", reference, loaded - start, mapped - loaded, runner,
              time.perf_counter() - mapped)
    return model, tokenizer


def prepare_weights(model, runner: str, reference: str, location: str):
    """A model loaded from ``location`` (``resolve(reference)``) made ready for its runner kind,
    through the packed-weight cache unless it is turned off, and for int4 with the reference's
    GGUF blocks (``runners.factory.prepare_weights``); returns it."""
    cache_root = packs.cache_dir() if weight_cache.cache_enabled() else None
    return factory.prepare_weights(model, runner, location, cache_root, gguf_source(reference))


def _load_llamacpp(reference: str, progress: bool) -> LoadedModel:
    from transformers import AutoTokenizer

    pack = packs.get_pack(reference)
    if pack is not None:
        gguf = packs.ensure_assembled(pack, progress)
    else:
        gguf = gguf_source(reference)
        if gguf is None:
            raise SpecDecodeError(f"the llamacpp runner needs a pack name or a .gguf file, got '{reference}'", field="draft")
    converted = packs.converted_path(pack) if pack is not None else None
    if converted is not None and (converted / "tokenizer.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(converted))
    else:
        tokenizer = gguf_tokenizer(gguf)
    return LoadedModel(reference, None, tokenizer, "llamacpp", str(gguf))


def _file_key(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]


def gguf_tokenizer(gguf: Path):
    """A GGUF's tokenizer, read from the file once and then from its copy in the cache
    (``$SPECDECODE_CACHE/tokenizers``): transformers builds it from every token of the file,
    about 10 s for Qwen's 151k on 2 cores, against under a second from the copy."""
    from transformers import AutoTokenizer

    out = packs.cache_dir() / "tokenizers" / f"{gguf.stem}-{_file_key(gguf)}"
    if (out / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(out))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        log.warning("cannot keep the tokenizer of %s in %s (%s); it is read from the file at every load", gguf.name, out, exc)
    return tokenizer


def _converted_gguf(path: Path, progress: bool) -> Path:
    out = packs.cache_dir() / "converted" / f"{path.stem}-{_file_key(path)}"
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
