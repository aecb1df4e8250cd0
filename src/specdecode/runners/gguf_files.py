"""GGUF file tools for llama.cpp drafts: a trimmed vocabulary and a requantized copy.

Glossary:
- *trimmed vocabulary* (``trim_vocabulary``): a copy of the GGUF whose embedding and output
  matrices keep only the rows of the lowest ``keep`` token ids (in a byte-level BPE vocabulary
  the earliest, most frequent merges) plus the control tokens. The output head is the largest
  single weight a draft token streams (a 0.5B Qwen2.5 draft: 145 of about 390 MB), so the
  trimmed draft is cheaper per token. ``VocabularyMap`` maps ids both ways: logits of dropped
  tokens are -inf (the draft never proposes them, so its distribution stays a proper one and
  sampling stays exact), and a dropped token in the context is fed as a stand-in token (it only
  changes what the draft sees).
- *requantized draft* (``requantized_gguf``): a copy llama.cpp writes of the GGUF in another
  weight format (Q4_0 by default: its cheapest x86 kernels).

Both copies are cached under the packs' cache folder, named by their source's size, and
compose: requantize first, then trim.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch

from ..errors import SpecDecodeError


def kept_token_ids(token_types: list[int], keep: int) -> list[int]:
    """The ids a trimmed vocabulary keeps: every id below ``keep`` and every control or
    user-defined token (GGUF token types 3 and 4) above it, in increasing order."""
    return [i for i, kind in enumerate(token_types) if i < keep or kind in (3, 4)]


def vocabulary_file(gguf_path) -> str:
    """Where a trimmed GGUF's id map lies (JSON: the source id of each kept id, and the source's
    vocabulary size). Not in the GGUF's own metadata: reading any key back with gguf's reader
    parses the whole tokenizer (about 8 s for Qwen2.5's), at every load."""
    return f"{gguf_path}.vocabulary.json"


def trim_vocabulary(source: str, destination, keep: int) -> None:
    """Write a copy of the GGUF ``source`` with a trimmed vocabulary (module glossary),
    and its id map beside it (``vocabulary_file``)."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    if keep < 1:
        raise ValueError("a trimmed vocabulary keeps at least one token id")
    reader = GGUFReader(source)
    fields = reader.fields
    kept = kept_token_ids(list(fields["tokenizer.ggml.token_type"].contents()), keep)
    new_id = {old: new for new, old in enumerate(kept)}
    tokens = fields["tokenizer.ggml.tokens"].contents()
    pieces = {tokens[i] for i in kept}
    arch = fields["general.architecture"].contents()
    tmp = f"{destination}.tmp"
    writer = GGUFWriter(tmp, arch)
    for name, field in fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # written by GGUFWriter itself
        value = field.contents()
        if name in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            value = [value[i] for i in kept]
        elif name == "tokenizer.ggml.merges":
            value = [m for m in value if all(part in pieces for part in m.split(" ")) and m.replace(" ", "") in pieces]
        elif name == f"{arch}.vocab_size":
            value = len(kept)
        elif name.startswith("tokenizer.ggml.") and name.endswith("_token_id"):
            if int(value) not in new_id:
                continue
            value = new_id[int(value)]
        if field.types[0] == GGUFValueType.ARRAY and len(value) == 0:
            continue  # GGUF has no empty arrays (every merge named a dropped token)
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub_type)
    rows = np.asarray(kept)
    for tensor in reader.tensors:
        data = tensor.data
        if tensor.name in ("token_embd.weight", "output.weight"):
            data = np.ascontiguousarray(data[rows])
        quantized = tensor.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)  # plain arrays
        writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type if quantized else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with open(vocabulary_file(destination), "w") as out:
        json.dump({"kept_ids": kept, "source_size": len(tokens)}, out)
    os.replace(tmp, destination)  # last: a GGUF in place always has its map


def trimmed_gguf(source: str, keep: int, cache_dir) -> str:
    """The cached trimmed copy of ``source`` (written on first use)."""
    folder = Path(cache_dir) / "gguf"
    folder.mkdir(parents=True, exist_ok=True)
    stem = Path(source).name.removesuffix(".gguf")
    stamp = int(os.path.getsize(source))
    out = folder / f"{stem}.vocab{keep}-{stamp}.gguf"
    if not (out.is_file() and os.path.isfile(vocabulary_file(out))):
        trim_vocabulary(source, out, keep)
    return str(out)


_FTYPES = {"q4_0": ("LLAMA_FTYPE_MOSTLY_Q4_0", "GGML_TYPE_Q4_0"), "q8_0": ("LLAMA_FTYPE_MOSTLY_Q8_0", "GGML_TYPE_Q8_0")}


def requantized_gguf(source: str, kind: str, cache_dir) -> str:
    """The cached copy of ``source`` that llama.cpp requantized to ``kind`` (``q4_0`` or
    ``q8_0``), written on first use (about 3 s for a 0.5B draft).

    Every matrix is written in that format, the output head too (llama.cpp's own default keeps
    the head at Q8_0 or better; for the 0.5B draft that head is 138 of the 330 MB a token reads).

    Why: llama.cpp's Q4_0 kernels are the cheapest it has on x86; the shipped draft's Q4_K_M
    scores a token in 22.1 ms here, the same weights requantized to Q4_0 in 15.9 ms with a Q8_0
    head (docs/benchmarks.md, "Draft weight format"), and in 11.2 against 13.8 ms once the head is Q4_0 too,
    at the same acceptance (same section). Requantizing an already quantized file loses a little
    of the draft's agreement with the target, never exactness: only the drafter changes."""
    import llama_cpp

    if kind not in _FTYPES:
        raise ValueError(f"cannot requantize to {kind!r}; choose from {', '.join(_FTYPES)}")
    folder = Path(cache_dir) / "gguf"
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{Path(source).name.removesuffix('.gguf')}.{kind}-all-{int(os.path.getsize(source))}.gguf"
    if out.is_file():
        return str(out)
    quiet_llamacpp()  # the quantizer logs a line per tensor
    params = llama_cpp.llama_model_quantize_default_params()
    file_type, tensor_type = _FTYPES[kind]
    params.ftype = getattr(llama_cpp, file_type)
    params.output_tensor_type = getattr(llama_cpp, tensor_type)
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    tmp = f"{out}.tmp"
    failed = llama_cpp.llama_model_quantize(str(source).encode(), tmp.encode(), ctypes.byref(params))
    if failed:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise SpecDecodeError(f"llama.cpp could not requantize '{source}' to {kind} (status {failed}); "
                              "pass --draft-quant source", field="draft_quant")
    os.replace(tmp, out)
    return str(out)


def quiet_llamacpp() -> None:
    """llama.cpp's log to errors only, as every ``Llama(verbose=False)`` of the runner sets it
    (llama-cpp-python prints everything until a first Llama is made), unless the caller chose a level."""
    logger = logging.getLogger("llama-cpp-python")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.ERROR)


