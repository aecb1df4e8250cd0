# Measurement script for docs/benchmarks.md section 10 (not part of the package).
# Interleaved A/B of the int8 linears before (commit bb46d8b) and after the fused/fewer-ops change:
# both versions loaded in one process, timed in alternation so machine drift cancels.
import importlib.util, statistics, subprocess, sys, tempfile, time, torch
torch.set_num_threads(2)
from specdecode import models
from specdecode.runners import int8 as new
from specdecode.runners.hf import HFRunner
old_src = subprocess.run(["git", "show", "bb46d8b:src/specdecode/runners/int8.py"], capture_output=True, text=True, check=True).stdout
path = tempfile.mkdtemp() + "/int8_old.py"
open(path, "w").write(old_src)
spec = importlib.util.spec_from_file_location("int8_old", path); old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
for which in ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]:
    runners = {}
    ids = torch.randint(0, 30000, (1, 300), generator=torch.Generator().manual_seed(0))
    for tag, mod in (("old", old), ("new", new)):
        lm = models.load(which, torch.device("cpu"), torch.float32, runner="hf", role="draft")
        mod.prepare_int8(lm.model)
        r = HFRunner(lm.model); r.reset(1); r.prefill(ids); runners[tag] = r
    res = {(t, k): [] for t in runners for k in (1, 6)}
    for _ in range(12):
        for k in (1, 6):
            for t, r in runners.items():
                s = time.perf_counter(); r.forward(ids[:, :k]); res[(t, k)].append(time.perf_counter() - s); r.truncate(r.lengths - k)
    print(which, {f"{t} k={k}": round(1000 * statistics.median(v), 1) for (t, k), v in res.items()}, flush=True)
