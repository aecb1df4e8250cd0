"""Row-wise attention: every query scored alone, over exactly the keys it may see.

Glossary:
- *row-wise attention*: on the int8 path quantisation turns a one-ulp difference upstream into
  a whole quantum, so attention must be bit-identical too. transformers' SDPA takes a different
  route for one query than for many (packed GQA against repeated KV, other kernels), so each
  query gets its own single-query attention over the keys it sees: the same call, with the same
  shapes, as when that token is decoded alone. ``attend`` is that loop, shared by the module
  path (``rowwise_attention``) and the direct decode loop of ``runners.lean``.
- *pick*: one query position and the keys it sees: (query row, query index, key row, key
  slots), the slots a ``slice`` (a prefix of the row) or a boolean index [kv].
- *segment*: ``count`` consecutive queries of one row: query ``query_start + i`` of batch row
  ``query_row`` sees slots ``0 .. start + i`` of key row ``key_row``.
- *layout*: which rows a forward writes and who sees what, handed by the runner to the model
  call as the keyword argument ``LAYOUT_KWARG`` (transformers passes the call's keyword
  arguments on to every layer's attention function). ``BlockLayout``: one row of the block per
  cache row, all ``width`` tokens written (right padding included). ``PackedLayout``: only the
  real tokens of several rows, back to back in one sequence [1, T].
"""

from __future__ import annotations

from functools import cached_property
from typing import NamedTuple

import torch

ROWWISE_ATTENTION = "specdecode_rowwise"
ROWWISE_MAX_BLOCK = 64  # longer blocks (prompt prefill) take the batched kernel
LAYOUT_KWARG = "specdecode_layout"


class Segment(NamedTuple):
    query_row: int  # batch row of the query tensor
    query_start: int  # index of the segment's first query
    key_row: int  # batch row of the key / value tensors
    start: int  # slots the first query sees before its own
    count: int  # queries in the segment


def segment_picks(segments: list[Segment]) -> list[tuple]:
    """The picks of segments, in order: query i of a segment sees its row's slots 0 .. start + i."""
    return [(s.query_row, s.query_start + i, s.key_row, slice(0, s.start + i + 1))
            for s in segments for i in range(s.count)]


class BlockLayout:
    """A padded block [n, width]: batch row j is cache row ``rows[j]``, its tokens written from
    slot ``starts[j]``; the key view the cache returns holds the rows in that order."""

    packed = False

    def __init__(self, rows: list[int], starts: list[int], width: int):
        self.rows, self.starts, self.width = rows, starts, width

    @cached_property
    def picks(self) -> list[tuple]:  # read only by a row-wise pass (blocks up to ROWWISE_MAX_BLOCK)
        return segment_picks([Segment(j, 0, j, start, self.width) for j, start in enumerate(self.starts)])


class PackedLayout:
    """A packed forward: the real tokens of several rows in one sequence [1, T] (no padding).

    Segment j is row ``rows[j]``: tokens ``offsets[j] .. offsets[j] + counts[j] - 1`` of the
    sequence, at slots ``starts[j] ..`` of that row. The cache writes token t to row
    ``token_rows[t]``, slot ``token_slots[t]``, and returns every row's keys."""

    packed = True

    def __init__(self, rows: list[int], starts: list[int], counts: list[int], device):
        self.rows, self.starts, self.counts = rows, starts, counts
        self.offsets = [sum(counts[:j]) for j in range(len(counts))]
        self.need = max(s + c for s, c in zip(starts, counts))
        self.token_rows = torch.tensor([r for r, c in zip(rows, counts) for _ in range(c)], device=device)  # [T]
        self.token_slots = torch.tensor([s + i for s, c in zip(starts, counts) for i in range(c)], device=device)  # [T]
        self.segments = [Segment(0, o, r, s, c) for r, s, c, o in zip(rows, starts, counts, self.offsets)]
        self.picks = segment_picks(self.segments)


