"""A Runner over llama.cpp (llama-cpp-python) for GGUF drafts.

Glossary: llama.cpp's CPU kernels differ by how many tokens a call scores (one token, a few,
eight or more), so a position's logits depend on its block: fine for a *drafter*, whose
numerics never change the output, but not for a target. ``specdecode`` therefore uses it for
drafts only. Truncation removes KV entries past the kept length (``llama_memory_seq_rm``).

A *trimmed vocabulary* (``trim_vocabulary``): a copy of the GGUF whose embedding and output
matrices keep only the rows of the lowest ``keep`` token ids (in a byte-level BPE vocabulary the
earliest, most frequent merges) plus the control tokens. The output head is the largest single
weight a draft token streams (a 0.5B Qwen2.5 draft: 145 of about 390 MB), so the trimmed draft
is cheaper per token. The runner maps ids both ways: logits of dropped tokens are -inf (the
draft never proposes them, so its distribution stays a proper one and sampling stays exact), and
a dropped token in the context is fed as a stand-in token (it only changes what the draft sees).

A *requantized draft* (``requantized_gguf``): a copy llama.cpp writes of the GGUF in another weight
format (Q4_0 by default: its cheapest x86 kernels). Both copies are cached under the packs'
cache folder, named by their source's size, and compose: requantize first, then trim.

A *prefill on the int8 path* (``prefill_runner``): llama.cpp scores a prompt at about a third of
fbgemm's int8 rate on these CPUs (a 110-token prompt: 318 against 175 ms for the 0.5B draft), so a
runner given the same draft model on the int8 path prefills there and copies every layer's keys
and values into llama.cpp's cache through its sequence-state API (``llama_state_seq_set_data``).
That blob's layout is llama.cpp's own and changes between versions, so it is checked once: a
short probe prefilled by llama.cpp itself must read back as the layout written here, with keys
close to the int8 path's; otherwise the runner prefills in llama.cpp as before. The keys come
from other weights than llama.cpp's (the GGUF dequantised to int8 rather than requantized to
Q4_0), which only moves the draft: never the output.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..errors import SpecDecodeError


def llamacpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def llamacpp_fast() -> bool:
    """Whether this build is the fast draft path: on x86 only a build with AVX-512 kernels.

    Measured on an AVX2-only build (docs/benchmarks.md section 8): a 0.5B draft token cost about
    what the int8 path costs (41-44 ms against 45-50 ms) and a 160-token prompt prefill 1.07 s
    against 0.26 s, so the int8 draft won (1.26x against 1.20x over plain decoding). With the
    native AVX-512 build of the first machine llama.cpp drafted at 28 ms against 42 ms and won
    (1.52x against 1.20x)."""
    import platform

    import llama_cpp

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    info = llama_cpp.llama_print_system_info()
    info = info.decode() if isinstance(info, bytes) else str(info)
    return "AVX512 = 1" in info


_PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(sys.argv[1], n_ctx=64, n_threads=1, verbose=False)
llm.eval(llm.tokenize(b"def f(x):"))
"""


def llamacpp_problem(gguf_path: str, cache_dir) -> str | None:
    """None when this llama-cpp-python build decodes the file in a subprocess, else why not.

    A build compiled for CPU features the process may not use (a native build on an AMX CPU
    here) dies with a segmentation fault inside llama.cpp; probing in a child process turns that
    into a message. The verdict is cached per build and file."""
    import hashlib
    import json
    import subprocess
    import sys

    import llama_cpp

    library = os.path.dirname(llama_cpp.__file__)
    stamp = [llama_cpp.__version__, gguf_path, os.path.getsize(gguf_path)]
    for name in sorted(os.listdir(os.path.join(library, "lib"))) if os.path.isdir(os.path.join(library, "lib")) else []:
        stamp.append([name, os.path.getmtime(os.path.join(library, "lib", name))])
    key = hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:16]
    verdict = cache_dir / f"llamacpp-probe-{key}.json"
    if verdict.is_file():
        return json.loads(verdict.read_text())["problem"]
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, gguf_path], capture_output=True, timeout=300)
        problem = None if done.returncode == 0 else (
            f"llama.cpp crashed decoding a probe (exit {done.returncode}"
            f"{', a segmentation fault' if done.returncode == -11 else ''})")
    except subprocess.TimeoutExpired:
        problem = "llama.cpp did not finish decoding a probe in 300 s"
    cache_dir.mkdir(parents=True, exist_ok=True)
    verdict.write_text(json.dumps({"problem": problem}))
    return problem


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
    """Write a copy of the GGUF ``source`` with a trimmed vocabulary (see the module glossary),
    and its id map beside it (``vocabulary_file``)."""
    import json

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
    from pathlib import Path

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
    head (docs/benchmarks.md section 13), and in 11.2 against 13.8 ms once the head is Q4_0 too,
    at the same acceptance (section 15). Requantizing an already quantized file loses a little
    of the draft's agreement with the target, never exactness: only the drafter changes."""
    import ctypes
    from pathlib import Path

    import llama_cpp

    if kind not in _FTYPES:
        raise ValueError(f"cannot requantize to {kind!r}; choose from {', '.join(_FTYPES)}")
    folder = Path(cache_dir) / "gguf"
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{Path(source).name.removesuffix('.gguf')}.{kind}-all-{int(os.path.getsize(source))}.gguf"
    if out.is_file():
        return str(out)
    _quiet_llamacpp()  # the quantizer logs a line per tensor
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


