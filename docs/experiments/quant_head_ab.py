# Measurement script for docs/benchmarks.md section 15 (not part of the package), as run in session 10.
# Greedy A/B of draft weight files on one int8 target (the tail of quant.py).
import sys, statistics, time, torch
torch.set_num_threads(2)
from specdecode import packs
from specdecode.runners.llamacpp import LlamaCppRunner, requantized_gguf
src = str(packs.ensure_assembled(packs.get_pack(packs.DEFAULT_DRAFT), progress=False))
folder = packs.cache_dir() / "gguf"
allp = {"q4_0": requantized_gguf(src, "q4_0", packs.cache_dir()), "q4_0h4": str(folder / "exp-q4_0h4.gguf"), "q4_0h8": str(folder / "exp-q4_0h8.gguf")}
kinds = sys.argv[2].split(",")
paths = {k: allp[k] for k in kinds}
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
