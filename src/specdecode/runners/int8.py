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
  whether it is scored alone or inside a block.
- *anchor row*: a row holding -1 and +1 added to a block makes fbgemm's dynamic kernel choose
  the fixed parameters itself: the same integers, one row and one min/max pass dearer.
- *row-wise attention* (``runners.attention``): quantisation turns a one-ulp difference upstream
  into a whole quantum, so attention must be bit-identical too; the int8 path scores each query
  alone over exactly the keys it may see.

The transform replaces the ``nn.Linear`` modules of a loaded model once (nothing is restored
later) and selects the row-wise attention; norms and embeddings stay in fp32.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from .attention import use_rowwise_attention


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

    The same integers and the same result as an anchor row (module glossary), without the extra
    row and the min/max pass: 0.50 against 0.60 ms for 6 tokens x 1536 -> 17920 here."""
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
