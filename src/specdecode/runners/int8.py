"""A fast, batch-invariant CPU path: int8 weights with per-token int8 activations (fbgemm).

Glossary:
- *per-channel weight scale*: each output row of a Linear is stored as int8 with its own scale.
- *per-token activation scale*: each token's input vector is quantised with its own scale, so
  a token's result never depends on which other tokens share the matmul. torch's dynamic int8
  Linear picks one scale for the whole input (min/max over every token), which makes a
  position's logits depend on its block and breaks exact speculative decoding.
- *fixed token quantisation*: to get per-token scales out of fbgemm's per-tensor kernel, every
  token is first divided by its own absolute maximum (so it spans at most -1..+1) and then
  quantised with one fixed scale and zero point (those the dynamic kernel picks for the range
  -1..+1). Each token's quantisation depends on that token alone, the integer accumulation is
  exact, and the result is scaled back per token. A position's logits are then bit-identical
  whether it is scored alone or inside a block. (Earlier versions added an *anchor row* holding
  -1 and +1 so that the dynamic kernel chose those parameters itself: the same integers, one
  row and one min/max pass dearer.)

- *row-wise attention*: quantisation turns a one-ulp difference upstream into a whole quantum,
  so attention must be bit-identical too. transformers' SDPA path takes a different route for
  one query than for many (packed GQA vs repeated KV, different kernels), so this path scores
  each query row with its own single-query attention over exactly the keys it may see: the
  same call, with the same shapes, as when that token is decoded alone.

The transform replaces the ``nn.Linear`` modules of a loaded model once (nothing is restored
later) and selects the row-wise attention; norms and embeddings stay in fp32.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

def int8_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines and _FIXED_SCALE_LINEAR is not None


def _pack(weight: torch.Tensor):
    """float32 [out, in] -> fbgemm packed int8 weight with one scale per output row."""
    scale = (weight.abs().amax(dim=1).clamp(min=1e-12) / 127).to(torch.float64)  # [out]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensor constructors warn about a future deprecation
        qweight = torch.quantize_per_channel(weight, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(qweight, None)


# The quantisation every token gets once divided by its absolute maximum (so it spans -1..+1):
# what fbgemm's dynamic linear chooses for an input whose minimum is -1 and maximum +1 (scale
# (max - min) / 255, zero point round-half-even(127.5)). Given to fbgemm as fixed parameters, no
# token's quantisation can depend on another's (see the module glossary).
TOKEN_SCALE, TOKEN_ZERO_POINT = 2.0 / 255.0, 128


def _per_token_matmul(packed, rows: torch.Tensor) -> torch.Tensor:
    """rows [M, in] float32 -> [M, out]: each row divided by its absolute maximum, quantised
    with the fixed (TOKEN_SCALE, TOKEN_ZERO_POINT), multiplied in integers and scaled back.

    The same integers and the same result as the anchor-row trick (module glossary), without
    the extra row and the min/max pass: 0.60 -> 0.50 ms for 6 tokens x 1536 -> 17920 here."""
    # abs().amax: the same value as the infinity norm (a maximum is exact), at a fraction of
    # linalg.vector_norm's time on CPU (7 against 30 us for 6 x 1536, 121 against 1979 us for 150 x 8960)
    amax = rows.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-30)  # [M, 1]
    return _FIXED_SCALE_LINEAR(rows / amax, TOKEN_SCALE, TOKEN_ZERO_POINT, packed).mul_(amax)


# fbgemm's linear with a given input scale and zero point and float output (None in a torch without it)
_FIXED_SCALE_LINEAR = getattr(torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32", None)


def _float_rows(x: torch.Tensor, width: int) -> torch.Tensor:  # [..., width] -> [M, width] float32
    rows = x.reshape(-1, width)
    return rows if rows.dtype == torch.float32 else rows.float()


def _like_input(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return out if out.dtype == x.dtype else out.to(x.dtype)


class PerTokenInt8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self._packed = _pack(linear.weight.detach().to(torch.float32))
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = None if linear.bias is None else linear.bias.detach().to(torch.float32).clone()
        self.register_buffer("bias", bias)

    def rows(self, rows: torch.Tensor) -> torch.Tensor:  # [M, in] float32 -> [M, out] float32
        out = _per_token_matmul(self._packed, rows)
        return out if self.bias is None else out.add_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        out = self.rows(_float_rows(x, self.in_features))
        return _like_input(out.view(*x.shape[:-1], self.out_features), x)


class FusedInt8Group:
    """Sibling linears that read the same input (q/k/v, gate/up) as one int8 matmul.

    Each member is a ``FusedInt8Member`` module; the first member called with an input runs the
    stacked weight once and keeps the result, and the others called with that same tensor take
    their slice. Every output column is the same integer dot product and the same per-row
    rescale as in its own matmul, so the result is bit-identical to unfused per-token linears,
    with a third of the calls for q/k/v. A member called with a different input (a model that
    feeds its siblings different tensors) simply recomputes: correct either way."""

    def __init__(self, linears: list[nn.Linear]):
        self.packed = _pack(torch.cat([lin.weight.detach().to(torch.float32) for lin in linears]))
        self.in_features = linears[0].in_features
        self.bounds, start = [], 0
        for lin in linears:
            self.bounds.append((start, start + lin.out_features))
            start += lin.out_features
        # one add for the whole group; a member without a bias gets zeros there
        biases = [lin.bias if lin.bias is not None else torch.zeros(lin.out_features) for lin in linears]
        has_bias = any(lin.bias is not None for lin in linears)
        self.bias = torch.cat([b.detach().to(torch.float32) for b in biases]) if has_bias else None
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._served: set[int] = set()

    def rows(self, rows: torch.Tensor) -> torch.Tensor:  # [M, in] float32 -> [M, sum out] float32
        out = _per_token_matmul(self.packed, rows)
        return out if self.bias is None else out.add_(self.bias)

    def output(self, x: torch.Tensor, member: int) -> torch.Tensor:  # -> [M, sum out] float32
        if self._input is not x or member in self._served:
            self._input, self._output, self._served = x, self.rows(_float_rows(x, self.in_features)), set()
        self._served.add(member)
        out = self._output
        if len(self._served) == len(self.bounds):  # every member has its slice: let go of the tensors
            self._input = self._output = None
        return out


class FusedInt8Member(nn.Module):
    def __init__(self, group: FusedInt8Group, member: int):
        super().__init__()
        self._group, self._member = group, member
        self.in_features = group.in_features
        start, stop = group.bounds[member]
        self._columns, self.out_features = slice(start, stop), stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._group.output(x, self._member)[:, self._columns]
        return _like_input(out.reshape(*x.shape[:-1], self.out_features), x)


FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


ROWWISE_ATTENTION = "specdecode_rowwise"
ROWWISE_MAX_BLOCK = 64  # longer blocks (prompt prefill) take the batched kernel


def rowwise_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [B, H, q, D] for the last q positions; key/value [B, Hkv, kv, D] -> ([B, q, H, D], None).

    Blocks up to ROWWISE_MAX_BLOCK tokens (every decode and verification step) are scored row by
    row, bit-identically to scoring each token alone: query i of batch row b attends to exactly
    the keys it may see (its row's slots up to its own position, read off the additive mask),
    with the same call and shapes as when that token is decoded alone in a batch of one. A
    longer block is a prompt prefill, which plain and speculative decoding run identically, so
    it takes transformers' batched SDPA.
    """
    packed = getattr(attention_mask, "specdecode_packed", None)
    if packed is not None:
        return _packed_attention(module, query, key, value, packed, scaling)
    if query.shape[2] > ROWWISE_MAX_BLOCK:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    batch, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
    allowed, visible = _visibility(attention_mask, batch, q_len, kv_len)
    out = []
    for b in range(batch):
        longest = kv_len if allowed is not None else max(visible[b])
        row_key, row_value = key[b : b + 1, :, :longest], value[b : b + 1, :, :longest]
        rows = []
        for i in range(q_len):
            if allowed is None:
                k, v = row_key[:, :, : visible[b][i]], row_value[:, :, : visible[b][i]]
            else:  # e.g. transformers' left padding: gather exactly the visible keys
                k, v = row_key[:, :, allowed[b, i]], row_value[:, :, allowed[b, i]]
            rows.append(_single_query(query[b : b + 1, :, i : i + 1], k, v, groups, scaling))
        out.append(torch.cat(rows, dim=2) if q_len > 1 else rows[0])  # [1, H, q, D]
    result = torch.cat(out) if batch > 1 else out[0]
    return result.transpose(1, 2).contiguous(), None


