# Measures the verify-cost curve T(k) per batch size (docs/benchmarks.md, "Verify cost T(k)"; not part of the package).
# The batched verify-cost curve: the int8 target's pass over B rows of k tokens each (after a
# 200-token context per row), a B-row draft step on the int8 path, and a k-token llama.cpp call
# (the cost of one multi-row llama.cpp draft step of k rows, which specdecode does not have);
# then the paper's model per batch size: speedup over batched plain decoding for gamma 1..5.
# python scripts/batch_cost.py [alpha]
import statistics, sys, time, torch
torch.set_num_threads(2)
from specdecode import models, packs
from specdecode.runners.factory import hf_runner
from specdecode.runners.llamacpp import LlamaCppRunner, requantized_gguf

alpha = float(sys.argv[1]) if len(sys.argv) > 1 else 0.9
target = hf_runner(models.load(packs.DEFAULT_TARGET, torch.device("cpu"), torch.float32, runner="int8", role="target").model)
draft = hf_runner(models.load(packs.DEFAULT_DRAFT, torch.device("cpu"), torch.float32, runner="int8", role="draft").model)
source = str(packs.ensure_assembled(packs.get_pack(packs.DEFAULT_DRAFT), progress=False))
llama = LlamaCppRunner(requantized_gguf(source, "q4_0", packs.cache_dir()))
ids = torch.randint(0, 30000, (8, 260), generator=torch.Generator().manual_seed(0))
times = {}


def timed(key, fn):
    s = time.perf_counter(); fn(); times.setdefault(key, []).append(time.perf_counter() - s)


with torch.inference_mode():
    for runner in (target, draft):
        runner.reset(8)
        for row in range(8):
            runner.prefill(ids[row:row + 1, :200], rows=[row])
    llama.prefill(ids[:1, :200])
    for _ in range(7):
        for b in (1, 4, 8):
            rows = list(range(b))
            for k in range(1, 7):
                timed(("target", b, k), lambda: target.forward(ids[:b, 200:200 + k], rows=rows))
                target.truncate(torch.tensor([200] * 8))
            timed(("draft-int8", b, 1), lambda: draft.forward(ids[:b, 200:201], rows=rows))
            draft.truncate(torch.tensor([200] * 8))
            timed(("llamacpp", b, 1), lambda: llama.forward(ids[:1, 200:200 + b]))
            llama.truncate(torch.tensor([200]))
ms = {key: 1000 * statistics.median(v) for key, v in times.items()}
for b in (1, 4, 8):
    print(f"B={b}: target " + ", ".join(f"k={k} {ms[('target', b, k)]:.1f}" for k in range(1, 7)) +
          f" ms; draft step int8 {ms[('draft-int8', b, 1)]:.1f} ms, llama.cpp {b}-token call {ms[('llamacpp', b, 1)]:.1f} ms")
print(f"paper's model, alpha {alpha}: speedup over batched plain decoding at the same batch size")
for b in (1, 4, 8):
    plain = ms[("target", b, 1)]
    for name, step in (("int8 draft", ms[("draft-int8", b, 1)]), ("llama.cpp multi-row draft", ms[("llamacpp", b, 1)]), ("free draft", 0.0)):
        cells = []
        for g in range(1, 6):
            tokens = (1 - alpha ** (g + 1)) / (1 - alpha)
            cells.append(f"g{g} {tokens * plain / (g * step + ms[('target', b, g + 1)]):.2f}x")
        print(f"  B={b} {name}: " + ", ".join(cells))
