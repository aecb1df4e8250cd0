"""A Runner over llama.cpp (llama-cpp-python) for GGUF drafts.

Glossary:
- *draft only*: llama.cpp's CPU kernels differ by how many tokens a call scores (one token, a
  few, eight or more), so a position's logits depend on its block: fine for a drafter, whose
  numerics never change the output, but not for a target.
- *one row*: the runner decodes llama.cpp's sequence 0; it takes the ragged calling convention
  of the other runners with batch size 1 and ``rows=[0]`` (``max_batch`` is 1).
- *truncation*: removes KV entries past the kept length (``llama_memory_seq_rm``).
- *trimmed vocabulary*, *requantized draft*: smaller copies of the GGUF (``runners.gguf_files``);
  a trimmed one speaks the source's ids outside through its ``VocabularyMap``.
- *prefill on the int8 path*: given the same draft model on the int8 path, prompts are scored
  there and their keys and values copied into llama.cpp's cache (``runners.llamacpp_state``).

The ``Llama`` object loads the model and makes the context; decoding goes through
llama-cpp-python's public C bindings on its ``ctx``, with a batch of this runner's own.
"""

from __future__ import annotations

import ctypes
import logging
import os
import weakref
from typing import Sequence

import numpy as np
import torch

from ..errors import SpecDecodeError
from .gguf_files import VocabularyMap, quiet_llamacpp, requantized_gguf, trim_vocabulary, trimmed_gguf, vocabulary_file
from .llamacpp_build import llamacpp_available, llamacpp_fast, llamacpp_problem
from .llamacpp_state import STATE_PROBE, StateLayout, head_major_rows

# importable from here for the runner's callers
__all__ = ["LlamaCppRunner", "VocabularyMap", "StateLayout", "llamacpp_available", "llamacpp_fast", "llamacpp_problem",
           "quiet_llamacpp", "requantized_gguf", "trim_vocabulary", "trimmed_gguf", "vocabulary_file"]

log = logging.getLogger("specdecode.runners.llamacpp")
_ONE_ROW = "the llamacpp runner decodes one row"


