# Measures --draft-vocab settings end to end (docs/benchmarks.md, "Draft vocabulary"; not part of the package).
# python scripts/vocab.py full,32768,65536,100000 OFFSET LIMIT [TEMPERATURE]
# draft vocabulary A/B: one target, one llama.cpp draft runner per --draft-vocab setting, rotating order per prompt
import sys, statistics, torch
torch.set_num_threads(2)
from specdecode.api import SpeculativeGenerator
from specdecode.config import SamplingParams
from specdecode.bench.suites import load_suite
from specdecode import packs
from specdecode.runners.llamacpp import LlamaCppRunner, trimmed_gguf
keeps = [None if w == "full" else int(w) for w in sys.argv[1].split(",")]
off, lim, temp = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
base = SpeculativeGenerator.from_pretrained(progress=False, draft_vocab=None)
src = base.draft.gguf_path
gens = {k: SpeculativeGenerator(base.target, base.draft, gamma=5, runners=(base.target_runner, LlamaCppRunner(src if k is None else trimmed_gguf(src, k, packs.cache_dir())))) for k in keeps}
prompts = load_suite("humaneval", limit=lim, offset=off)
p = SamplingParams(max_new_tokens=128, temperature=temp, seed=0)
for g in gens.values(): g.generate(prompts[0].text, p)
res = {k: [] for k in keeps}
for i, pr in enumerate(prompts):
    order = keeps[i % len(keeps):] + keeps[: i % len(keeps)]
    toks = {}
    for k in order:
        r = gens[k].generate(pr.text, p)
        toks[k] = r.token_ids
        res[k].append((r.stats.wall_seconds, r.stats.new_tokens, r.stats.acceptance_rate, r.stats.tokens_per_target_forward, r.stats.draft_seconds / max(1, r.stats.drafted_tokens)))
    if temp == 0: assert all(t == toks[keeps[0]] for t in toks.values())
    print(i, {k: f"{v[-1][0]:.2f}s acc {v[-1][2]:.2f} tpf {v[-1][3]:.2f}" for k, v in res.items()}, flush=True)
first = res[keeps[0]]
for k, v in res.items():
    print(k, f"tok/s {sum(x[1] for x in v) / sum(x[0] for x in v):.2f} geo vs {keeps[0]} {statistics.geometric_mean([b[0] / x[0] for b, x in zip(first, v)]):.3f} acc {statistics.mean(x[2] for x in v):.3f} tpf {statistics.mean(x[3] for x in v):.2f} draft s/token {1000*statistics.mean(x[4] for x in v):.1f} ms")
