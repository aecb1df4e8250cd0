"""Runner choice in one place: which runner a model gets, what its weights need, and building it.

Glossary:
- *runner kind*: ``hf`` (an HFRunner over the transformers model as loaded), ``int8`` (an
  HFRunner over the per-token int8 path of ``runners.int8``), ``int4`` (an HFRunner over the
  4-bit-weight path of ``runners.int4``), ``llamacpp`` (a GGUF draft in llama.cpp,
  ``runners.llamacpp``).
- *auto*: on CPU in float32, int4 for a target where its kernel builds and runs (AVX-512 VNNI
  and a compiler), else int8; for a GGUF draft llama.cpp when installed and built with AVX-512
  (or not on x86), else int8 (``runners.llamacpp_build.llamacpp_fast``); hf on any other device
  or dtype.
- *fast path*: the direct decode loop of ``runners.lean``, given to an HFRunner at construction
  when it mirrors the model; other models run the transformers module path only.
- *draft file*: the GGUF a llama.cpp draft runs: its source, requantized and then with a trimmed
  vocabulary when asked (``runners.gguf_files``), once this build is known to decode it.
- *fallback*: an auto-chosen llama.cpp draft whose build cannot decode the file drafts on the
  int8 path instead (hf outside float32), with a warning.
- *weight preparation*: an int8 (int4) model's linears are replaced by int8 (int4) ones, their
  quantized weights read from the packed-weight cache when the model comes from a local
  safetensors checkpoint (``runners.weight_cache``).

``models`` resolves references and loads weights and tokenizers; it asks this module what to
load and which runner to build.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..errors import SpecDecodeError
from .gguf_files import requantized_gguf, trimmed_gguf
from .int4 import kernel_problem, prepare_int4
from .int8 import int8_available, prepare_int8
from .weight_cache import int4_weights, int8_weights
from .lean import LeanForward
from .llamacpp import LlamaCppRunner
from .llamacpp_build import llamacpp_available, llamacpp_fast, llamacpp_problem

RUNNERS = ("auto", "hf", "int8", "int4", "llamacpp")
_REBUILD_HINT = ('rebuild it with CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" '
                 "pip install --force-reinstall --no-cache-dir llama-cpp-python")

log = logging.getLogger("specdecode.runners.factory")


def choose_runner(requested: str, device: torch.device, dtype: torch.dtype, role: str,
                  gguf: str | Path | None = None) -> str:
    """The runner kind for a model (module glossary: auto). role: 'target' or 'draft'; gguf:
    the GGUF file behind the model reference, if it has one."""
    if requested not in RUNNERS:
        raise SpecDecodeError(f"unknown runner '{requested}' (choose from {', '.join(RUNNERS)})", field="runner")
    if requested == "llamacpp" and role == "target":
        raise SpecDecodeError("the llamacpp runner is not batch-invariant, so it may only run drafts (--draft-runner)",
                              field="runner")
    if requested in ("int8", "int4", "llamacpp") and device.type != "cpu":
        raise SpecDecodeError(f"the {requested} runner is CPU-only", field="runner")
    if requested != "auto":
        return requested
    if device.type != "cpu" or dtype != torch.float32:
        return "hf"
    if role == "draft" and gguf is not None and llamacpp_available() and llamacpp_fast():
        return "llamacpp"
    if role == "target" and kernel_problem() is None:
        return "int4"
    return "int8" if int8_available() else "hf"


def llamacpp_draft_file(gguf_path: str, explicit: bool, draft_quant: str, draft_vocab: int | None,
                        cache_dir: Path) -> str | None:
    """The draft file for a llama.cpp draft (module glossary), or None to fall back.

    explicit: the llamacpp runner was asked for by name, so a build that cannot decode the file
    is an error instead of a fallback. draft_quant: 'source' or a type to requantize to;
    draft_vocab: the token ids a trimmed vocabulary keeps (None: all)."""
    problem = llamacpp_problem(gguf_path, cache_dir)
    if problem is None:
        if draft_quant != "source":  # before trimming: the trimmed copy's id map is written beside it
            gguf_path = requantized_gguf(gguf_path, draft_quant, cache_dir)
        if draft_vocab is not None:
            gguf_path = trimmed_gguf(gguf_path, draft_vocab, cache_dir)
        return gguf_path
    if explicit:
        raise SpecDecodeError(f"{problem}; {_REBUILD_HINT}", field="draft_runner")
    log.warning("specdecode: warning: %s; drafting on the int8 path instead (%s)", problem, _REBUILD_HINT)
    return None


def fallback_runner(dtype: torch.dtype) -> str:
    """The runner kind a draft falls back to when llama.cpp cannot run it."""
    return "int8" if dtype == torch.float32 else "hf"


def prefills_on_int8(draft_prefill: str, dtype: torch.dtype) -> bool:
    """Whether a llama.cpp draft also gets its model on the int8 path, to prefill prompts there."""
    return draft_prefill == "int8" and dtype == torch.float32 and int8_available()


def check_dtype(runner: str, dtype: torch.dtype) -> None:
    if runner in ("int8", "int4") and dtype != torch.float32:
        raise SpecDecodeError(f"the {runner} runner quantises from float32; use --dtype float32", field="dtype")


def prepare_weights(model, runner: str, checkpoint: str | Path | None = None, cache_root: Path | None = None,
                    gguf: str | Path | None = None):
    """A loaded transformers model made ready for its runner kind (int8, int4: quantised in place); returns it.

    checkpoint: the folder the model was loaded from (module glossary: weight preparation);
    cache_root: the cache folder the packed-weight cache lives under (None: no cache); gguf: the
    GGUF file the checkpoint was converted from, whose Q4_K blocks the int4 path then runs as they are."""
    if runner == "int8":
        prepare_int8(model, None if checkpoint is None else int8_weights(checkpoint, cache_root))
    elif runner == "int4":
        prepare_int4(model, None if checkpoint is None else int4_weights(checkpoint, cache_root, gguf))
    return model


def hf_runner(model):
    """An HFRunner over a transformers model, with the fast path when it mirrors the model."""
    from .hf import HFRunner

    return HFRunner(model, fast=LeanForward(model) if LeanForward.supports(model) else None)


def build_runner(kind: str, model=None, gguf_path: str | None = None, prefill_model=None):
    """The runner of a loaded model: kind 'llamacpp' runs ``gguf_path`` (prefilling prompts on
    ``prefill_model``, the same model on the int8 path, when given); 'hf', 'int8' and 'int4' run ``model``."""
    if kind == "llamacpp":
        return LlamaCppRunner(gguf_path, prefill_runner=None if prefill_model is None else hf_runner(prefill_model))
    return hf_runner(model)
