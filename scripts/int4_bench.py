# The int4 path against the int8 path (not part of the package): per matrix of the default target's shapes
# (random weights), the int4 kernel and fbgemm's int8 per-token matmul for M = 1, 6, 16, 64 tokens, with the
# bytes each reads and the GB/s that makes beside a 2-thread tensor sum; then, unless --matrices-only, the
# real default target's 1- and 6-token pass times on both paths (both loaded, passes alternated).
# python scripts/int4_bench.py [--matrices-only] [--repeats N]
import argparse
import gc
import statistics
import time

import torch

from specdecode.runners import int4, int8

SHAPES = {"q+k+v": (2048, 1536), "o_proj": (1536, 1536), "gate+up": (17920, 1536), "down_proj": (1536, 8960),
          "lm_head": (151936, 1536)}
TOKENS = (1, 6, 16, 64)


def timed(fn, repeats):
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bandwidth(repeats):
    big = torch.ones(256 * 1024 * 1024 // 4)  # 256 MiB, far beyond the caches
    seconds = timed(lambda: big.sum(), repeats)
    return big.numel() * 4 / seconds / 1e9


def matrices(repeats):
    kernel = int4.int4_kernel()
    if kernel is None:
        raise SystemExit("the int4 kernel does not build or run here")
    matmul = int4.kernel_linear(kernel)
    torch.backends.quantized.engine = "fbgemm"
    print(f"2-thread sum of 256 MiB: {bandwidth(repeats):.1f} GB/s")
    print(f"{'matrix':>10} {'M':>3} {'int4 ms':>8} {'int8 ms':>8} {'int4 GB/s':>9} {'int8 GB/s':>9} {'int4 M/M1':>9} {'int8 M/M1':>9}")
    for name, (out, width) in SHAPES.items():
        weight = torch.randn(out, width) * 0.02
        packed4 = int4.quantize_weight(weight)
        packed8 = int8._pack(int8.quantize_weight(weight))
        del weight
        bytes4 = sum(t.numel() * t.element_size() for t in packed4[:4])
        bytes8 = out * width + 8 * out
        base = {}
        for tokens in TOKENS:
            x = torch.randn(tokens, width)
            t4 = timed(lambda: matmul(x, packed4, None), repeats)
            t8 = timed(lambda: int8._per_token_matmul(packed8, x), repeats)
            base.setdefault("int4", t4)
            base.setdefault("int8", t8)
            print(f"{name:>10} {tokens:>3} {1e3 * t4:8.3f} {1e3 * t8:8.3f} {bytes4 / t4 / 1e9:9.1f} {bytes8 / t8 / 1e9:9.1f} "
                  f"{t4 / base['int4']:9.2f} {t8 / base['int8']:9.2f}")
        del packed4, packed8
        gc.collect()


def passes(repeats):
    from specdecode import models, packs
    from specdecode.runners.factory import hf_runner

    ids = torch.randint(0, 30000, (1, 300), generator=torch.Generator().manual_seed(0))
    runners = {}
    for kind in ("int8", "int4"):
        start = time.perf_counter()
        loaded = models.load(packs.DEFAULT_TARGET, torch.device("cpu"), torch.float32, progress=False, runner=kind,
                             role="target")
        print(f"{kind}: loaded in {time.perf_counter() - start:.1f} s")
        runners[kind] = hf_runner(loaded.model)
        gc.collect()
    times = {}
    with torch.inference_mode():
        for runner in runners.values():
            runner.prefill(ids[:, :200])
        for round_ in range(repeats + 2):  # two warm-up rounds, then the kinds alternate within every round
            for kind, runner in runners.items():
                for k in (1, 6):
                    start = time.perf_counter()
                    runner.forward(ids[:, 200:200 + k])
                    if round_ >= 2:
                        times.setdefault((kind, k), []).append(time.perf_counter() - start)
                    runner.truncate(runner.lengths - k)
    for kind in runners:
        one, six = (statistics.median(times[(kind, k)]) for k in (1, 6))
        print(f"{kind} target pass: 1 token {1e3 * one:.1f} ms, 6 tokens {1e3 * six:.1f} ms (x{six / one:.2f})")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--matrices-only", action="store_true")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(2)
    matrices(args.repeats)
    if not args.matrices_only:
        passes(args.repeats)


if __name__ == "__main__":
    main()
