"""The paper's cost model with a measured verification curve.

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


def alpha_from_mean_accepted(mean_accepted: float, gamma: int) -> float:
    """Invert E[accepted] = sum_{i=1..gamma} alpha^i by bisection."""
    if mean_accepted <= 0:
        return 0.0
    if mean_accepted >= gamma:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(1, gamma + 1)) < mean_accepted:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def expected_tokens_per_pass(alpha: float, gamma: int) -> float:
    return float(gamma + 1) if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def predict(alpha: float, curve: dict[int, float], draft_cost: float, max_gamma: int | None = None) -> list[dict]:
    max_gamma = max_gamma or max(curve) - 1
    rows = []
    for gamma in range(1, max_gamma + 1):
        tokens = expected_tokens_per_pass(alpha, gamma)
        step = gamma * draft_cost + curve[gamma + 1]
        rows.append({
            "gamma": gamma,
            "tokens_per_target_forward": tokens,
            "step_seconds": step,
            "predicted_speedup": tokens * curve[1] / step,
        })
    return rows


def cost_model(alpha: float, curve: dict[int, float], draft_cost: float) -> dict:
    rows = predict(alpha, curve, draft_cost)
    best = max(rows, key=lambda r: r["predicted_speedup"])
    return {
        "alpha": alpha,
        "target_seconds_by_k": {str(k): v for k, v in curve.items()},
        "draft_seconds_per_token": draft_cost,
        "c": draft_cost / curve[1],
        "by_gamma": rows,
        "best_gamma": best["gamma"],
        "best_predicted_speedup": best["predicted_speedup"],
    }