def _quiet_llamacpp() -> None:
    """llama.cpp's log to errors only, as every ``Llama(verbose=False)`` of this module sets it
    (llama-cpp-python prints everything until a first Llama is made), unless the caller chose a level."""
    import logging

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
        import json

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


_STATE_PROBE = list(range(300, 316))  # low ids: a trimmed vocabulary keeps them


class StateLayout:
    """llama.cpp's sequence-state blob for one sequence of a plain KV cache, as read back from a
    state llama.cpp wrote itself (see ``read``): a 4-byte magic and the sequence id, one stream,
    the cell count, each cell's position, sequence count (1) and sequence id, then whether V is
    transposed (never, with flash attention), the layer count, and per layer the F16 key rows,
    then per layer the F16 value rows. ``read`` returns None for anything else."""

    F16 = 1  # ggml's type id

    def __init__(self, magic: bytes, layers: int, key_width: int, value_width: int):
        self.magic, self.layers, self.key_width, self.value_width = magic, layers, key_width, value_width

    @classmethod
    def read(cls, blob: bytes, cells: int) -> "tuple[StateLayout, list[np.ndarray]] | None":
        """(layout, every layer's keys [cells, key_width]) of a state blob holding ``cells`` cells, or None."""
        import struct

        try:
            if struct.unpack_from("<iII", blob, 4) != (0, 1, cells):
                return None
            if blob[16 : 16 + 12 * cells] != _cell_records(cells):
                return None
            offset = 16 + 12 * cells
            v_trans, layers = struct.unpack_from("<II", blob, offset)
            offset += 8
            widths, keys = [], []
            for part in ("keys", "values"):
                for _ in range(layers):
                    kind, row_bytes = struct.unpack_from("<iQ", blob, offset)
                    if kind != cls.F16 or row_bytes % 2:
                        return None
                    rows = np.frombuffer(blob, dtype="<f2", count=cells * row_bytes // 2, offset=offset + 12)
                    offset += 12 + cells * row_bytes
                    widths.append(row_bytes // 2)
                    if part == "keys":
                        keys.append(rows.reshape(cells, -1).astype(np.float32))
            if v_trans != 0 or offset != len(blob) or len(set(widths[:layers])) != 1 or len(set(widths[layers:])) != 1:
                return None
        except (struct.error, ValueError):
            return None
        return cls(blob[:4], layers, widths[0], widths[-1]), keys

    def blob(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> bytes:
        """The state of one sequence whose cells 0..T-1 hold these keys / values (per layer [T, width])."""
        import struct

        cells = keys[0].shape[0]
        parts = [self.magic, struct.pack("<iII", 0, 1, cells), _cell_records(cells), struct.pack("<II", 0, self.layers)]
        for rows in list(keys) + list(values):
            half = rows.to(torch.float16).contiguous().numpy()
            parts += [struct.pack("<iQ", self.F16, 2 * half.shape[1]), half.tobytes()]
        return b"".join(parts)


def _cell_records(cells: int) -> bytes:
    """Cells 0..cells-1 of sequence 0: position, one sequence id, that id (int32 each)."""
    return np.array([(i, 1, 0) for i in range(cells)], dtype="<i4").tobytes()


def _cached_rows(runner, cells: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Row 0's keys and values per layer of an HFRunner's cache, as [cells, heads * head_dim]
    (the head-major order llama.cpp keeps them in)."""
    def rows(t: torch.Tensor) -> torch.Tensor:  # [B, heads, slots, dim] -> [cells, heads * dim]
        return t[0, :, :cells].transpose(0, 1).reshape(cells, -1)

    layers = runner.cache.layers
    return [rows(layer.keys) for layer in layers], [rows(layer.values) for layer in layers]


class LlamaCppRunner:
    supports_batches = False  # one row (sequence 0)

    def __init__(self, gguf_path: str, n_ctx: int = 4096, threads: int | None = None, n_batch: int = 512,
                 prefill_runner=None):
        """prefill_runner: the same draft model on the int8 path (an HFRunner), to prefill prompts
        there (module glossary); None: llama.cpp prefills them."""
        try:
            from llama_cpp import Llama
        except ImportError:
            raise SpecDecodeError('the llamacpp runner needs llama-cpp-python: pip install "specdecode[llamacpp]"') from None
        threads = threads or max(1, len(os.sched_getaffinity(0)))
        # flash attention: a 160-token prompt prefill 531 -> 490 ms, a draft token 11.1 -> 10.8 ms
        # (docs/benchmarks.md section 15)
        self.llm = Llama(gguf_path, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=threads,
                         n_threads_batch=threads, logits_all=False, flash_attn=True, verbose=False)
        self._own_vocab = int(self.llm.n_vocab())
        self.vocabulary = VocabularyMap.of(gguf_path)  # a trimmed vocabulary speaks the source's ids outside
        self.vocab_size = self._own_vocab if self.vocabulary is None else self.vocabulary.source_size
        self.max_context = n_ctx
        self.device = torch.device("cpu")
        self._n_batch = n_batch
        self._length = 0
        self._prefill_runner, self._state = prefill_runner, None
        if prefill_runner is not None:
            self._state = self._check_state_layout()

    def _check_state_layout(self) -> "StateLayout | None":
        """The layout of llama.cpp's sequence state, if a probe reads back as StateLayout with keys
        close to the int8 path's (the same heads in the same order); else None, with a warning."""
        import sys

        probe = torch.tensor([_STATE_PROBE])
        self.prefill(probe)
        found = StateLayout.read(self._state_blob(), probe.shape[1])
        close = False
        if found is not None:
            layout, theirs = found
            self._prefill_runner.prefill(probe)
            keys, values = _cached_rows(self._prefill_runner, probe.shape[1])
            close = (len(keys) == layout.layers and all(k.shape[1] == layout.key_width for k in keys)
                     and all(v.shape[1] == layout.value_width for v in values)
                     and all(torch.nn.functional.cosine_similarity(k.flatten(), torch.from_numpy(t).flatten(), dim=0) > 0.9
                             for k, t in zip(keys, theirs)))
        self.reset(1)
        if not close:
            print("specdecode: warning: this llama.cpp build keeps its cache in a layout specdecode does not know; "
                  "the draft prefills prompts in llama.cpp", file=sys.stderr)
            return None
        return found[0]

    def _state_blob(self) -> bytes:
        import ctypes

        import llama_cpp

        size = llama_cpp.llama_state_seq_get_size(self.llm._ctx.ctx, 0)
        buffer = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(self.llm._ctx.ctx, buffer, size, 0)
        return bytes(buffer)[:written]

    @property
    def prefills_on_int8(self) -> bool:
        return self._state is not None

    @property
    def lengths(self) -> torch.Tensor:
        return torch.tensor([self._length])

    def reset(self, batch_size: int = 1) -> None:
        if batch_size != 1:
            raise ValueError("the llamacpp runner decodes one row")
        self.llm._ctx.kv_cache_seq_rm(0, 0, -1)
        self._length = 0

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:  # [1, T] -> [1, V]
        self.reset(ids.shape[0])
        if self._state is None:
            return self._decode(ids[0].tolist(), all_logits=False)[None, -1]
        return self._prefill_from_int8(ids)

    def _prefill_from_int8(self, ids: torch.Tensor) -> torch.Tensor:  # [1, T] -> [1, V]
        """Score the prompt on the int8 path and copy its keys and values in (module glossary)."""
        import ctypes

        import llama_cpp

        cells = ids.shape[1]
        self._check_room(cells)
        logits = self._prefill_runner.prefill(ids)
        blob = self._state.blob(*_cached_rows(self._prefill_runner, cells))
        source = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        if llama_cpp.llama_state_seq_set_data(self.llm._ctx.ctx, source, len(blob), 0) != len(blob):
            raise SpecDecodeError("llama.cpp refused the draft's prompt cache")
        self._length = cells
        return logits

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [1, S] -> [1, S, V]
        if ids.shape[0] != 1:
            raise ValueError("the llamacpp runner decodes one row")
        return self._decode(ids[0].tolist(), all_logits=True)[None]

    def truncate(self, lengths: torch.Tensor) -> None:
        keep = int(lengths[0])
        if not 0 <= keep <= self._length:
            raise ValueError(f"cannot truncate a cache of {self._length} tokens to {keep}")
        self.llm._ctx.kv_cache_seq_rm(0, keep, -1)
        self._length = keep

    def _check_room(self, new_tokens: int) -> None:
        if self._length + new_tokens > self.max_context:
            raise SpecDecodeError(f"context of {self._length + new_tokens} tokens exceeds the draft's {self.max_context}")

    def _decode(self, tokens: list[int], all_logits: bool) -> torch.Tensor:
        self._check_room(len(tokens))
        if self.vocabulary is not None:
            tokens = self.vocabulary.own_ids(tokens)
        out = []
        for start in range(0, len(tokens), self._n_batch):
            chunk = tokens[start : start + self._n_batch]
            self.llm._batch.set_batch(chunk, n_past=self._length, logits_all=all_logits)
            self.llm._ctx.decode(self.llm._batch)
            rows = len(chunk) if all_logits else 1
            logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(rows * self._own_vocab,))
            own = torch.from_numpy(logits.reshape(rows, self._own_vocab))
            out.append(own.clone() if self.vocabulary is None else self.vocabulary.source_logits(own))
            self._length += len(chunk)
        return torch.cat(out) if all_logits else out[-1]
