"""A Runner over a transformers causal LM, with a KV cache that keeps ragged rows.

This is the only module that calls transformers models.

Glossary:
- *cache length*: how many tokens a row's KV cache holds; rows of a batch may differ.
- *ragged cache*: per layer one preallocated buffer [rows, kv heads, capacity, head dim]; row b
  holds its tokens at slots ``0 .. length[b]-1``. A forward writes each row's new keys right
  after its own length (so a row never sees another row's tokens or padding), and truncation
  only lowers a length: nothing moves.
- *active rows*: the rows a forward runs over; the others are left untouched, so a finished row
  costs nothing and a freed slot can be prefilled alone.
- *counts*: how many of a row's block tokens are real; the rest is right padding, scored and
  then dropped from that row's cache.
- *logits width*: the model's output vocabulary, which may exceed the tokenizer's.

Every forward gets an explicit additive mask [rows, 1, block, keys]: query i of row b sees
slots ``0 .. length[b] + i``. The same mask works for transformers' eager and SDPA attention and
tells the row-wise attention of ``runners.int8`` each query's visible length.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer

from ..errors import SpecDecodeError

CAPACITY_STEP = 256  # buffers grow in whole steps, the same rule at any batch size


class _RaggedLayer(DynamicLayer):
    def __init__(self) -> None:
        super().__init__()
        self.capacity = 0

    def write(self, keys: torch.Tensor, values: torch.Tensor, rows: list[int], starts: list[int], batch: int):
        """keys/values [n, H, S, D] for ``rows``; row rows[j]'s block goes to slots starts[j]..+S."""
        need = max(starts) + keys.shape[2]
        if self.keys is None or self.keys.shape[0] != batch:
            self._allocate(keys, batch, need)
        elif need > self.capacity:
            self._grow(need)
        for j, (row, start) in enumerate(zip(rows, starts)):
            self.keys[row, :, start : start + keys.shape[2]] = keys[j]
            self.values[row, :, start : start + keys.shape[2]] = values[j]
        return self._view(rows, need)

    def write_packed(self, keys: torch.Tensor, values: torch.Tensor, token_rows: torch.Tensor,
                     token_slots: torch.Tensor, need: int, batch: int):
        """keys/values [1, H, T, D] of T tokens from several rows: token t goes to row token_rows[t],
        slot token_slots[t]. Returns every row's buffer up to ``need`` slots."""
        if self.keys is None or self.keys.shape[0] != batch:
            self._allocate(keys, batch, need)
        elif need > self.capacity:
            self._grow(need)
        self.keys[token_rows, :, token_slots] = keys[0].transpose(0, 1)
        self.values[token_rows, :, token_slots] = values[0].transpose(0, 1)
        return self.keys[:, :, :need], self.values[:, :, :need]

    def _view(self, rows: list[int], need: int):
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return self.keys[rows[0] : rows[0] + len(rows), :, :need], self.values[rows[0] : rows[0] + len(rows), :, :need]
        index = torch.tensor(rows, device=self.keys.device)
        return self.keys.index_select(0, index)[:, :, :need], self.values.index_select(0, index)[:, :, :need]

    def _allocate(self, like: torch.Tensor, batch: int, need: int) -> None:
        self.capacity = -(-need // CAPACITY_STEP) * CAPACITY_STEP
        shape = (batch, like.shape[1], self.capacity, like.shape[3])
        self.keys = torch.zeros(shape, dtype=like.dtype, device=like.device)
        self.values = torch.zeros(shape, dtype=like.dtype, device=like.device)
        self.device, self.is_initialized = like.device, True

    def _grow(self, need: int) -> None:
        capacity = -(-need // CAPACITY_STEP) * CAPACITY_STEP
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = torch.zeros(old.shape[:2] + (capacity,) + old.shape[3:], dtype=old.dtype, device=old.device)
            new[:, :, : self.capacity] = old
            setattr(self, name, new)
        self.capacity = capacity


class PackedLayout:
    """A packed forward: the real tokens of several rows in one sequence [1, T] (no padding).

    Segment j is row ``rows[j]``: tokens ``offsets[j] .. offsets[j] + counts[j] - 1`` of the
    sequence, at slots ``starts[j] ..`` of that row. Only the row-wise attention of
    ``runners.int8`` reads it (it travels on the mask tensor as ``specdecode_packed``)."""

    def __init__(self, rows: list[int], starts: list[int], counts: list[int], device):
        self.rows, self.starts, self.counts = rows, starts, counts
        self.offsets = [sum(counts[:j]) for j in range(len(counts))]
        self.need = max(s + c for s, c in zip(starts, counts))
        self.token_rows = torch.tensor([r for r, c in zip(rows, counts) for _ in range(c)], device=device)
        self.token_slots = torch.tensor([s + i for s, c in zip(starts, counts) for i in range(c)], device=device)


class RaggedCache(Cache):
    """A transformers Cache whose rows have their own lengths (see the module glossary)."""

    def __init__(self, batch_size: int):
        super().__init__(layers=[])
        self.rows_total = batch_size
        self.row_lengths = [0] * batch_size
        self.rows: list[int] = list(range(batch_size))  # active rows of the forward in progress
        self.packed: PackedLayout | None = None  # set during a packed forward

    def layer(self, layer_idx: int) -> _RaggedLayer:
        while len(self.layers) <= layer_idx:
            self.layers.append(_RaggedLayer())
        return self.layers[layer_idx]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.packed is not None:
            p = self.packed
            return self.layer(layer_idx).write_packed(key_states, value_states, p.token_rows, p.token_slots, p.need, self.rows_total)
        starts = [self.row_lengths[r] for r in self.rows]
        return self.layer(layer_idx).write(key_states, value_states, self.rows, starts, self.rows_total)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.row_lengths[r] for r in self.rows) if self.rows else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0


class HFRunner:
    supports_batches = True  # prefill(rows=...), forward(rows=..., counts=...), ragged truncate

    def __init__(self, model: PreTrainedModel):
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        config = model.config.get_text_config()
        self.vocab_size = int(model.get_output_embeddings().out_features)
        self.max_context = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.cache: RaggedCache | None = None  # made by reset, or by the first forward
        self._lean = None  # runners.lean.LeanForward once the model turns out to support it
        self._lean_checked = False

    @property
    def lengths(self) -> torch.Tensor:  # [B]
        return torch.tensor(self.cache.row_lengths if self.cache else [0], dtype=torch.long)

    def reset(self, batch_size: int = 1) -> None:
        self.cache = RaggedCache(batch_size)

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, rows: Sequence[int] | None = None) -> torch.Tensor:
        """ids [n, T] -> logits after the last token [n, V]. With ``rows`` only those rows of the
        current batch are emptied and refilled; without, the cache is reset to n rows."""
        if rows is None:
            self.reset(ids.shape[0])
        elif self.cache is None:
            raise ValueError("prefill of selected rows needs a batch: call reset(batch_size) first")
        else:
            for r in rows:
                self.cache.row_lengths[r] = 0
        return self._run(ids, rows, None, last_only=True)[:, -1]

    @torch.inference_mode()
    def forward(
        self, ids: torch.Tensor, rows: Sequence[int] | None = None, counts: Sequence[int] | None = None
    ) -> torch.Tensor:
        """ids [n, S] -> logits [n, S, V]: append to ``rows`` (default: every row); row j keeps
        only its first counts[j] tokens (default: all S)."""
        return self._run(ids, rows, counts, last_only=False)

    @torch.inference_mode()
    def forward_last(
        self, ids: torch.Tensor, rows: Sequence[int] | None = None, counts: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Like ``forward``, but only the logits after each row's last real token: [n, V]. A
        drafter catching up on many committed tokens then pays the output head once per row."""
        n, width = ids.shape
        if counts is None or all(int(c) == width for c in counts) or self._lean_takes([int(c) for c in counts]):
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

    def _run(self, ids, rows, counts, last_only: bool) -> torch.Tensor:
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
        if self._lean_takes(counts):
            return self._run_lean(ids, rows, starts, counts, last_only)
        if not last_only and n > 1 and sum(counts) < n * width and self._packs():
            return self._run_packed(ids, rows, starts, counts)
        positions = torch.tensor(starts, device=self.device)[:, None] + torch.arange(width, device=self.device)
        cache.rows = rows
        try:
            out = self.model(
                input_ids=ids.to(self.device),
                position_ids=positions,
                attention_mask=self._mask(starts, width),
                cache=cache,
                use_cache=True,
                logits_to_keep=1 if last_only else 0,
            )
        finally:
            cache.rows = list(range(cache.rows_total))
        for r, s, c in zip(rows, starts, counts):
            cache.row_lengths[r] = s + c
        return out.logits

    def _lean_forward(self):
        """The direct decode loop of runners.lean when this model is one it mirrors, else None.
        Checked on first use: the int8 transform may be applied after the runner is made."""
        if not self._lean_checked:
            from .lean import LeanForward

            self._lean = LeanForward(self.model) if LeanForward.supports(self.model) else None
            self._lean_checked = True
        return self._lean

    def _lean_takes(self, counts: list[int]) -> bool:
        """Every row has 1 to max_block tokens and the model is one runners.lean mirrors."""
        lean = self._lean_forward()
        return lean is not None and 0 < min(counts) and max(counts) <= lean.max_block

    def _run_lean(self, ids, rows, starts, counts, last_only: bool) -> torch.Tensor:
        """Each row's real tokens back to back through runners.lean; logits [n, S, V] (zeros in
        padding), or [n, 1, V] after each row's last token with last_only."""
        n, width = ids.shape
        flat = ids[0] if n == 1 and counts[0] == width else torch.cat([ids[j, :c] for j, c in enumerate(counts)])
        logits = self._lean(flat.to(self.device), self.cache, list(zip(rows, starts, counts)), keep_last=last_only)
        for r, s, c in zip(rows, starts, counts):
            self.cache.row_lengths[r] = s + c
        if last_only:
            return logits[:, None]
        if n == 1 and counts[0] == width:
            return logits[None]
        return _padded(logits, counts, width)

    def _packs(self) -> bool:
        """Ragged blocks run packed (no padding computed) when the model uses the row-wise attention."""
        from .int8 import ROWWISE_ATTENTION

        return getattr(self.model.config, "_attn_implementation", None) == ROWWISE_ATTENTION

    def _run_packed(self, ids, rows, starts, counts) -> torch.Tensor:
        """Score only the real tokens, as one sequence; logits come back padded [n, S, V] (zeros in padding)."""
        cache = self.cache
        layout = PackedLayout(rows, starts, counts, self.device)
        flat = torch.cat([ids[j, :c] for j, c in enumerate(counts)])[None]
        positions = layout.token_slots[None]  # a token's cache slot is its position
        marker = torch.zeros((1, 1, flat.shape[1], 1), dtype=self.dtype, device=self.device)
        marker.specdecode_packed = layout
        cache.packed = layout
        try:
            out = self.model(input_ids=flat.to(self.device), position_ids=positions, attention_mask=marker,
                             cache=cache, use_cache=True, logits_to_keep=0)
        finally:
            cache.packed = None
        for r, s, c in zip(rows, starts, counts):
            cache.row_lengths[r] = s + c
        return _padded(out.logits[0], counts, ids.shape[1])

    def _mask(self, starts: list[int], width: int) -> torch.Tensor:
        """[n, 1, width, keys] additive mask: query i of row j sees slots 0 .. starts[j] + i."""
        keys = max(starts) + width
        visible = torch.tensor(starts, device=self.device)[:, None] + torch.arange(width, device=self.device)  # [n, S]
        allowed = torch.arange(keys, device=self.device)[None, None, :] <= visible[:, :, None]  # [n, S, keys]
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask[:, None]


def _padded(logits: torch.Tensor, counts: list[int], width: int) -> torch.Tensor:
    """logits [T, V] of rows' tokens back to back (row j has counts[j]) -> [n, width, V], zeros in padding."""
    padded = logits.new_zeros((len(counts), width, logits.shape[-1]))
    offset = 0
    for j, c in enumerate(counts):
        padded[j, :c] = logits[offset : offset + c]
        offset += c
    return padded
