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
- *int8 matrix* (``Int8Matrix``): one matrix the path multiplies by: a lone Linear, or fused
  siblings stacked (``FusedInt8Group``). Its *quantized weight* is a torch qint8 tensor [out, in]
  with one scale per row; fbgemm's *packed weight* is made from that at every load (fbgemm keeps
  it in a layout it cannot export, so ``runners.weight_cache`` stores the quantized weight).
- *weight source*: where the quantized weights come from (``quantized``): quantised here from
  the model's float weights (``ModelWeights``), or ``runners.weight_cache``'s checkpoint reader
  and packed-weight cache.

The transform replaces the ``nn.Linear`` modules of a loaded model once (nothing is restored
later) and selects the row-wise attention; norms and embeddings stay in fp32.
"""

from __future__ import annotations

import warnings
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator, NamedTuple, Protocol

import torch
from torch import nn

from .attention import use_rowwise_attention


def int8_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines and _FIXED_SCALE_LINEAR is not None


QUANTIZE_ROWS = 8192  # rows whose absolute maxima are taken at once: bounds the temporary copy of a large matrix


def quantize_weight(weight: torch.Tensor) -> torch.Tensor:
    """float32 [out, in] -> qint8 [out, in] with one scale per output row (the row's absolute maximum / 127)."""
    amax = torch.cat([rows.abs().amax(dim=1) for rows in weight.split(QUANTIZE_ROWS)])  # [out]
    scale = (amax.clamp(min=1e-12) / 127).to(torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensor constructors warn about a future deprecation
        return torch.quantize_per_channel(weight, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)


def quantized_from(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [out, in] and float64 scales [out] (a quantized weight's int_repr and scales) -> that qint8 weight."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch._make_per_channel_quantized_tensor(values, scale, torch.zeros_like(scale, dtype=torch.long), 0)


def _pack(qweight: torch.Tensor):
    """qint8 [out, in] -> fbgemm's packed int8 weight (what its linear multiplies by)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
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
    def __init__(self, linear: nn.Linear, qweight: torch.Tensor | None = None):
        """qweight: the linear's quantized weight [out, in] (default: quantised from its weight here)."""
        super().__init__()
        self._packed = _pack(quantize_weight(_stacked([linear])) if qweight is None else qweight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = None if linear.bias is None else linear.bias.detach().to(torch.float32).clone()
        self.register_buffer("bias", bias)

    def rows(self, rows: torch.Tensor) -> torch.Tensor:  # [M, in] float32 -> [M, out] float32
        out = _per_token_matmul(self._packed, rows)
        return out if self.bias is None else out.add_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        out = self.rows(_float_rows(x, self.in_features))
        return _like_input(out.view(*x.shape[:-1], self.out_features), x)


def stacked_bias(linears: list[nn.Linear]) -> torch.Tensor | None:
    """float32 [sum out]: the linears' biases end to end (zeros for one without), or None when none has one."""
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([(lin.bias if lin.bias is not None else torch.zeros(lin.out_features)).detach().to(torch.float32)
                      for lin in linears])


class FusedGroup:
    """Sibling linears that read the same input (q/k/v, gate/up) as one matmul over their stacked
    weight (``rows``, given by each quantized path).

    Each member is a ``FusedMember`` module; the first member called with an input runs the
    stacked matmul once and keeps the result, and the others called with that same tensor take
    their slice. A member called with a different input (a model that feeds its siblings
    different tensors) simply recomputes: correct either way."""

    def __init__(self, linears: list[nn.Linear]):
        self.in_features = linears[0].in_features
        self.bounds, start = [], 0
        for lin in linears:
            self.bounds.append((start, start + lin.out_features))
            start += lin.out_features
        self.bias = stacked_bias(linears)  # one add for the whole group
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._served: set[int] = set()

    def rows(self, rows: torch.Tensor) -> torch.Tensor:  # [M, in] float32 -> [M, sum out] float32
        raise NotImplementedError

    def output(self, x: torch.Tensor, member: int) -> torch.Tensor:  # -> [M, sum out] float32
        if self._input is not x or member in self._served:
            self._input, self._output, self._served = x, self.rows(_float_rows(x, self.in_features)), set()
        self._served.add(member)
        out = self._output
        if len(self._served) == len(self.bounds):  # every member has its slice: let go of the tensors
            self._input = self._output = None
        return out


class FusedMember(nn.Module):
    """One linear of a FusedGroup: its columns of the group's output."""

    def __init__(self, group: FusedGroup, member: int):
        super().__init__()
        self._group, self._member = group, member
        self.in_features = group.in_features
        start, stop = group.bounds[member]
        self._columns, self.out_features = slice(start, stop), stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._group.output(x, self._member)[:, self._columns]
        return _like_input(out.reshape(*x.shape[:-1], self.out_features), x)


class FusedInt8Group(FusedGroup):
    """A FusedGroup on fbgemm's int8 matmul. Every output column is the same integer dot product
    and the same per-row rescale as in its own matmul, so the result is bit-identical to unfused
    per-token linears, with a third of the calls for q/k/v."""

    def __init__(self, linears: list[nn.Linear], qweight: torch.Tensor | None = None):
        """qweight: the stacked quantized weight [sum out, in] (default: quantised from the linears here)."""
        super().__init__(linears)
        self.packed = _pack(quantize_weight(_stacked(linears)) if qweight is None else qweight)

    def rows(self, rows: torch.Tensor) -> torch.Tensor:  # [M, in] float32 -> [M, sum out] float32
        out = _per_token_matmul(self.packed, rows)
        return out if self.bias is None else out.add_(self.bias)


class FusedInt8Member(FusedMember):
    """A member of a FusedInt8Group."""


FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class Int8Matrix(NamedTuple):
    """One matrix of the int8 path (module glossary): ``parent``'s Linear children ``children``,
    stacked in that order when there are several. It names its linears rather than holding
    them, so a float Linear is freed as soon as it is replaced."""

    name: str  # the linear's module name, or the parent's with the children joined by '+'
    parent: nn.Module
    children: tuple[str, ...]
    keys: tuple[str, ...]  # the linears' weights in the model's state dict
    shape: tuple[int, int]  # (sum of out_features, in_features)

    def linears(self) -> list[nn.Linear]:
        return [getattr(self.parent, child) for child in self.children]


def int8_matrices(model: nn.Module) -> list[Int8Matrix]:
    """Every matrix quantize_linears makes: fused sibling groups first, then the lone linears."""
    matrices, grouped = [], set()

    def add(parent, prefix: str, children, linears):
        shape = (sum(lin.out_features for lin in linears), linears[0].in_features)
        name = prefix + "+".join(children)
        matrices.append(Int8Matrix(name, parent, tuple(children), tuple(f"{prefix}{c}.weight" for c in children), shape))

    for parent_name, parent in model.named_modules():
        for names in FUSED_SIBLINGS:
            linears = [getattr(parent, name, None) for name in names]
            if all(isinstance(lin, nn.Linear) for lin in linears) and len({lin.in_features for lin in linears}) == 1:
                add(parent, f"{parent_name}." if parent_name else "", names, linears)
                grouped.update(id(lin) for lin in linears)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and id(module) not in grouped:
            parent_name, _, child = name.rpartition(".")
            add(model.get_submodule(parent_name) if parent_name else model, f"{parent_name}." if parent_name else "",
                [child], [module])
    return matrices


class WeightSource(Protocol):
    def quantized(self, matrices: list[Int8Matrix]) -> Iterator[tuple[Int8Matrix, torch.Tensor]]:
        """(matrix, its quantized weight [out, in]) for each matrix, in order."""


class ModelWeights:
    """Quantised here from the model's own float weights."""

    def quantized(self, matrices: list[Int8Matrix]) -> Iterator[tuple[Int8Matrix, torch.Tensor]]:
        for matrix in matrices:
            yield matrix, quantize_weight(_stacked(matrix.linears()))


def _stacked(linears) -> torch.Tensor:  # the linears' weights, stacked: float32 [sum out, in]
    weights = [lin.weight.detach().to(torch.float32) for lin in linears]
    return weights[0] if len(weights) == 1 else torch.cat(weights)


def prepare_int8(model: nn.Module, weights: WeightSource | None = None) -> nn.Module:
    """The full CPU path: int8 per-token linears and row-wise attention."""
    quantize_linears(model, weights)
    use_rowwise_attention(model)
    return model


def quantize_linears(model: nn.Module, weights: WeightSource | None = None) -> nn.Module:
    """Replace every nn.Linear of a float32 CPU model by per-token int8 linears (siblings that
    read one input fused, see FusedInt8Group); returns the model. weights: where the quantized
    weights come from (default: ModelWeights).

    fbgemm's packing is most of a load's cost once the quantized weights are cached, and it
    runs outside the GIL, so matrices are packed on ``torch.get_num_threads()`` threads while
    the next ones are read, the largest first (the output head alone takes a fifth of the
    time). A few matrices are in flight at a time, and each float Linear is dropped once its
    int8 replacement is in place."""
    if not int8_available():
        raise RuntimeError("this torch build has no fbgemm quantized engine")
    torch.backends.quantized.engine = "fbgemm"
    workers = max(1, torch.get_num_threads())
    matrices = sorted(int8_matrices(model), key=lambda m: -m.shape[0] * m.shape[1])
    pending: deque[tuple[Int8Matrix, Future]] = deque()
    with ThreadPoolExecutor(workers) as pool:
        for matrix, qweight in (weights or ModelWeights()).quantized(matrices):
            pending.append((matrix, pool.submit(_int8_modules, matrix.linears(), qweight)))
            while len(pending) > workers:
                _install(*pending.popleft())
        while pending:
            _install(*pending.popleft())
    return model


def _int8_modules(linears: list[nn.Linear], qweight: torch.Tensor) -> list[nn.Module]:
    """The int8 modules that replace ``linears``, given their (stacked) quantized weight."""
    if len(linears) == 1:
        return [PerTokenInt8Linear(linears[0], qweight)]
    group = FusedInt8Group(linears, qweight)
    return [FusedInt8Member(group, i) for i in range(len(linears))]


def _install(matrix: Int8Matrix, modules: Future) -> None:
    for name, module in zip(matrix.children, modules.result()):
        setattr(matrix.parent, name, module)