def single_query(query, key, value, groups: int, scaling):
    """One position: query [1, H, 1, D] against key/value [1, Hkv, v, D] -> [1, H, 1, D].

    With grouped-query attention the query heads sharing a KV head are scored as that head's
    ``groups`` query rows, so the keys are never copied per head. Every path (alone, padded
    batch, packed batch, the lean loop) makes exactly this call for a position, hence identical bits."""
    if groups == 1:
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=scaling)
    heads, dim = query.shape[1], query.shape[3]
    grouped = query.reshape(1, heads // groups, groups, dim)
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, scale=scaling)
    return out.reshape(1, heads, 1, dim)


def attend(query, keys, values, picks: list[tuple], groups: int, scaling) -> torch.Tensor:
    """query [Bq, H, q, D]; keys/values [Bk, Hkv, kv, D]; picks (module glossary) -> [1, H, len(picks), D],
    position p the single-query attention of pick p."""
    out = [single_query(query[qr : qr + 1, :, qi : qi + 1], keys[kr : kr + 1, :, seen], values[kr : kr + 1, :, seen],
                        groups, scaling)
           for qr, qi, kr, seen in picks]
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


def mask_picks(attention_mask, batch: int, q_len: int, kv_len: int) -> list[tuple]:
    """The picks of a block [batch, q] read off an attention mask (None: causal over the whole
    key range), for callers that pass no layout (transformers' own generate, left padded)."""
    if attention_mask is None:
        return [(b, i, b, slice(0, kv_len - q_len + 1 + i)) for b in range(batch) for i in range(q_len)]
    mask = attention_mask[:, 0, :, :kv_len]  # [B or 1, q, kv], additive (0 where visible) or boolean
    allowed = (mask if mask.dtype == torch.bool else mask == 0).expand(batch, q_len, kv_len)
    counts = allowed.sum(-1)  # [B, q]
    if bool((allowed.long().cumprod(-1).sum(-1) == counts).all()):  # each query sees a prefix: sliced
        visible = counts.tolist()
        return [(b, i, b, slice(0, visible[b][i])) for b in range(batch) for i in range(q_len)]
    return [(b, i, b, allowed[b, i]) for b in range(batch) for i in range(q_len)]  # e.g. left padding: gathered


def rowwise_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [B, H, q, D] for the last q positions; key/value [B, Hkv, kv, D] -> ([B, q, H, D], None).

    A packed forward and blocks up to ROWWISE_MAX_BLOCK tokens (every decode and verification
    step) are scored query by query (``attend``), bit-identically to scoring each token alone.
    A longer padded block is a prompt prefill, which plain and speculative decoding run
    identically, so it takes transformers' batched SDPA."""
    layout = kwargs.get(LAYOUT_KWARG)
    batch, heads, q_len, dim = query.shape
    if not (layout is not None and layout.packed) and q_len > ROWWISE_MAX_BLOCK:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        kwargs.pop(LAYOUT_KWARG, None)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    picks = layout.picks if layout is not None else mask_picks(attention_mask, batch, q_len, key.shape[2])
    out = attend(query, key, value, picks, getattr(module, "num_key_value_groups", 1), scaling)  # [1, H, B * q, D]
    if batch == 1:
        return out.transpose(1, 2).contiguous(), None
    return out.reshape(heads, batch, q_len, dim).permute(1, 2, 0, 3).contiguous(), None


def use_rowwise_attention(model) -> None:
    """Select ``rowwise_attention`` for every layer of a transformers model."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ROWWISE_ATTENTION, rowwise_attention)
    # transformers' own generate (the bench's Hugging Face methods, batched with left padding)
    # then builds an additive mask for it; our runner always passes its own 4D mask and layout
    AttentionMaskInterface.register(ROWWISE_ATTENTION, eager_mask)
    model.set_attn_implementation(ROWWISE_ATTENTION)
