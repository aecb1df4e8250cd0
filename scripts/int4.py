# Times torch's int4 CPU weight kernel against fp32 and the int8 kernel on the 0.5B draft's Linear shapes, random weights
# (docs/benchmarks.md, "int8 path costs"; not part of the package). python scripts/int4.py
import time, torch
torch.set_num_threads(2)
torch.backends.quantized.engine = "fbgemm"
def bench(f, n=200):
    for _ in range(10): f()
    t = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t) / n * 1e6
for (n_in, n_out) in [(896, 4864), (4864, 896), (896, 896), (896, 151936)]:
    w = torch.randn(n_out, n_in) * 0.02
    x = torch.randn(1, n_in)
    t_fp = bench(lambda: torch.nn.functional.linear(x, w))
    scale = (w.abs().amax(1) / 127).double()
    qw = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
    pk = torch.ops.quantized.linear_prepack(qw, None)
    t_i8 = bench(lambda: torch.ops.quantized.linear_dynamic(x, pk, False))
    # int4 weight only, group 32
    try:
        g = 32
        wg = w.reshape(n_out, -1, g)
        mx, mn = wg.amax(-1, keepdim=True), wg.amin(-1, keepdim=True)
        s = ((mx - mn) / 15).clamp(min=1e-8)
        zero = mn + 8 * s  # torch int4 convention: w = (q - 8) * s + zero
        q = ((wg - mn) / s).round().clamp(0, 15).to(torch.int32).reshape(n_out, n_in)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        sz = torch.stack([s.reshape(n_out, -1).t(), zero.reshape(n_out, -1).t()], -1).contiguous()  # [n_in/g, n_out, 2]
        xb = x.to(torch.bfloat16)
        t_i4 = bench(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, g, sz.to(torch.bfloat16)))
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, g, sz)
        err = ((y - torch.nn.functional.linear(x, w)).norm() / torch.nn.functional.linear(x, w).norm()).item()
        t_i4f = bench(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, g, sz))
    except Exception as e:
        t_i4 = t_i4f = float('nan'); err = repr(e)[:200]
    print(f"{n_in}x{n_out}: fp32 {t_fp:.0f}us int8 {t_i8:.0f}us int4(bf16) {t_i4:.0f}us int4(fp32) {t_i4f:.0f}us err {err}")
