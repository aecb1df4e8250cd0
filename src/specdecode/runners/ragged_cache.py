"""A transformers KV cache whose rows keep their own lengths.

Glossary:
- *cache length*: how many tokens a row's KV cache holds; rows of a batch may differ.
- *ragged cache*: per layer one preallocated buffer [rows, kv heads, capacity, head dim]; row b
  holds its tokens at slots ``0 .. length[b]-1``. A forward writes each row's new keys right
  after its own length (so a row never sees another row's tokens or padding), and truncation
  only lowers a length: nothing moves.
- *layout* (``runners.attention``): which rows the forward in progress writes, and where. The
  runner hands it to the cache for the duration of the model call (``writing``); transformers
  then calls ``update`` once per layer with only the new keys and values.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .attention import BlockLayout, PackedLayout

CAPACITY_STEP = 256  # buffers grow in whole steps, the same rule at any batch size


class RaggedLayer(DynamicLayer):
    def __init__(self) -> None:
        super().__init__()
        self.capacity = 0

    def write(self, keys: torch.Tensor, values: torch.Tensor, rows: list[int], starts: list[int], batch: int):
        """keys/values [n, H, S, D] for ``rows``; row rows[j]'s block goes to slots starts[j]..+S.
        Returns those rows' buffers [n, H, need, D], in that order."""
        need = max(starts) + keys.shape[2]
        self._make_room(keys, batch, need)
        for j, (row, start) in enumerate(zip(rows, starts)):
            self.keys[row, :, start : start + keys.shape[2]] = keys[j]
            self.values[row, :, start : start + keys.shape[2]] = values[j]
        return self._view(rows, need)

    def write_packed(self, keys: torch.Tensor, values: torch.Tensor, layout: PackedLayout, batch: int):
        """keys/values [1, H, T, D] of T tokens from several rows placed as ``layout`` says.
        Returns every row's buffer [batch, H, need, D]."""
        self._make_room(keys, batch, layout.need)
        self.keys[layout.token_rows, :, layout.token_slots] = keys[0].transpose(0, 1)
        self.values[layout.token_rows, :, layout.token_slots] = values[0].transpose(0, 1)
        return self.keys[:, :, : layout.need], self.values[:, :, : layout.need]

    def _make_room(self, like: torch.Tensor, batch: int, need: int) -> None:
        if self.keys is None or self.keys.shape[0] != batch:
            self._allocate(like, batch, need)
        elif need > self.capacity:
            self._grow(need)

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


class RaggedCache(Cache):
    """A transformers Cache whose rows have their own lengths (see the module glossary)."""

    def __init__(self, batch_size: int):
        super().__init__(layers=[])
        self.rows_total = batch_size
        self.row_lengths = [0] * batch_size
        self._layout: BlockLayout | PackedLayout | None = None  # the forward in progress

    def layer(self, layer_idx: int) -> RaggedLayer:
        while len(self.layers) <= layer_idx:
            self.layers.append(RaggedLayer())
        return self.layers[layer_idx]

    @contextmanager
    def writing(self, layout: BlockLayout | PackedLayout):
        """The model call inside writes its keys and values as ``layout`` says."""
        self._layout = layout
        try:
            yield self
        finally:
            self._layout = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layout = self._layout
        if layout is None:
            layout = BlockLayout(list(range(self.rows_total)), list(self.row_lengths), key_states.shape[2])
        if layout.packed:
            return self.layer(layer_idx).write_packed(key_states, value_states, layout, self.rows_total)
        return self.layer(layer_idx).write(key_states, value_states, layout.rows, layout.starts, self.rows_total)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        rows = range(self.rows_total) if self._layout is None else self._layout.rows
        return max((self.row_lengths[r] for r in rows), default=0)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def row_keys_values(self, row: int, cells: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Row ``row``'s first ``cells`` keys and values per layer, each [kv heads, cells, head dim]."""
        return ([layer.keys[row, :, :cells] for layer in self.layers],
                [layer.values[row, :, :cells] for layer in self.layers])
