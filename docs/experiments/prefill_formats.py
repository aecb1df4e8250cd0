# Measurement script for docs/benchmarks.md section 15 (not part of the package), as run in session 10.
# llama.cpp draft prefill of 160 tokens with the Q4_0 draft and with BF16 / F16 / Q8_0 copies.
import ctypes, os, statistics, time, torch, llama_cpp
from llama_cpp import Llama
from specdecode import packs
from specdecode.runners.llamacpp import _quiet_llamacpp
_quiet_llamacpp()
src = str(packs.ensure_assembled(packs.get_pack(packs.DEFAULT_DRAFT), progress=False))
folder = packs.cache_dir() / "gguf"
outs = {}
for name, ft in (("bf16", "LLAMA_FTYPE_MOSTLY_BF16"), ("f16", "LLAMA_FTYPE_MOSTLY_F16"), ("q8_0", "LLAMA_FTYPE_MOSTLY_Q8_0")):
    out = folder / f"exp-{name}.gguf"
    if not out.is_file():
        p = llama_cpp.llama_model_quantize_default_params()
        p.ftype = getattr(llama_cpp, ft); p.allow_requantize = True; p.nthread = 2
        rc = llama_cpp.llama_model_quantize(src.encode(), str(out).encode(), ctypes.byref(p))
        print(name, rc)
    outs[name] = str(out)
outs["q4_0h4"] = str(folder / "exp-q4_0h4.gguf")
ids = torch.randint(0, 30000, (160,), generator=torch.Generator().manual_seed(0)).tolist()
llms = {k: Llama(p, n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=2, n_threads_batch=2, flash_attn=True, verbose=False) for k, p in outs.items()}
res = {}
for _ in range(5):
    for k, l in llms.items():
        l._ctx.kv_cache_seq_rm(0, 0, -1)
        l._batch.set_batch(ids, n_past=0, logits_all=False)
        s = time.perf_counter(); l._ctx.decode(l._batch); res.setdefault(k, []).append(time.perf_counter() - s)
for k, v in res.items(): print(k, f"prefill 160: {1000*statistics.median(v):.1f} ms")
