# Times a k-token pass (k = 1, 4, 6) of a model on the int8 path after a 300-token context, then prints a
# torch.profiler table of five 1-token passes (not part of the package). python scripts/prof.py [MODEL]
import time, torch, sys
torch.set_num_threads(2)
from specdecode import models
which = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-0.5b-instruct"
lm = models.load(which, torch.device("cpu"), torch.float32, runner="int8", role="draft")
r = lm.make_runner()
r.reset(1)
ids = torch.randint(0, 30000, (1, 300))
r.prefill(ids)
def step(k=1):
    return r.forward(torch.randint(0, 30000, (1, k)))
for _ in range(3): step(); r.truncate(r.lengths - 1)
for k in (1, 4, 6):
    ts = []
    for _ in range(8):
        t = time.perf_counter(); step(k); ts.append(time.perf_counter() - t); r.truncate(r.lengths - k)
    ts.sort(); print(f"k={k} median {1000*ts[4]:.1f} ms min {1000*ts[0]:.1f}")
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU]) as p:
    for _ in range(5): step(); r.truncate(r.lengths - 1)
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
