"""A 4-bit-class, batch-invariant CPU path: grouped 4-bit weights times per-token int8 activations.

Glossary:
- *int4 weight* (``Int4Weight``): a Linear's weight [out, in] in the layout of GGUF's Q4_K, as
  ``w[o, k] = d[o, s] * sc[o, g] * q[o, k] - dmin[o, s] * m[o, g]``: *codes* q in [0, 15] for
  every input k, an unsigned 6-bit *scale* sc and *min* m per *group* g of ``GROUP`` (32)
  consecutive inputs, and two float32 *super-scales* d and dmin per *super-block* s of
  ``SUPER`` (256) inputs; 4.75 bits a weight as stored (a scale or min takes a byte).
  A GGUF tensor stored as Q4_K has exactly these numbers (``gguf_rows``: the target runs the
  file's own weights); any other weight is quantised to them (``quantize_rows``: per group the
  codes of an affine grid through its minimum and maximum, the scale chosen by a small search
  for the least squared error).
- *packed layout*: what the kernel reads, per *row block* of ``ROWS`` output rows: per group 256
  bytes of codes as nibbles and 16 bytes of scales, per pair of groups 32 bytes of mins, per
  super-block 16 float32 d, then 16 dmin (the byte order is described in ``csrc/int4_matmul.cpp``).
  Rows and inputs are padded with zeros up to whole row blocks and super-blocks.
  ``runners.weight_cache`` stores this layout as it is, so a load needs no repacking.
- *per-token activations*: each token's input is quantised alone: ``a = round(x / ascale)`` with
  ``ascale = max|x| / 127`` over that token, so no token's integers depend on its block.
- *accumulation*: per super-block two exact integer sums, ``P = sum_g sc * sum_{k in g} q * a``
  (at most 8 * 63 * 32 * 15 * 127 < 2^25) and ``Q = sum_g m * sum_{k in g} a``; then in float32,
  super-block by super-block in order, ``y = y + (float(P) * d - float(Q) * dmin)`` and finally
  ``y * ascale[t]`` (+ bias). Every implementation performs those float32 operations in that
  order, so each gives the same bits, and a position's logits are bit-identical whether it is
  scored alone or inside a block.
- *kernel*: the AVX-512 VNNI C++ implementation in ``csrc/int4_matmul.cpp``, compiled on first
  use under ``$SPECDECODE_CACHE/kernels`` (``int4_kernel``). *reference*: the same computation in
  torch (``reference_linear``), used where the kernel cannot be built or the CPU lacks VNNI; it
  forms the integer sums in float64 (far below 2^53, so exact) a chunk of rows at a time. Slow,
  bounded in memory, bit-identical to the kernel.

The transform replaces the ``nn.Linear`` modules of a loaded model once, fusing siblings that
read one input as the int8 path does (``runners.int8.int8_matrices``), and selects the row-wise
attention; norms and embeddings stay in fp32.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import warnings
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Protocol

import torch
from torch import nn

from .attention import use_rowwise_attention
from .int8 import FusedGroup, FusedMember, Int8Matrix, _float_rows, _like_input, int8_matrices, stacked_bias

GROUP = 32  # inputs per scale and min
SUPER = 256  # inputs per super-scale pair
GROUPS_PER_SUPER = SUPER // GROUP
ROWS = 16  # output rows per row block (one AVX-512 register of int32 accumulators)
BLOCK_BYTES = ROWS * GROUP // 2  # code bytes per row block and group
MAX_SCALE, MAX_CODE = 63, 15
TOKEN_FLOOR = 2.0**-100  # a token's absolute maximum is at least this (an all-zero token gets codes 0)
SCALE_CANDIDATES = (-1, 0, 1, 2)  # scales tried per group, around the one the super-scale rounds to
QUANTIZE_ELEMENTS = 1 << 18  # weights quantised at once: the temporaries of the scale search stay in cache
REFERENCE_ROWS = 512  # rows the reference turns into float64 at once

log = logging.getLogger("specdecode.runners.int4")


class Int4Rows(NamedTuple):
    """A weight's numbers before packing (module glossary), inputs padded to whole super-blocks."""

    codes: torch.Tensor  # uint8 [out, supers * SUPER] in [0, 15]
    scales: torch.Tensor  # uint8 [out, groups] in [0, 63]
    mins: torch.Tensor  # uint8 [out, groups] in [0, 63]
    d: torch.Tensor  # float32 [out, supers]
    dmin: torch.Tensor  # float32 [out, supers]

    def values(self) -> torch.Tensor:
        """The float32 weights [out, supers * SUPER] these numbers stand for."""
        out, groups = self.scales.shape
        step = self.d.repeat_interleave(GROUPS_PER_SUPER, 1) * self.scales.float()  # [out, groups]
        low = self.dmin.repeat_interleave(GROUPS_PER_SUPER, 1) * self.mins.float()
        return (self.codes.view(out, groups, GROUP).float() * step[..., None] - low[..., None]).view(out, -1)


