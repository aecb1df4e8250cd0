"""A Runner over a transformers causal LM, with a KV cache that keeps ragged rows.

This is the only module that calls transformers models.

Glossary:
- *cache length*: how many tokens a row's KV cache holds; rows of a batch may differ
  (``runners.ragged_cache``).
- *active rows*: the rows a forward runs over; the others are left untouched, so a finished row
  costs nothing and a freed slot can be prefilled alone.
- *counts*: how many of a row's block tokens are real; the rest is right padding, scored and
  then dropped from that row's cache.
- *logits width*: the model's output vocabulary, which may exceed the tokenizer's.
- *fast path*: a direct decode loop given at construction (``runners.lean.LeanForward``, chosen
  by ``runners.factory``): it takes every pass whose rows all have 1 to ``fast.max_block``
  tokens, bit-identically to the module path.
- *packed forward*: with the row-wise attention (``runners.attention``), a ragged block runs as
  the real tokens of its rows back to back, no padding computed.
- *hidden-state index* (``return_hidden``): which residual-stream state of a position to return,
  as transformers numbers ``hidden_states``: 0 the token embedding, i the output of decoder
  layer i, and the layer count the final normed state the output head reads. A pass asked for
  indices returns ``(logits, states)``, states [n, S, len(indices), H] (padding positions: any values).

Every module-path forward gets an explicit additive mask [rows, 1, block, keys] (query i of row
b sees slots ``0 .. length[b] + i``), which transformers' eager and SDPA attention read; with
the row-wise attention the call also carries its layout (``runners.attention.LAYOUT_KWARG``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import SpecDecodeError
from .attention import LAYOUT_KWARG, ROWWISE_ATTENTION, BlockLayout, PackedLayout
from .ragged_cache import RaggedCache

MAX_BATCH = 1 << 20  # rows a batch may have: bounded by memory, not by the runner


class HFRunner:
    max_batch = MAX_BATCH

    def __init__(self, model, fast=None):
        """model: a transformers PreTrainedModel; fast: the fast path for it (module glossary), or None."""
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        config = model.config.get_text_config()
        self.vocab_size = int(model.get_output_embeddings().out_features)
        self.max_context = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.fast = fast
        self._rowwise = getattr(model.config, "_attn_implementation", None) == ROWWISE_ATTENTION
        self.cache: RaggedCache | None = None  # made by reset, or by the first forward

    @property
    def supports_batches(self) -> bool:
        return self.max_batch > 1

    @property
    def lengths(self) -> torch.Tensor:  # [B]
        return torch.tensor(self.cache.row_lengths if self.cache is not None else [0], dtype=torch.long)

    def reset(self, batch_size: int = 1) -> None:
        self.cache = RaggedCache(batch_size)

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, rows: Sequence[int] | None = None,
                return_hidden: Sequence[int] | None = None):
        """ids [n, T] -> logits after the last token [n, V]. With ``rows`` only those rows of the
        current batch are emptied and refilled; without, the cache is reset to n rows.
        return_hidden: (logits [n, V], states [n, T, L, H]) (module glossary: hidden-state index)."""
        if rows is None:
            self.reset(ids.shape[0])
        elif self.cache is None:
            raise ValueError("prefill of selected rows needs a batch: call reset(batch_size) first")
        else:
            for r in rows:
                self.cache.row_lengths[r] = 0
        scored = self._run(ids, rows, None, last_only=True, layers=tuple(return_hidden or ()))
        if return_hidden:
            logits, states = scored
            return logits[:, -1], states
        return scored[:, -1]

    @torch.inference_mode()
    def forward(
        self, ids: torch.Tensor, rows: Sequence[int] | None = None, counts: Sequence[int] | None = None,
        return_hidden: Sequence[int] | None = None,
    ):
        """ids [n, S] -> logits [n, S, V]: append to ``rows`` (default: every row); row j keeps
        only its first counts[j] tokens (default: all S). return_hidden: (logits [n, S, V],
        states [n, S, L, H]) (module glossary: hidden-state index)."""
        return self._run(ids, rows, counts, last_only=False, layers=tuple(return_hidden or ()))

    @torch.inference_mode()
    def forward_last(
        self, ids: torch.Tensor, rows: Sequence[int] | None = None, counts: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Like ``forward``, but only the logits after each row's last real token: [n, V]. A
        drafter catching up on many committed tokens then pays the output head once per row."""
        n, width = ids.shape
        if counts is None or all(int(c) == width for c in counts) or self._fast_takes([int(c) for c in counts]):
            return self._run(ids, rows, counts, last_only=True)[:, -1]
        logits = self._run(ids, rows, counts, last_only=False)  # [n, S, V]
        return logits[torch.arange(n), torch.tensor([int(c) for c in counts]) - 1]

    def truncate(self, lengths: torch.Tensor) -> None:
        """lengths [B]: keep exactly that many cached tokens per row."""
        if self.cache is None:
            self.reset(len(lengths))
        new = [int(n) for n in lengths]
        if len(new) != self.cache.rows_total:
            raise ValueError(f"{len(new)} lengths for a batch of {self.cache.rows_total} rows")
        for row, (n, old) in enumerate(zip(new, self.cache.row_lengths)):
            if not 0 <= n <= old:
                raise ValueError(f"cannot truncate row {row} from {old} tokens to {n}")
        self.cache.row_lengths = new

    def cached_keys_values(self, row: int, cells: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Row ``row``'s first ``cells`` cached keys and values, per layer [kv heads, cells, head dim]."""
        return self.cache.row_keys_values(row, cells)

    def _run(self, ids, rows, counts, last_only: bool, layers: tuple[int, ...] = ()):
        """logits [n, S, V] ([n, 1, V] with last_only), or (logits, states [n, S, L, H]) with layers."""
        if self.cache is None:
            self.reset(ids.shape[0])
        cache = self.cache
        rows = list(range(cache.rows_total)) if rows is None else [int(r) for r in rows]
        n, width = ids.shape
        if n != len(rows):
            raise ValueError(f"batch of {n} rows for {len(rows)} cache rows")
        counts = [width] * n if counts is None else [int(c) for c in counts]
        starts = [cache.row_lengths[r] for r in rows]
        longest = max(s + c for s, c in zip(starts, counts))
        if longest > self.max_context:
            raise SpecDecodeError(f"context of {longest} tokens exceeds the model's {self.max_context}")
        if self._fast_takes(counts):
            scored = self._run_fast(ids, rows, starts, counts, last_only, layers)
        elif not last_only and n > 1 and sum(counts) < n * width and self._packs():
            scored = self._run_packed(ids, rows, starts, counts, layers)
        else:
            scored = self._run_block(ids, rows, starts, last_only, layers)
        for r, s, c in zip(rows, starts, counts):
            cache.row_lengths[r] = s + c
        return scored

    def _fast_takes(self, counts: list[int]) -> bool:
        """Every row has 1 to fast.max_block tokens and the runner has a fast path."""
        return self.fast is not None and 0 < min(counts) and max(counts) <= self.fast.max_block

    def _packs(self) -> bool:
        """Ragged blocks run packed (no padding computed) when the model uses the row-wise attention."""
        return self._rowwise

    def _run_block(self, ids, rows, starts, last_only: bool, layers: tuple[int, ...]):
        """ids [n, S] through the module path, padding included; logits [n, S, V] ([n, 1, V] with
        last_only), and states [n, S, L, H] with layers."""
        width = ids.shape[1]
        layout = BlockLayout(rows, starts, width)
        positions = torch.tensor(starts, device=self.device)[:, None] + torch.arange(width, device=self.device)  # [n, S]
        extra = {LAYOUT_KWARG: layout} if self._rowwise else {}
        with self.cache.writing(layout):
            out = self.model(input_ids=ids.to(self.device), position_ids=positions, attention_mask=self._mask(starts, width),
                             cache=self.cache, use_cache=True, logits_to_keep=1 if last_only else 0,
                             output_hidden_states=bool(layers), **extra)
        if layers:
            return out.logits, torch.stack([out.hidden_states[i] for i in layers], dim=2)
        return out.logits

    def _run_fast(self, ids, rows, starts, counts, last_only: bool, layers: tuple[int, ...]):
        """Each row's real tokens back to back through the fast path; logits [n, S, V] (zeros in
        padding), or [n, 1, V] after each row's last token with last_only; states [n, S, L, H] with layers."""
        n, width = ids.shape
        flat = ids[0] if n == 1 and counts[0] == width else torch.cat([ids[j, :c] for j, c in enumerate(counts)])
        scored = self.fast(flat.to(self.device), self.cache, list(zip(rows, starts, counts)), keep_last=last_only,
                           return_hidden=layers)
        if not layers:
            return self._fast_logits(scored, counts, width, last_only)
        logits, states = scored
        return self._fast_logits(logits, counts, width, last_only), _padded(states, counts, width)

    @staticmethod
    def _fast_logits(logits: torch.Tensor, counts: list[int], width: int, last_only: bool) -> torch.Tensor:
        """The fast path's logits ([T, V], or [n, V] with last_only) in the block's shape."""
        n = len(counts)
        if last_only:
            return logits[:, None]
        if n == 1 and counts[0] == width:
            return logits[None]
        return _padded(logits, counts, width)

    def _run_packed(self, ids, rows, starts, counts, layers: tuple[int, ...]):
        """Score only the real tokens, as one sequence; logits come back padded [n, S, V] (zeros in
        padding), and states [n, S, L, H] with layers."""
        layout = PackedLayout(rows, starts, counts, self.device)
        flat = torch.cat([ids[j, :c] for j, c in enumerate(counts)])[None]  # [1, T]
        positions = layout.token_slots[None]  # a token's cache slot is its position
        # a 4D mask is taken as given (transformers builds none); the layout says who sees what
        placeholder = torch.zeros((1, 1, flat.shape[1], 1), dtype=self.dtype, device=self.device)
        with self.cache.writing(layout):
            out = self.model(input_ids=flat.to(self.device), position_ids=positions, attention_mask=placeholder,
                             cache=self.cache, use_cache=True, logits_to_keep=0, output_hidden_states=bool(layers),
                             **{LAYOUT_KWARG: layout})
        logits = _padded(out.logits[0], counts, ids.shape[1])
        if layers:
            return logits, _padded(torch.stack([out.hidden_states[i][0] for i in layers], dim=1), counts, ids.shape[1])
        return logits

    def _mask(self, starts: list[int], width: int) -> torch.Tensor:
        """[n, 1, width, keys] additive mask: query i of row j sees slots 0 .. starts[j] + i."""
        keys = max(starts) + width
        visible = torch.tensor(starts, device=self.device)[:, None] + torch.arange(width, device=self.device)  # [n, S]
        allowed = torch.arange(keys, device=self.device)[None, None, :] <= visible[:, :, None]  # [n, S, keys]
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask[:, None]


def _padded(logits: torch.Tensor, counts: list[int], width: int) -> torch.Tensor:
    """logits [T, ...] of rows' tokens back to back (row j has counts[j]) -> [n, width, ...], zeros in padding."""
    padded = logits.new_zeros((len(counts), width) + tuple(logits.shape[1:]))
    offset = 0
    for j, c in enumerate(counts):
        padded[j, :c] = logits[offset : offset + c]
        offset += c
    return padded
