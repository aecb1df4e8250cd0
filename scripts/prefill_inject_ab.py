# Measures a llama.cpp draft prefilled on the int8 path against one prefilling itself (docs/benchmarks.md,
# "Draft prefill on the int8 path"; not part of the package). It copies int8-path keys and values into
# llama.cpp with a subclass of its own (the runner's prefill_runner does the same); greedy A/B against
# llama.cpp's own prefill, outputs asserted identical.
# python scripts/prefill_inject_ab.py OFFSET LIMIT [TEMPERATURE]
import ctypes, struct, statistics, sys, time, numpy as np, torch
torch.set_num_threads(2)
import llama_cpp
from specdecode import models, packs
from specdecode.runners.factory import hf_runner
from specdecode.runners.llamacpp import LlamaCppRunner, requantized_gguf
from specdecode.api import SpeculativeGenerator
from specdecode.config import SamplingParams
from specdecode.bench.suites import load_suite
src = str(packs.ensure_assembled(packs.get_pack(packs.DEFAULT_DRAFT), progress=False))
q = requantized_gguf(src, "q4_0", packs.cache_dir())
H = hf_runner(models.load(packs.DEFAULT_DRAFT, torch.device("cpu"), torch.float32, runner="int8", role="draft").model)

class Injected(LlamaCppRunner):
    def prefill(self, ids):
        with torch.inference_mode():
            logits = H.prefill(ids)
        cells = ids.shape[1]
        n_layer = len(H.cache.layers)
        parts = [struct.pack("<IiII", 0xaf143cd8, 0, 1, cells), np.array([(i, 1, 0) for i in range(cells)], dtype="<i4").tobytes(), struct.pack("<II", 0, n_layer)]
        for name in ("keys", "values"):
            for l in range(n_layer):
                x = getattr(H.cache.layer(l), name)[0, :, :cells].permute(1, 0, 2).reshape(cells, -1).to(torch.float16).numpy()
                parts.append(struct.pack("<iQ", 1, x.shape[1] * 2)); parts.append(x.tobytes())
        blob = b"".join(parts)
        self.reset(1)
        arr = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        assert llama_cpp.llama_state_seq_set_data(self.llm.ctx, arr, len(blob), 0) == len(blob)
        self._length = cells
        return logits

base = SpeculativeGenerator.from_pretrained(progress=False)
temp = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
gens = {"llama": SpeculativeGenerator(base.target, base.draft, gamma=5, runners=(base.target_runner, LlamaCppRunner(q))),
        "inject": SpeculativeGenerator(base.target, base.draft, gamma=5, runners=(base.target_runner, Injected(q)))}
kinds = list(gens)
prompts = load_suite("humaneval", limit=int(sys.argv[2]), offset=int(sys.argv[1]))
p = SamplingParams(max_new_tokens=128, temperature=temp, seed=0)
for g in gens.values(): g.generate(prompts[0].text, p)
res = {k: [] for k in kinds}
for i, pr in enumerate(prompts):
    order = kinds[i % 2:] + kinds[:i % 2]
    toks = {}
    for k in order:
        r = gens[k].generate(pr.text, p)
        toks[k] = r.token_ids
        res[k].append((r.stats.wall_seconds, r.stats.new_tokens, r.stats.acceptance_rate, r.stats.tokens_per_target_forward, r.stats.prefill_seconds))
    if temp == 0: assert toks["llama"] == toks["inject"]
    print(i, {k: f"{v[-1][0]:.2f}s pre {v[-1][4]:.2f} acc {v[-1][2]:.2f} tpf {v[-1][3]:.2f}" for k, v in res.items()}, flush=True)
first = res[kinds[0]]
for k, v in res.items():
    print(k, f"tok/s {sum(x[1] for x in v) / sum(x[0] for x in v):.2f} geo vs llama {statistics.geometric_mean([b[0] / x[0] for b, x in zip(first, v)]):.3f} acc {statistics.mean(x[2] for x in v):.3f} tpf {statistics.mean(x[3] for x in v):.2f}")