def cat_rows(parts: list[Int4Rows]) -> Int4Rows:
    """The rows of several weights of one input width, stacked (a fused group)."""
    return Int4Rows(*(torch.cat(field) for field in zip(*parts)))


class Int4Weight(NamedTuple):
    """One matrix in the packed layout (module glossary)."""

    codes: torch.Tensor  # uint8 [out_padded / ROWS, groups, BLOCK_BYTES]
    scales: torch.Tensor  # uint8 [out_padded / ROWS, groups, ROWS]
    mins: torch.Tensor  # uint8 [out_padded / ROWS, groups / 2, 2 * ROWS]: row lane's mins of groups 2p, 2p + 1
    superscales: torch.Tensor  # float32 [out_padded / ROWS, supers, 2, ROWS]: d, then dmin
    out: int  # output rows (the rest of the last row block is padding)

    @property
    def shape(self) -> tuple[int, int]:  # (out, in_padded)
        return self.out, self.codes.shape[1] * GROUP


Matmul = Callable[[torch.Tensor, Int4Weight, "torch.Tensor | None"], torch.Tensor]  # (rows [M, in], weight, bias [out]) -> [M, out]


def _supers(in_features: int) -> int:
    return -(-in_features // SUPER)


def _groups(in_features: int) -> int:
    return _supers(in_features) * GROUPS_PER_SUPER


def quantize_weight(weight: torch.Tensor) -> Int4Weight:
    """float32 [out, in] -> its int4 weight (module glossary)."""
    return pack(quantize_rows(weight))


def quantize_rows(weight: torch.Tensor) -> Int4Rows:
    """float32 [out, in] -> its numbers (module glossary: ``quantize_rows``)."""
    chunk = max(1, QUANTIZE_ELEMENTS // max(1, weight.shape[1]))
    return cat_rows([_quantize_chunk(rows.to(torch.float32)) for rows in weight.split(chunk)])


def _quantize_chunk(weight: torch.Tensor) -> Int4Rows:
    rows, in_features = weight.shape
    supers = _supers(in_features)
    w = torch.nn.functional.pad(weight, (0, supers * SUPER - in_features)).view(rows, supers, GROUPS_PER_SUPER, GROUP)
    low = w.amin(-1).clamp(max=0)  # [r, s, 8]: the grid starts at or below zero, so zero stays near a level
    width = (w.amax(-1) - low) / MAX_CODE  # a group's ideal step
    d = width.amax(-1) / MAX_SCALE  # [r, s]
    dmin = (-low).amax(-1) / MAX_SCALE
    d = torch.where(d > 0, d, torch.ones_like(d))
    dmin = torch.where(dmin > 0, dmin, torch.ones_like(dmin))
    mins = torch.round(-low / dmin[..., None]).clamp_(0, MAX_SCALE)  # [r, s, 8]
    offset = (dmin[..., None] * mins)[..., None]  # [r, s, 8, 1]
    nearest = torch.round(width / d[..., None])
    best_error = torch.full_like(width, float("inf"))
    best = torch.zeros_like(width)
    for shift in SCALE_CANDIDATES:
        sc = (nearest + shift).clamp_(1, MAX_SCALE)
        step = (d[..., None] * sc)[..., None]
        q = torch.div(w + offset, step).round_().clamp_(0, MAX_CODE)
        error = q.mul_(step).sub_(offset).sub_(w).square_().sum(-1)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best = torch.where(better, sc, best)
    step = (d[..., None] * best)[..., None]
    codes = torch.div(w + offset, step).round_().clamp_(0, MAX_CODE).to(torch.uint8).view(rows, -1)
    return Int4Rows(codes, best.to(torch.uint8).view(rows, -1), mins.to(torch.uint8).view(rows, -1), d, dmin)


def gguf_rows(blocks, out: int, in_features: int) -> Int4Rows:
    """A GGUF tensor stored as Q4_K (its raw bytes, ``out * in / 256`` blocks of 144) -> its numbers,
    exactly (module glossary). The scale and min unpacking is the ``gguf`` package's own."""
    import numpy as np
    from gguf.quants import Q4_K

    if in_features % SUPER:
        raise ValueError(f"a Q4_K tensor's rows hold whole blocks of {SUPER}, got {in_features} inputs")
    raw = np.ascontiguousarray(np.asarray(blocks, dtype=np.uint8)).reshape(-1, 144)
    if raw.shape[0] != out * in_features // SUPER:
        raise ValueError(f"{raw.shape[0]} Q4_K blocks cannot hold a [{out}, {in_features}] tensor")
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
    scales, mins = Q4_K.get_scale_min(raw[:, 4:16].copy())
    qs = torch.from_numpy(raw[:, 16:].copy()).view(-1, 4, 1, 32)  # chunk j: group 2j low nibbles, 2j + 1 high
    codes = torch.stack([qs & 0x0F, qs >> 4], dim=2).view(out, in_features)
    supers = in_features // SUPER
    return Int4Rows(codes, torch.from_numpy(np.ascontiguousarray(scales, dtype=np.uint8)).view(out, -1),
                    torch.from_numpy(np.ascontiguousarray(mins, dtype=np.uint8)).view(out, -1),
                    torch.from_numpy(d).view(out, supers), torch.from_numpy(dmin).view(out, supers))


def pack(rows: Int4Rows) -> Int4Weight:
    """A weight's numbers -> the packed layout (rows padded to whole row blocks)."""
    codes, scales, mins, d, dmin = rows
    out, padded_in = codes.shape
    groups, supers = padded_in // GROUP, padded_in // SUPER
    if (padded_in != supers * SUPER or scales.shape != (out, groups) or mins.shape != (out, groups)
            or d.shape != (out, supers) or dmin.shape != (out, supers)):
        raise ValueError(f"codes {tuple(codes.shape)}, scales {tuple(scales.shape)}, mins {tuple(mins.shape)} and "
                         f"super-scales {tuple(d.shape)}, {tuple(dmin.shape)} do not describe one matrix of "
                         f"{SUPER}-input super-blocks")
    if codes.numel() and (codes.max() > MAX_CODE or scales.max() > MAX_SCALE or mins.max() > MAX_SCALE):
        raise ValueError("codes must lie in [0, 15] and scales and mins in [0, 63]")
    blocks = -(-out // ROWS)
    extra = blocks * ROWS - out
    unsigned = torch.nn.functional.pad(codes.to(torch.uint8), (0, 0, 0, extra))
    # [block, lane, group, m, half, i] -> [block, group, m, lane, i, half]: k = group*32 + m*8 + half*4 + i
    nibbles = unsigned.view(blocks, ROWS, groups, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    packed = (nibbles[..., 0] | (nibbles[..., 1] << 4)).reshape(blocks, groups, BLOCK_BYTES).contiguous()
    block_scales = torch.nn.functional.pad(scales, (0, 0, 0, extra)).view(blocks, ROWS, groups).transpose(1, 2).contiguous()
    # [block, lane, pair, j] -> [block, pair, lane, j]
    block_mins = torch.nn.functional.pad(mins, (0, 0, 0, extra)).view(blocks, ROWS, groups // 2, 2).transpose(1, 2)
    both = torch.stack([d.to(torch.float32), dmin.to(torch.float32)], dim=-1)  # [out, s, 2]
    superscales = torch.nn.functional.pad(both, (0, 0, 0, 0, 0, extra)).view(blocks, ROWS, supers, 2).permute(0, 2, 3, 1)
    return Int4Weight(packed, block_scales, block_mins.reshape(blocks, groups // 2, 2 * ROWS).contiguous(),
                      superscales.contiguous(), out)


def unpack(weight: Int4Weight, first_block: int = 0, blocks: int | None = None) -> Int4Rows:
    """Row blocks [first_block, first_block + blocks) of a packed weight -> their numbers, padding
    rows included (super-scales of padding rows are zero)."""
    last = None if blocks is None else first_block + blocks
    codes = weight.codes[first_block:last]
    count, groups = codes.shape[0], codes.shape[1]
    halves = torch.stack([codes & 0x0F, codes >> 4], dim=-1).view(count, groups, 4, ROWS, 4, 2)
    unsigned = halves.permute(0, 3, 1, 2, 5, 4).reshape(count * ROWS, groups * GROUP)
    scales = weight.scales[first_block:last].transpose(1, 2).reshape(count * ROWS, groups)
    mins = weight.mins[first_block:last].view(count, groups // 2, ROWS, 2).transpose(1, 2).reshape(count * ROWS, groups)
    both = weight.superscales[first_block:last].permute(0, 3, 1, 2).reshape(count * ROWS, -1, 2)
    return Int4Rows(unsigned, scales, mins, both[..., 0], both[..., 1])


def quantize_tokens(rows: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [M, in] -> (activations int8 [M, groups * GROUP], zero-padded; ascale float32 [M, 1])."""
    amax = rows.abs().amax(dim=-1, keepdim=True).clamp_(min=TOKEN_FLOOR)  # [M, 1]
    ascale = amax / 127
    values = torch.round(rows / ascale).clamp_(-127, 127).to(torch.int8)
    return torch.nn.functional.pad(values, (0, groups * GROUP - rows.shape[1])), ascale


def reference_linear(rows: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """rows float32 [M, in] -> float32 [M, out]: the kernel's computation in torch (module glossary)."""
    _check_input(rows, weight, bias)
    out, groups = weight.out, weight.codes.shape[1]
    supers = groups // GROUPS_PER_SUPER
    activations, ascale = quantize_tokens(rows, groups)
    a = activations.to(torch.float64).view(-1, supers, SUPER)  # [M, s, 256]
    sums = a.view(-1, supers, GROUPS_PER_SUPER, GROUP).sum(-1)  # [M, s, 8]
    chunks, block_step = [], REFERENCE_ROWS // ROWS
    for first in range(0, weight.codes.shape[0], block_step):
        codes, scales, mins, d, dmin = unpack(weight, first, block_step)
        n = codes.shape[0]
        integers = (codes.view(n, supers, GROUPS_PER_SUPER, GROUP).to(torch.float64)
                    * scales.view(n, supers, GROUPS_PER_SUPER, 1).to(torch.float64)).view(n, supers, SUPER)
        m = mins.view(n, supers, GROUPS_PER_SUPER).to(torch.float64)
        y = torch.zeros(a.shape[0], n, dtype=torch.float32)
        for s in range(supers):  # in order: the float32 sum is the kernel's
            p = (a[:, s] @ integers[:, s].T).to(torch.float32)  # exact integers [M, n]
            q = (sums[:, s] @ m[:, s].T).to(torch.float32)
            y = y + (p * d[:, s] - q * dmin[:, s])
        chunks.append(y)
    result = torch.cat(chunks, dim=1)[:, :out] * ascale
    return result if bias is None else result + bias


def _check_input(rows: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None) -> None:
    if rows.dim() != 2 or rows.dtype != torch.float32:
        raise ValueError(f"the int4 matmul takes float32 rows [M, in], got {rows.dtype} {tuple(rows.shape)}")
    if _groups(rows.shape[1]) != weight.codes.shape[1]:
        raise ValueError(f"rows have {rows.shape[1]} inputs where the int4 weight has {weight.codes.shape[1]} groups of {GROUP}")
    if bias is not None and bias.shape != (weight.out,):
        raise ValueError(f"bias {tuple(bias.shape)} does not match the int4 weight's {weight.out} rows")


# -- the kernel ---------------------------------------------------------------------------------

KERNEL_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "int4_matmul.cpp"
KERNEL_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-ffp-contract=off", "-fopenmp"]
KERNEL_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")


def cpu_problem() -> str | None:
    """None when this CPU runs the kernel (Linux x86 with AVX-512 VNNI), else why not."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "cannot read /proc/cpuinfo to check for AVX-512 VNNI"
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    missing = [flag for flag in KERNEL_CPU_FLAGS if flag not in flags]
    return f"this CPU lacks {', '.join(missing)}" if missing else None


@functools.cache
def _built_kernel():
    """(the compiled kernel module, None) or (None, why it cannot run here)."""
    problem = cpu_problem()
    if problem is not None:
        return None, problem
    from ..packs import cache_dir

    source = KERNEL_SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(KERNEL_FLAGS).encode() + torch.__version__.encode()).hexdigest()[:12]
    build = cache_dir() / "kernels" / f"int4-{key}"
    try:
        from torch.utils.cpp_extension import load

        build.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return load(name=f"specdecode_int4_{key}", sources=[str(KERNEL_SOURCE)], extra_cflags=KERNEL_FLAGS,
                        extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False), None
    except Exception as exc:  # a missing compiler or headers fails in cpp_extension with many error types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, f"cannot build the int4 kernel ({first[:300]})"


def kernel_problem() -> str | None:
    """None when the kernel builds and runs here (building it on first use), else why not."""
    return _built_kernel()[1]


@functools.cache
def int4_kernel():
    """The compiled kernel module, or None (with a warning once) when this CPU or toolchain cannot build it."""
    module, problem = _built_kernel()
    if problem is not None:
        log.warning("specdecode: warning: %s; the int4 path runs its slow torch reference", problem)
    return module


def kernel_linear(module) -> Matmul:
    """The kernel module's matmul as a ``Matmul``."""
    empty = torch.empty(0)

    def matmul(rows: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
        _check_input(rows, weight, bias)
        return module.int4_linear(rows.contiguous(), weight.codes, weight.scales, weight.mins, weight.superscales,
                                  weight.out, empty if bias is None else bias)

    return matmul


def best_matmul() -> Matmul:
    """The kernel where it builds and runs here, else the reference."""
    module = int4_kernel()
    return reference_linear if module is None else kernel_linear(module)


# -- the modules ----------------------------------------------------------------------------------


class PerTokenInt4Linear(nn.Module):
    def __init__(self, linear: nn.Linear, weight: Int4Weight, matmul: Matmul):
        super().__init__()
        if weight.shape[0] != linear.out_features or weight.codes.shape[1] != _groups(linear.in_features):
            raise ValueError(f"an int4 weight of shape {weight.shape} cannot replace a Linear "
                             f"[{linear.out_features}, {linear.in_features}]")
        self.weight4, self._matmul = weight, matmul
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("bias", stacked_bias([linear]))

    def rows(self, rows: torch.Tensor) -> torch.Tensor:  # [M, in] float32 -> [M, out] float32
        return self._matmul(rows, self.weight4, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        out = self.rows(_float_rows(x, self.in_features))
        return _like_input(out.view(*x.shape[:-1], self.out_features), x)


class FusedInt4Group(FusedGroup):
    """A FusedGroup (``runners.int8``) on the int4 matmul. Every output column is the same
    integer sum and rescale as in its own matmul, so fusing changes no bit."""

    def __init__(self, linears: list[nn.Linear], weight: Int4Weight, matmul: Matmul):
        out = sum(lin.out_features for lin in linears)
        if weight.shape[0] != out or weight.codes.shape[1] != _groups(linears[0].in_features):
            raise ValueError(f"an int4 weight of shape {weight.shape} cannot replace linears [{out}, {linears[0].in_features}]")
        super().__init__(linears)
        self.weight4, self._matmul = weight, matmul

    def rows(self, rows: torch.Tensor) -> torch.Tensor:  # [M, in] float32 -> [M, sum out] float32
        return self._matmul(rows, self.weight4, self.bias)


class FusedInt4Member(FusedMember):
    """A member of a FusedInt4Group."""


# -- the transform --------------------------------------------------------------------------------


class Int4WeightSource(Protocol):
    def quantized(self, matrices: list[Int8Matrix]) -> Iterator[tuple[Int8Matrix, Int4Weight]]:
        """(matrix, its int4 weight) for each matrix, in order."""


class ModelWeights4:
    """Quantised here from the model's own float weights."""

    def quantized(self, matrices: list[Int8Matrix]) -> Iterator[tuple[Int8Matrix, Int4Weight]]:
        for matrix in matrices:
            weights = [lin.weight.detach().to(torch.float32) for lin in matrix.linears()]
            yield matrix, quantize_weight(weights[0] if len(weights) == 1 else torch.cat(weights))


def prepare_int4(model: nn.Module, weights: Int4WeightSource | None = None, matmul: Matmul | None = None) -> nn.Module:
    """The full int4 path: every nn.Linear of a float32 CPU model replaced by a per-token int4
    linear (siblings fused), row-wise attention; returns the model. weights: where the int4
    weights come from (default: quantised from the model); matmul: the implementation
    (default: ``best_matmul()``)."""
    matmul = best_matmul() if matmul is None else matmul
    for matrix, weight in (weights or ModelWeights4()).quantized(int8_matrices(model)):
        linears = matrix.linears()
        if len(linears) == 1:
            modules = [PerTokenInt4Linear(linears[0], weight, matmul)]
        else:
            group = FusedInt4Group(linears, weight, matmul)
            modules = [FusedInt4Member(group, i) for i in range(len(linears))]
        for name, module in zip(matrix.children, modules):
            setattr(matrix.parent, name, module)
    use_rowwise_attention(model)
    return model
