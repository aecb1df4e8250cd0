# Writes the draft copies for the output-head comparison of docs/benchmarks.md, "Draft weight format" (not part of the package).
# Writes two Q4_0 copies of the draft whose output head is Q4_0 (q4_0h4) or Q8_0 (q4_0h8, llama.cpp's default).
# python scripts/quant_head.py; then scripts/quant.py time q4_0h8,q4_0h4 and quant.py ab q4_0h8,q4_0h4 0 10
import ctypes, os, sys, llama_cpp
from specdecode import packs
src = str(packs.ensure_assembled(packs.get_pack(packs.DEFAULT_DRAFT), progress=False))
folder = packs.cache_dir() / "gguf"
for name, head in (("q4_0h4", llama_cpp.GGML_TYPE_Q4_0), ("q4_0h8", llama_cpp.GGML_TYPE_Q8_0)):
    out = folder / f"exp-{name}.gguf"
    if out.is_file(): print(out); continue
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0; p.allow_requantize = True; p.nthread = 2
    p.output_tensor_type = head
    rc = llama_cpp.llama_model_quantize(src.encode(), str(out).encode(), ctypes.byref(p))
    print(name, rc, out, os.path.getsize(out))
