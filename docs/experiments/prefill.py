# Measurement script for docs/benchmarks.md section 12 (not part of the package).
import statistics, time, torch
torch.set_num_threads(2)
from specdecode import models, packs
from specdecode.runners.int8 import prepare_int8
from specdecode.runners.hf import HFRunner
from specdecode.runners.llamacpp import LlamaCppRunner
ids = torch.randint(0, 30000, (1, 160), generator=torch.Generator().manual_seed(0))
d = packs.get_pack("qwen2.5-coder-0.5b-instruct")
runs = {}
for nb in (512, 64, 32, 16):
    runs[f"llamacpp nb={nb}"] = LlamaCppRunner(str(packs.ensure_assembled(d)), n_batch=nb)
lm = models.load("qwen2.5-coder-0.5b-instruct", torch.device("cpu"), torch.float32, runner="hf", role="draft")
prepare_int8(lm.model); runs["int8 0.5b"] = HFRunner(lm.model)
res = {}
for _ in range(4):
    for t, r in runs.items():
        s = time.perf_counter(); r.prefill(ids); res.setdefault(t, []).append(time.perf_counter() - s)
for t, v in res.items(): print(f"{t}: prefill 160 tokens median {1000*statistics.median(v):.0f} ms")
