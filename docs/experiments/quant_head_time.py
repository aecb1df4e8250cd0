# Measurement script for docs/benchmarks.md section 15 (not part of the package), as run in session 10.
# llama.cpp draft cost per call for the head variants of quant_head.py (q4_0 is the cached copy as it was before the change).
import sys, statistics, time, torch
torch.set_num_threads(2)
from specdecode import packs
from specdecode.runners.llamacpp import LlamaCppRunner, requantized_gguf
src = str(packs.ensure_assembled(packs.get_pack(packs.DEFAULT_DRAFT), progress=False))
folder = packs.cache_dir() / "gguf"
paths = {"q4_0": requantized_gguf(src, "q4_0", packs.cache_dir()), "q4_0h4": str(folder / "exp-q4_0h4.gguf"), "q4_0h8": str(folder / "exp-q4_0h8.gguf")}
runs = {k: LlamaCppRunner(p) for k, p in paths.items()}
ids = torch.randint(0, 30000, (1, 300), generator=torch.Generator().manual_seed(0))
res = {}
for _ in range(9):
    for tag, r in runs.items():
        r.reset(1)
        s = time.perf_counter(); r.prefill(ids[:, :160]); res.setdefault((tag, "prefill160"), []).append(time.perf_counter() - s)
        for k in (1, 1, 1, 2, 5):
            s = time.perf_counter(); r.forward(ids[:, 160:160 + k]); res.setdefault((tag, k), []).append(time.perf_counter() - s)
            r.truncate(r.lengths - k)
for (t, k), v in res.items(): print(t, k, f"{1000 * statistics.median(v):.1f} ms")
