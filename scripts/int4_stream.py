# int4 kernel variants over a pass streamed from memory (not part of the package): every Linear of the 1.5B
# target's 28 layers plus lm_head, each with its own random packed weights (915 MB, far beyond the caches),
# for 1, 6 and 16 tokens; the variants must give identical outputs, then they are timed in alternation.
# python scripts/int4_stream.py KERNEL.cpp [KERNEL.cpp ...]   (e.g. src/specdecode/csrc/int4_matmul.cpp)
import hashlib
import statistics
import sys
import tempfile
import time
import warnings

import torch
from torch.utils.cpp_extension import load

from specdecode.runners.int4 import KERNEL_FLAGS

LAYER_SHAPES = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]  # (out, in): q+k+v, o, gate+up, down
LAYERS, HEAD = 28, (151936, 1536)


def build(path):
    key = hashlib.sha256(open(path, "rb").read()).hexdigest()[:10]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load(name=f"int4_stream_{key}", sources=[path], extra_cflags=KERNEL_FLAGS, extra_ldflags=["-fopenmp"],
                    build_directory=tempfile.mkdtemp(), verbose=False)


def random_weight(out, width, generator):  # (codes, scales, mins, superscales, out): the packed layout of runners.int4
    blocks, groups = -(-out // 16), width // 32
    return (torch.randint(0, 256, (blocks, groups, 256), dtype=torch.uint8, generator=generator),
            torch.randint(0, 64, (blocks, groups, 16), dtype=torch.uint8, generator=generator),
            torch.randint(0, 64, (blocks, groups // 2, 32), dtype=torch.uint8, generator=generator),
            torch.rand(blocks, groups // 8, 2, 16, generator=generator) * 1e-3, out)


def main(paths):
    kernels = [build(p) for p in paths]
    generator = torch.Generator().manual_seed(0)
    weights = [random_weight(o, i, generator) for _ in range(LAYERS) for o, i in LAYER_SHAPES] + [random_weight(*HEAD, generator)]
    empty = torch.empty(0)
    for tokens in (1, 6):
        for weight in weights[: len(LAYER_SHAPES)]:
            x = torch.randn(tokens, weight[0].shape[1] * 32, generator=generator)
            outs = [k.int4_linear(x, *weight, empty) for k in kernels]
            assert all(torch.equal(outs[0], o) for o in outs), "the variants' outputs differ"

    def one_pass(kernel, tokens):
        inputs = {width: torch.randn(tokens, width) for width in {i for _, i in LAYER_SHAPES}}
        for weight in weights:
            kernel.int4_linear(inputs[weight[0].shape[1] * 32], *weight, empty)

    for tokens in (1, 6, 16):
        samples = [[] for _ in kernels]
        for _ in range(7):
            for j, kernel in enumerate(kernels):
                start = time.perf_counter()
                one_pass(kernel, tokens)
                samples[j].append(time.perf_counter() - start)
        print(f"M={tokens:<3}" + "  ".join(f"{p}: {1e3 * statistics.median(s):.1f} ms" for p, s in zip(paths, samples)))


if __name__ == "__main__":
    main(sys.argv[1:] or ["src/specdecode/csrc/int4_matmul.cpp"])