class VocabularyMap:
    """Between a trimmed vocabulary's own ids and the source's (the target's) ids."""

    def __init__(self, kept: list[int], source_size: int):
        self.source_size = source_size
        self._to_source = torch.tensor(kept, dtype=torch.long)  # [own V] -> source id
        # a dropped token is fed as token 0, which every trimmed vocabulary keeps
        self._to_own = torch.zeros(source_size, dtype=torch.long)
        self._to_own[self._to_source] = torch.arange(len(kept))

    @classmethod
    def of(cls, gguf_path: str) -> "VocabularyMap | None":
        """The map ``trim_vocabulary`` wrote beside a trimmed GGUF, None for an untrimmed one."""
        if not os.path.isfile(vocabulary_file(gguf_path)):
            return None
        with open(vocabulary_file(gguf_path)) as f:
            recorded = json.load(f)
        return cls([int(i) for i in recorded["kept_ids"]], int(recorded["source_size"]))

    def own_ids(self, tokens: list[int]) -> list[int]:
        return self._to_own[torch.tensor(tokens, dtype=torch.long)].tolist()

    def source_logits(self, own: torch.Tensor) -> torch.Tensor:  # [rows, own V] -> [rows, source V]
        full = torch.full((own.shape[0], self.source_size), float("-inf"), dtype=own.dtype)
        full[:, self._to_source] = own
        return full
