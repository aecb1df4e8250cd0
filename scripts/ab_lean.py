# Measures the int8 path's direct decode loop against its module path (docs/benchmarks.md, "int8 path costs"; not part of the package).
# python scripts/ab_lean.py [MODEL ...]
# Interleaved A/B of the module path (transformers' forward over runners.int8) and the lean
# loop (runners.lean) on one loaded model: two runners with their own caches, timed in
# alternation so machine drift cancels; logits compared with torch.equal first.
import statistics, sys, time, torch
torch.set_num_threads(2)
from specdecode import models
from specdecode.runners.int8 import prepare_int8
from specdecode.runners.factory import hf_runner
from specdecode.runners.hf import HFRunner
names = sys.argv[1:] or ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]
for which in names:
    lm = models.load(which, torch.device("cpu"), torch.float32, runner="hf", role="draft")
    prepare_int8(lm.model)
    ids = torch.randint(0, 30000, (4, 300), generator=torch.Generator().manual_seed(0))
    runners = {"module": HFRunner(lm.model), "lean": hf_runner(lm.model)}  # the module path; the lean loop
    for r in runners.values():
        r.reset(4)
        for row in range(4):
            r.prefill(ids[row : row + 1, : 300 - 20 * row], rows=[row])
    shapes = {"k=1": (ids[:1, :1], [0], None), "k=6": (ids[:1, :6], [0], None),
              "4 rows x 1": (ids[:, :1], None, None), "4 rows ragged 1-6": (ids[:, :6], None, [1, 6, 3, 2])}
    for name, (block, rows, counts) in shapes.items():
        out = [r.forward(block, rows=rows, counts=counts) for r in runners.values()]
        assert torch.equal(out[0], out[1]), name
        for r in runners.values():
            r.truncate(r.lengths - torch.tensor(counts or [block.shape[1] if rows is None or i in rows else 0 for i in range(4)]))
    res = {}
    for _ in range(12):
        for name, (block, rows, counts) in shapes.items():
            for tag, r in runners.items():
                s = time.perf_counter(); r.forward(block, rows=rows, counts=counts); res.setdefault((name, tag), []).append(time.perf_counter() - s)
                r.truncate(r.lengths - torch.tensor(counts or [block.shape[1] if rows is None or i in rows else 0 for i in range(4)]))
    print(which, "bit-identical; median ms:", {f"{n} {t}": round(1000 * statistics.median(v), 1) for (n, t), v in res.items()}, flush=True)
