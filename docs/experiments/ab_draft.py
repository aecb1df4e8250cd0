# Measurement script for docs/benchmarks.md section 12 (not part of the package).
# Interleaved timing: 0.5B draft token on llama.cpp (this build) vs the int8 lean path; 1 token and
# 5 tokens after a 300-token context; also 1.5B target int8 for the ratio.
import statistics, sys, time, torch
torch.set_num_threads(2)
from specdecode import models, packs
from specdecode.runners.int8 import prepare_int8
from specdecode.runners.hf import HFRunner
from specdecode.runners.llamacpp import LlamaCppRunner
import llama_cpp
print(llama_cpp.llama_print_system_info().decode())
ids = torch.randint(0, 30000, (1, 300), generator=torch.Generator().manual_seed(0))
d = packs.get_pack("qwen2.5-coder-0.5b-instruct")
lc = LlamaCppRunner(str(packs.ensure_assembled(d)))
runs = {"llamacpp 0.5B": lc}
for name in ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]:
    lm = models.load(name, torch.device("cpu"), torch.float32, runner="hf", role="draft")
    prepare_int8(lm.model)
    runs['int8 ' + name.split('-')[2]] = HFRunner(lm.model)
for r in runs.values():
    r.reset(1); r.prefill(ids)
res = {}
for _ in range(15):
    for k in (1, 5):
        for tag, r in runs.items():
            blk = ids[:, 100:100 + k]
            s = time.perf_counter(); r.forward(blk); res.setdefault((tag, k), []).append(time.perf_counter() - s)
            r.truncate(r.lengths - k)
for (t, k), v in res.items():
    print(f"{t} k={k}: median {1000*statistics.median(v):.1f} ms, min {1000*min(v):.1f}")
