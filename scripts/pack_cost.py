"""What a cached int8 load still pays: fbgemm's packing of each model's quantized weights.

Reads the packed-weight cache entries of the default pair (load the pair once first, e.g.
`specdecode generate "def f():" --max-new-tokens 1`), packs every matrix on one thread and
prints the seconds per kind of matrix, then the wall time on torch.get_num_threads() threads;
last, the target's fused gate/up matrix packed whole against in 2048-row slices, and one
token's matmul through each. docs/runners.md (the packed-weight cache) cites it.

    python scripts/pack_cost.py
"""

import time
from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors import safe_open

from specdecode import packs
from specdecode.runners.int8 import TOKEN_SCALE, TOKEN_ZERO_POINT, _FIXED_SCALE_LINEAR, _pack, quantized_from
from specdecode.runners.weight_cache import checkpoint_files, entry_path

torch.backends.quantized.engine = "fbgemm"


def entry(name: str):
    folder = packs.converted_path(packs.get_pack(name))
    path = entry_path(packs.cache_dir(), folder, checkpoint_files(folder))
    if not path.is_file():
        raise SystemExit(f"no cache entry for {name} at {path}: load the pair once first")
    return path


def read(path, name):
    with safe_open(path, framework="pt") as handle:
        return quantized_from(handle.get_tensor(f"{name}.int8"), handle.get_tensor(f"{name}.scale"))


def median_ms(fn, n=30):
    fn()
    times = sorted((lambda s: (fn(), time.perf_counter() - s)[1])(time.perf_counter()) for _ in range(n))
    return times[n // 2] * 1e3


for model in (packs.DEFAULT_TARGET, packs.DEFAULT_DRAFT):
    path = entry(model)
    with safe_open(path, framework="pt") as handle:
        names = [key[: -len(".int8")] for key in handle.keys() if key.endswith(".int8")]
        sizes = {n: handle.get_slice(f"{n}.int8").get_shape() for n in names}
    kinds: dict[str, float] = {}
    for name in names:
        qweight = read(path, name)
        start = time.perf_counter()
        _pack(qweight)
        kind = name.rsplit(".", 1)[-1]
        kinds[kind] = kinds.get(kind, 0.0) + time.perf_counter() - start
    start = time.perf_counter()
    with ThreadPoolExecutor(torch.get_num_threads()) as pool:
        list(pool.map(lambda n: _pack(read(path, n)), sorted(names, key=lambda n: -sizes[n][0] * sizes[n][1])))
    threads = time.perf_counter() - start
    print(f"{model}: packing on one thread {sum(kinds.values()):.2f} s "
          f"({', '.join(f'{k} {v:.2f}' for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))}); "
          f"on {torch.get_num_threads()} threads {threads:.2f} s (reading included)")

path = entry(packs.DEFAULT_TARGET)
qweight = read(path, "model.layers.0.mlp.gate_proj+up_proj")
start = time.perf_counter()
whole = _pack(qweight)
whole_s = time.perf_counter() - start
start = time.perf_counter()
slices = [_pack(qweight[i : i + 2048]) for i in range(0, qweight.shape[0], 2048)]
sliced_s = time.perf_counter() - start
x = torch.randn(1, qweight.shape[1])
x = x / x.abs().amax(-1, keepdim=True)
one = median_ms(lambda: _FIXED_SCALE_LINEAR(x, TOKEN_SCALE, TOKEN_ZERO_POINT, whole))
many = median_ms(lambda: torch.cat([_FIXED_SCALE_LINEAR(x, TOKEN_SCALE, TOKEN_ZERO_POINT, p) for p in slices], dim=1))
print(f"gate/up {tuple(qweight.shape)}: packed whole {whole_s:.3f} s, in 2048-row slices {sliced_s:.3f} s; "
      f"one token's matmul {one:.3f} ms whole, {many:.3f} ms sliced")