class LlamaCppRunner:
    max_batch = 1  # sequence 0 only

    def __init__(self, gguf_path: str, n_ctx: int = 4096, threads: int | None = None, n_batch: int = 512,
                 prefill_runner=None):
        """prefill_runner: the same draft model on the int8 path (an HFRunner), to prefill prompts
        there (module glossary); None: llama.cpp prefills them."""
        try:
            import llama_cpp
            from llama_cpp import Llama
        except ImportError:
            raise SpecDecodeError('the llamacpp runner needs llama-cpp-python: pip install "specdecode[llamacpp]"') from None
        threads = threads or max(1, len(os.sched_getaffinity(0)))
        # flash attention: a 160-token prompt prefill 531 -> 490 ms, a draft token 11.1 -> 10.8 ms
        # (docs/benchmarks.md, "Draft prefill on the int8 path")
        self.llm = Llama(gguf_path, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=threads,
                         n_threads_batch=threads, logits_all=False, flash_attn=True, verbose=False)
        self._lib = llama_cpp
        self._memory = llama_cpp.llama_get_memory(self.llm.ctx)
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        weakref.finalize(self, llama_cpp.llama_batch_free, self._batch)
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

    @property
    def supports_batches(self) -> bool:
        return self.max_batch > 1

    @property
    def prefills_on_int8(self) -> bool:
        return self._state is not None

    @property
    def lengths(self) -> torch.Tensor:  # [1]
        return torch.tensor([self._length])

    def reset(self, batch_size: int = 1) -> None:
        if batch_size != 1:
            raise SpecDecodeError(_ONE_ROW, field="draft_runner")
        self._lib.llama_memory_seq_rm(self._memory, 0, 0, -1)
        self._length = 0

    def prefill(self, ids: torch.Tensor, rows: Sequence[int] | None = None) -> torch.Tensor:  # [1, T] -> [1, V]
        _check_one_row(ids, rows)
        self.reset(ids.shape[0])
        if self._state is None:
            return self._decode(ids[0].tolist(), all_logits=False)[None, -1]
        return self._prefill_from_int8(ids)

    def forward(self, ids: torch.Tensor, rows: Sequence[int] | None = None,
                counts: Sequence[int] | None = None) -> torch.Tensor:  # [1, S] -> [1, S, V]
        """Append the first counts[0] tokens (default: all S); logits of padding positions are zeros."""
        _check_one_row(ids, rows)
        width = ids.shape[1]
        count = width if counts is None else int(counts[0])
        if count == width:
            return self._decode(ids[0].tolist(), all_logits=True)[None]
        out = torch.zeros((1, width, self.vocab_size))
        if count > 0:
            out[0, :count] = self._decode(ids[0, :count].tolist(), all_logits=True)
        return out

    def forward_last(self, ids: torch.Tensor, rows: Sequence[int] | None = None,
                     counts: Sequence[int] | None = None) -> torch.Tensor:  # [1, S] -> [1, V]
        """The logits after the last real token. Every position is scored, as ``forward`` does, so
        these are bit for bit forward's (llama.cpp's output head over one row may differ from over several)."""
        count = ids.shape[1] if counts is None else int(counts[0])
        return self.forward(ids, rows, counts)[:, max(count, 1) - 1]

    def truncate(self, lengths: torch.Tensor) -> None:  # lengths [1]
        if len(lengths) != 1:
            raise SpecDecodeError(_ONE_ROW, field="draft_runner")
        keep = int(lengths[0])
        if not 0 <= keep <= self._length:
            raise ValueError(f"cannot truncate a cache of {self._length} tokens to {keep}")
        self._lib.llama_memory_seq_rm(self._memory, 0, keep, -1)
        self._length = keep

    def _check_room(self, new_tokens: int) -> None:
        if self._length + new_tokens > self.max_context:
            raise SpecDecodeError(f"context of {self._length + new_tokens} tokens exceeds the draft's {self.max_context}")

    def _decode(self, tokens: list[int], all_logits: bool) -> torch.Tensor:
        """Append tokens to sequence 0 in chunks of n_batch -> logits [len(tokens), V], or [V]
        after the last one without all_logits."""
        self._check_room(len(tokens))
        if self.vocabulary is not None:
            tokens = self.vocabulary.own_ids(tokens)
        out = []
        for start in range(0, len(tokens), self._n_batch):
            chunk = tokens[start : start + self._n_batch]
            self._fill_batch(chunk, all_logits)
            status = self._lib.llama_decode(self.llm.ctx, self._batch)
            if status != 0:
                raise RuntimeError(f"llama_decode returned {status}")
            rows = len(chunk) if all_logits else 1
            logits = np.ctypeslib.as_array(self._lib.llama_get_logits(self.llm.ctx), shape=(rows * self._own_vocab,))
            own = torch.from_numpy(logits.reshape(rows, self._own_vocab))
            out.append(own.clone() if self.vocabulary is None else self.vocabulary.source_logits(own))
            self._length += len(chunk)
        return torch.cat(out) if all_logits else out[-1]

    def _fill_batch(self, chunk: list[int], all_logits: bool) -> None:
        """The batch holds chunk at the next positions of sequence 0; logits for every token or the last."""
        batch = self._batch
        batch.n_tokens = len(chunk)
        for i, token in enumerate(chunk):
            batch.token[i] = token
            batch.pos[i] = self._length + i
            batch.seq_id[i][0] = 0
            batch.n_seq_id[i] = 1
            batch.logits[i] = all_logits
        batch.logits[len(chunk) - 1] = True

    def _check_state_layout(self) -> StateLayout | None:
        """The layout of llama.cpp's sequence state, if a probe reads back as StateLayout with keys
        close to the int8 path's (the same heads in the same order); else None, with a warning."""
        probe = torch.tensor([STATE_PROBE])
        cells = probe.shape[1]
        self.prefill(probe)
        found = StateLayout.read(self._state_blob(), cells)
        close = False
        if found is not None:
            layout, theirs = found
            self._prefill_runner.prefill(probe)
            keys, values = (head_major_rows(part) for part in self._prefill_runner.cached_keys_values(0, cells))
            close = (len(keys) == layout.layers and all(k.shape[1] == layout.key_width for k in keys)
                     and all(v.shape[1] == layout.value_width for v in values)
                     and all(torch.nn.functional.cosine_similarity(k.flatten(), torch.from_numpy(t).flatten(), dim=0) > 0.9
                             for k, t in zip(keys, theirs)))
        self.reset(1)
        if not close:
            log.warning("specdecode: warning: this llama.cpp build keeps its cache in a layout specdecode does not know; "
                        "the draft prefills prompts in llama.cpp")
            return None
        return found[0]

    def _state_blob(self) -> bytes:
        size = self._lib.llama_state_seq_get_size(self.llm.ctx, 0)
        buffer = (ctypes.c_uint8 * size)()
        written = self._lib.llama_state_seq_get_data(self.llm.ctx, buffer, size, 0)
        return bytes(buffer)[:written]

    def _prefill_from_int8(self, ids: torch.Tensor) -> torch.Tensor:  # [1, T] -> [1, V]
        """Score the prompt on the int8 path and copy its keys and values in (module glossary)."""
        cells = ids.shape[1]
        self._check_room(cells)
        logits = self._prefill_runner.prefill(ids)
        keys, values = (head_major_rows(part) for part in self._prefill_runner.cached_keys_values(0, cells))
        blob = self._state.blob(keys, values)
        source = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        if self._lib.llama_state_seq_set_data(self.llm.ctx, source, len(blob), 0) != len(blob):
            raise SpecDecodeError("llama.cpp refused the draft's prompt cache")
        self._length = cells
        return logits


def _check_one_row(ids: torch.Tensor, rows: Sequence[int] | None) -> None:
    if ids.shape[0] != 1:
        raise SpecDecodeError(_ONE_ROW, field="draft_runner")
    if rows is not None and [int(r) for r in rows] != [0]:
        raise SpecDecodeError(f"{_ONE_ROW} (rows=[0]), got rows={[int(r) for r in rows]}", field="draft_runner")
