# Measures the int8 path's fixed-parameter quantisation against the anchor row (docs/benchmarks.md, "int8 path costs"; not part of the package).
# The int8 path's per-token quantisation with fixed parameters against the anchor-row trick it
# replaced: logits asserted bit-identical on the real target, then passes timed in alternation.
# python scripts/fixed_scale.py
import statistics, time, torch
torch.set_num_threads(2)
from specdecode import models
from specdecode.runners import int8
from specdecode.runners.factory import hf_runner


def anchor_matmul(packed, rows):  # the previous implementation (commit f930351), scratch block aside
    amax = rows.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-30)
    block = torch.empty(rows.shape[0] + 1, rows.shape[1])
    block[0].zero_()
    block[0, 0], block[0, 1] = -1.0, 1.0
    torch.div(rows, amax, out=block[1:])
    return torch.ops.quantized.linear_dynamic(block, packed, False)[1:].mul_(amax)


fixed = int8._per_token_matmul
loaded = models.load("qwen2.5-coder-1.5b-instruct", torch.device("cpu"), torch.float32, runner="int8", role="target")
runner = hf_runner(loaded.model)
ids = torch.randint(0, 30000, (1, 300), generator=torch.Generator().manual_seed(0))


def passes():
    out = [runner.prefill(ids[:, :200])]
    for k in (1, 6, 3):
        out.append(runner.forward(ids[:, 200:200 + k]))
    return out


results = {}
for name, fn in (("anchor", anchor_matmul), ("fixed", fixed)):
    int8._per_token_matmul = fn
    with torch.inference_mode():
        results[name] = passes()
assert all(torch.equal(a, b) for a, b in zip(results["anchor"], results["fixed"])), "logits differ"
print("logits bit-identical over a 200-token prefill and passes of 1, 6 and 3 tokens")
times = {}
with torch.inference_mode():
    runner.prefill(ids[:, :200])
    for _ in range(15):
        for name, fn in (("anchor", anchor_matmul), ("fixed", fixed)):
            int8._per_token_matmul = fn
            for k in (1, 6):
                s = time.perf_counter(); runner.forward(ids[:, 200:200 + k]); times.setdefault((name, k), []).append(time.perf_counter() - s)
                runner.truncate(runner.lengths - k)
for (name, k), v in sorted(times.items(), key=lambda x: (x[0][1], x[0][0])):
    print(f"{name} k={k}: median {1000 * statistics.median(v):.1f} ms")
