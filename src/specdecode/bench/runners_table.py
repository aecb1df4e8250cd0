"""``specdecode runners``: each CPU path's cost to score k tokens and its batch invariance.

Glossary:
- *k-token pass*: one target call over k new tokens after a fixed prefix (median of repeats).
- *batch invariance*: the logits of a block of 16 tokens against the same 16 tokens scored one
  at a time over the same prefix: the largest absolute difference and whether every argmax agrees.
"""

from __future__ import annotations

import statistics
import time

import torch

KS = (1, 2, 4, 6, 8, 16)
PREFIX = 200


def measure(runner, repeats: int = 3) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 20000, (1, PREFIX + 16), generator=g)
    runner.prefill(ids[:, :PREFIX])
    base = torch.tensor([PREFIX])
    times = {}
    for k in KS:
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.forward(ids[:, PREFIX : PREFIX + k])
            samples.append(time.perf_counter() - t0)
            runner.truncate(base)
        times[k] = statistics.median(samples)
    block = runner.forward(ids[:, PREFIX:])[0].float()
    singles = []
    for i in range(16):
        runner.truncate(torch.tensor([PREFIX + i]))
        singles.append(runner.forward(ids[:, PREFIX + i : PREFIX + i + 1])[0, 0].float())
    singles = torch.stack(singles)
    return {
        "ms_by_k": {k: v * 1e3 for k, v in times.items()},
        "max_abs_diff": float((block - singles).abs().max()),
        "argmax_identical": bool((block.argmax(-1) == singles.argmax(-1)).all()),
    }


def runner_table(reference: str, with_llamacpp: bool = True) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from ..models import gguf_source, resolve
    from ..runners.factory import hf_runner
    from ..runners.hf import HFRunner
    from ..runners.int8 import prepare_int8
    from ..runners.llamacpp import LlamaCppRunner, llamacpp_available

    location, extra = resolve(reference)
    model = AutoModelForCausalLM.from_pretrained(location, dtype=torch.float32, **extra).eval()
    rows = [{"path": "fp32 (transformers, SDPA)", **measure(HFRunner(model))}]
    rows.append({"path": "int8 per-token + row-wise attention (specdecode int8)", **measure(hf_runner(prepare_int8(model)))})
    del model
    gguf = gguf_source(reference)
    if with_llamacpp and llamacpp_available() and gguf is not None and gguf.is_file():
        rows.append({"path": "llama.cpp Q4_K_M (llama-cpp-python)", **measure(LlamaCppRunner(str(gguf)))})
    return rows


def format_rows(rows: list[dict]) -> str:
    head = "| path | " + " | ".join(f"k={k}" for k in KS) + " | k=6 / k=1 | block-16 vs singles: max abs diff | argmax identical |"
    lines = [head, "|" + "---|" * (len(KS) + 4)]
    for r in rows:
        ms = r["ms_by_k"]
        lines.append(f"| {r['path']} | " + " | ".join(f"{ms[k]:.0f} ms" for k in KS)
                     + f" | {ms[6] / ms[1]:.2f} | {r['max_abs_diff']:.3g} | {'yes' if r['argmax_identical'] else 'no'} |")
    return "\n".join(lines)
