# Measurement script for docs/benchmarks.md section 15 (not part of the package), as run in session 10.
# llama.cpp prefill and per-call cost with and without flash attention.
import statistics, time, torch
from llama_cpp import Llama
p = "/root/.cache/specdecode/gguf/exp-q4_0h4.gguf"
ids = torch.randint(0, 30000, (160,), generator=torch.Generator().manual_seed(0)).tolist()
cfgs = {"base": dict(), "fa": dict(flash_attn=True), "fa_f16": dict(flash_attn=True, type_k=1, type_v=1)}
llms = {}
for k, c in cfgs.items():
    try:
        llms[k] = Llama(p, n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=2, n_threads_batch=2, verbose=False, **c)
    except Exception as e: print(k, e)
res = {}
for _ in range(7):
    for k, l in llms.items():
        l._ctx.kv_cache_seq_rm(0, 0, -1)
        l._batch.set_batch(ids, n_past=0, logits_all=False)
        s = time.perf_counter(); l._ctx.decode(l._batch); res.setdefault((k, "pre"), []).append(time.perf_counter() - s)
        for n in (1, 5):
            l._batch.set_batch(ids[:n], n_past=160, logits_all=True)
            s = time.perf_counter(); l._ctx.decode(l._batch); res.setdefault((k, n), []).append(time.perf_counter() - s)
            l._ctx.kv_cache_seq_rm(0, 160, -1)
for k, v in res.items(): print(k, f"{1000*statistics.median(v):.1f}")