def _single_query(query, key, value, groups: int, scaling):
    """One position: query [1, H, 1, D] against key/value [1, Hkv, v, D] -> [1, H, 1, D].

    With grouped-query attention the query heads sharing a KV head are scored as that head's
    ``groups`` query rows, so the keys are never copied per head. Every path (alone, padded
    batch, packed batch) makes exactly this call for a position, hence identical bits."""
    if groups == 1:
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=scaling)
    heads, dim = query.shape[1], query.shape[3]
    grouped = query.reshape(1, heads // groups, groups, dim)
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, scale=scaling)
    return out.reshape(1, heads, 1, dim)


def _packed_attention(module, query, key, value, layout, scaling):
    """query [1, H, T, D] holding several rows' tokens (see runners.hf.PackedLayout); key/value
    [B, Hkv, kv, D] per row. Each query gets the same single-query call as when decoded alone."""
    groups = getattr(module, "num_key_value_groups", 1)
    out = []
    for row, start, count, offset in zip(layout.rows, layout.starts, layout.counts, layout.offsets):
        row_key, row_value = key[row : row + 1, :, : start + count], value[row : row + 1, :, : start + count]
        for i in range(count):
            out.append(_single_query(query[:, :, offset + i : offset + i + 1], row_key[:, :, : start + i + 1],
                                     row_value[:, :, : start + i + 1], groups, scaling))
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None


