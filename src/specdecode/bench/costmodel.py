"""Measurements for the paper's cost model (the model itself is ``specdecode.costmodel``).

Glossary:
- *alpha*: the per-token acceptance probability, estimated from the mean number of accepted
  tokens per step, E[accepted] = alpha (1 - alpha^gamma) / (1 - alpha).
- *target curve*: seconds for one target pass over k new tokens, k = 1..16, measured at the
  suite's typical context length (on a CPU it is far from flat).
- *draft cost*: seconds per draft token.
Predicted tokens per target pass (1 - alpha^(gamma+1)) / (1 - alpha); predicted speedup over
plain decoding = that times t_target(1) / (gamma t_draft + t_target(gamma + 1)).
"""

from __future__ import annotations

import statistics
import time

import torch

from ..costmodel import alpha_from_mean_accepted, cost_model, expected_tokens_per_pass, predict  # noqa: F401 (the bench's names)
from ..runners import Runner

MAX_K = 16


def measure_target_curve(runner: Runner, context: list[int], max_k: int = MAX_K, repeats: int = 3, sync=lambda: None) -> dict[int, float]:
    ids = torch.tensor([context])
    runner.prefill(ids)
    base = torch.tensor([len(context)])
    curve = {}
    for k in range(1, max_k + 1):
        block = ids[:, -k:] if k <= len(context) else ids[:, :1].repeat(1, k)
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            runner.forward(block)
            sync()
            times.append(time.perf_counter() - t0)
            runner.truncate(base)
        curve[k] = statistics.median(times)
    return curve


def measure_draft_cost(runner: Runner, context: list[int], tokens: int = 8, sync=lambda: None) -> float:
    runner.prefill(torch.tensor([context]))
    times = []
    for i in range(tokens):
        sync()
        t0 = time.perf_counter()
        runner.forward(torch.tensor([[context[i % len(context)]]]))
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
