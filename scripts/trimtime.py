# Times a llama.cpp draft call with a trimmed vocabulary against the full one (docs/benchmarks.md, "Draft vocabulary";
# not part of the package). python scripts/trimtime.py N   (N as for --draft-vocab)
import statistics, time, torch, sys
torch.set_num_threads(2)
from specdecode import packs
from specdecode.runners.llamacpp import LlamaCppRunner, trimmed_gguf
src = str(packs.assembled_path(packs.get_pack("qwen2.5-coder-0.5b-instruct")))
s = time.perf_counter(); t = trimmed_gguf(src, int(sys.argv[1]), packs.cache_dir()); print("trim", time.perf_counter() - s, t)
runs = {"full": LlamaCppRunner(src), "trim": LlamaCppRunner(t)}
ids = torch.randint(0, 30000, (1, 300), generator=torch.Generator().manual_seed(0))
for r in runs.values(): r.reset(1); r.prefill(ids)
a, b = runs["full"].forward(ids[:, 100:101]), runs["trim"].forward(ids[:, 100:101])
print("vocab", runs["trim"].vocab_size, "argmax", a.argmax(-1), b.argmax(-1), "max diff on kept", (a[0, 0, :1000] - b[0, 0, :1000]).abs().max())
for r in runs.values(): r.truncate(r.lengths - 1)
res = {}
for _ in range(20):
    for k in (1, 5):
        for tag, r in runs.items():
            s = time.perf_counter(); r.forward(ids[:, 100:100 + k]); res.setdefault((tag, k), []).append(time.perf_counter() - s); r.truncate(r.lengths - k)
for (t, k), v in res.items(): print(t, k, f"{1000*statistics.median(v):.1f} ms")