_last_visibility: list = [None, None, None]  # [mask, shape key, result]: every layer of a pass shares its mask


def _visibility(attention_mask, batch: int, q_len: int, kv_len: int):
    """-> (None, visible [B][q]) when each query sees a prefix of its row's keys, else
    (allowed [B, q, kv] bool, counts). Computed once per pass (the layers share the mask)."""
    key = (batch, q_len, kv_len)
    if attention_mask is not None and _last_visibility[0] is attention_mask and _last_visibility[1] == key:
        return _last_visibility[2]
    if attention_mask is None:  # causal over the whole key range in every row
        result = None, (kv_len - q_len + 1 + torch.arange(q_len)).expand(batch, q_len).tolist()
    else:  # [B or 1, 1, q, kv], additive (0 where visible) or boolean (True where visible)
        mask = attention_mask[:, 0, :, :kv_len]
        allowed = (mask if mask.dtype == torch.bool else mask == 0).expand(batch, q_len, kv_len)
        counts = allowed.sum(-1)  # [B, q]
        prefix = bool((allowed.long().cumprod(-1).sum(-1) == counts).all())
        # a prefix (our ragged cache) is sliced; anything else (transformers' left padding) gathered
        result = (None if prefix else allowed), counts.tolist()
        _last_visibility[:] = [attention_mask, key, result]
    return result


def use_rowwise_attention(model: nn.Module) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ROWWISE_ATTENTION, rowwise_attention)
    # transformers' own generate (the bench's Hugging Face methods, batched with left padding)
    # then builds an additive mask for it; our runner always passes its own 4D mask
    AttentionMaskInterface.register(ROWWISE_ATTENTION, eager_mask)
    model.set_attn_implementation(ROWWISE_ATTENTION)


def prepare_int8(model: nn.Module) -> nn.Module:
    """The full CPU path: int8 per-token linears and row-wise attention."""
    quantize_linears(model)
    use_rowwise_attention(model)
    return model


def quantize_linears(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear of a float32 CPU model by per-token int8 linears (siblings that
    read one input fused, see FusedInt8Group); returns the model."""
    if not int8_available():
        raise RuntimeError("this torch build has no fbgemm quantized engine")
    torch.backends.quantized.engine = "fbgemm"
    for parent in list(model.modules()):
        for names in FUSED_SIBLINGS:
            linears = [getattr(parent, name, None) for name in names]
            if all(isinstance(lin, nn.Linear) for lin in linears) and len({lin.in_features for lin in linears}) == 1:
                group = FusedInt8Group(linears)
                for i, name in enumerate(names):
                    setattr(parent, name, FusedInt8Member(group, i))
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PerTokenInt8Linear(module))
    return model
