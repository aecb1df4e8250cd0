# Measures draft-length and confidence-stop settings (docs/benchmarks.md, "Confidence stop"; not part of the package).
# Interleaved A/B of draft-length settings on one loaded pair: each arm is "gamma:confidence"
# (gamma an integer or auto; confidence the --draft-confidence stop, 0 = off), each on its own
# engine, greedy, HumanEval prompts argv[2]..argv[3], the order rotating per prompt; outputs
# asserted identical. Prints per-prompt times and each arm's geometric-mean speed over the first.
#   python scripts/confidence.py 5:0,8:0.5,8:0.3,auto:0 0 10
import math, statistics, sys
from specdecode.api import SpeculativeGenerator
from specdecode.bench.suites import load_suite
from specdecode.config import SamplingParams
names = sys.argv[1].split(",")
first, last = int(sys.argv[2]), int(sys.argv[3])
gen = SpeculativeGenerator.from_pretrained(progress=False)
arms = {}
for name in names:
    gamma, confidence = name.split(":")
    arms[name] = gen.variant("model", gamma=gamma if gamma == "auto" else int(gamma), draft_confidence=float(confidence))
prompts = load_suite("humaneval", limit=last - first, offset=first)
params = SamplingParams(max_new_tokens=128)
for arm in arms.values():
    arm.generate(prompts[0].text, params)  # warm-up (and the adaptive arm's first measurements)
res = {name: [] for name in names}
for i, prompt in enumerate(prompts):
    order = names[i % len(names):] + names[: i % len(names)]
    out = {name: arms[name].generate(prompt.text, params) for name in order}
    assert all(out[name].token_ids == out[names[0]].token_ids for name in names)
    for name in names:
        s = out[name].stats
        res[name].append((s.wall_seconds, s.new_tokens, s.tokens_per_target_forward, s.drafted_tokens, s.accepted_tokens, s.draft_seconds, s.verify_seconds))
    print(prompt.id, {n: f"{v[-1][0]:.2f}s tpf {v[-1][2]:.2f}" for n, v in res.items()}, flush=True)
base = res[names[0]]
for name, v in res.items():
    geo = math.exp(statistics.mean(math.log(b[0] / x[0]) for b, x in zip(base, v)))
    print(f"{name}: tok/s {sum(x[1] for x in v) / sum(x[0] for x in v):.2f}, speed vs {names[0]} {geo:.3f}x, "
          f"tok/fwd {statistics.mean(x[2] for x in v):.2f}, drafted {sum(x[3] for x in v)}, accepted {sum(x[4] for x in v)}, "
          f"draft {sum(x[5] for x in v):.1f} s, verify {sum(x[6] for x in v):.1f} s")
