# Measures llama.cpp draft weight formats (docs/benchmarks.md, "Draft weight format"; not part of the package).
# python scripts/quant.py time source,q4_0,q8_0       : llama.cpp draft cost per call (prefill 160, k = 1, 2, 5) per weight format
# python scripts/quant.py ab source,q4_0 OFF LIMIT [T] : one int8 target, one llama.cpp draft per format, rotating order per prompt
# A format may also be a copy quant_head.py wrote (q4_0h4, q4_0h8: Q4_0 layers, Q4_0 or Q8_0 head).
import sys, statistics, time, torch
torch.set_num_threads(2)
from specdecode import packs
from specdecode.runners.llamacpp import LlamaCppRunner, requantized_gguf
kinds = sys.argv[2].split(",")
src = str(packs.ensure_assembled(packs.get_pack(packs.DEFAULT_DRAFT), progress=False))
def path(kind):
    if kind == "source":
        return src
    written = packs.cache_dir() / "gguf" / f"exp-{kind}.gguf"  # by quant_head.py
    return str(written) if written.is_file() else requantized_gguf(src, kind, packs.cache_dir())
paths = {k: path(k) for k in kinds}
if sys.argv[1] == "time":
    runs = {k: LlamaCppRunner(p) for k, p in paths.items()}
    ids = torch.randint(0, 30000, (1, 300), generator=torch.Generator().manual_seed(0))
    res = {}
    for _ in range(9):
        for tag, r in runs.items():
            r.reset(1)
            s = time.perf_counter(); r.prefill(ids[:, :160]); res.setdefault((tag, "prefill160"), []).append(time.perf_counter() - s)
            for k in (1, 2, 5):
                s = time.perf_counter(); r.forward(ids[:, 160:160 + k]); res.setdefault((tag, k), []).append(time.perf_counter() - s)
                r.truncate(r.lengths - k)
    for (t, k), v in res.items(): print(t, k, f"{1000 * statistics.median(v):.1f} ms")
    sys.exit()
from specdecode.api import SpeculativeGenerator
from specdecode.config import SamplingParams
from specdecode.bench.suites import load_suite
off, lim, temp = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
base = SpeculativeGenerator.from_pretrained(progress=False, draft_quant="source")
gens = {k: SpeculativeGenerator(base.target, base.draft, gamma=5, runners=(base.target_runner, LlamaCppRunner(p))) for k, p in paths.items()}
prompts = load_suite("humaneval", limit=lim, offset=off)
p = SamplingParams(max_new_tokens=128, temperature=temp, seed=0)
for g in gens.values(): g.generate(prompts[0].text, p)
res = {k: [] for k in kinds}
for i, pr in enumerate(prompts):
    order = kinds[i % len(kinds):] + kinds[: i % len(kinds)]
    toks = {}
    for k in order:
        r = gens[k].generate(pr.text, p)
        toks[k] = r.token_ids
        res[k].append((r.stats.wall_seconds, r.stats.new_tokens, r.stats.acceptance_rate, r.stats.tokens_per_target_forward, r.stats.draft_seconds / max(1, r.stats.drafted_tokens)))
    if temp == 0: assert all(t == toks[kinds[0]] for t in toks.values())
    print(i, {k: f"{v[-1][0]:.2f}s acc {v[-1][2]:.2f} tpf {v[-1][3]:.2f}" for k, v in res.items()}, flush=True)
first = res[kinds[0]]
for k, v in res.items():
    print(k, f"tok/s {sum(x[1] for x in v) / sum(x[0] for x in v):.2f} geo vs {kinds[0]} {statistics.geometric_mean([b[0] / x[0] for b, x in zip(first, v)]):.3f} acc {statistics.mean(x[2] for x in v):.3f} tpf {statistics.mean(x[3] for x in v):.2f} draft s/token {1000 * statistics.mean(x[4] for x in v):.1f} ms")
