"""The paper's cost model with a measured verification curve: one model for the policy and the bench.

Glossary:
- *acceptances*: per draft position i, the probability that drafted token i is accepted given
  that the ones before it were; a single *alpha* is the same rate at every position.
- *expected tokens*: tokens one target pass commits for a draft of k, 1 + sum_j prod_{i<=j} a_i
  (the paper's (1 - alpha^(k+1)) / (1 - alpha) for a constant rate).
- *verify curve*: T(m), seconds for one target pass that scores m tokens a row (m = k + 1 for a
  draft of k: the pending token and the drafts); on a CPU it is far from flat.
- *step seconds*: draft time for k tokens plus T(k + 1).
- *speedup*: expected tokens per step second against one token per T(1).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence


def expected_tokens(acceptances: Sequence[float], k: int) -> float:
    """Tokens a pass commits when k tokens are drafted with these per-position acceptances."""
    total, survive = 1.0, 1.0
    for a in list(acceptances)[:k]:
        survive *= a
        total += survive
    return total


def expected_tokens_per_pass(alpha: float, gamma: int) -> float:
    return float(gamma + 1) if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


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


def interpolate(curve: Mapping[float, float], m: float) -> float | None:
    """T(m) from a measured curve: exact where measured, linear between measured sizes, the
    nearest end outside them; None with nothing measured."""
    if m in curve:
        return curve[m]
    known = sorted(curve)
    if not known:
        return None
    lower = [x for x in known if x <= m]
    upper = [x for x in known if x >= m]
    if lower and upper:
        a, b = lower[-1], upper[0]
        return curve[a] + (curve[b] - curve[a]) * (m - a) / (b - a)
    return curve[lower[-1] if lower else upper[0]]


def best_length(acceptances: Sequence[float], draft_seconds: Callable[[int], float],
                pass_seconds: Callable[[int], float], cap: int, passengers: float = 0.0) -> tuple[int, float]:
    """(k, tokens per second a drafting row) of the best draft length in 0..cap; k = 0 is a plain
    step. passengers: rows per drafting row that share the pass without drafting (one token each)."""
    best_k, best_rate = 0, (1.0 + passengers) / pass_seconds(1)
    for k in range(1, cap + 1):
        rate = (passengers + expected_tokens(acceptances, k)) / (draft_seconds(k) + pass_seconds(k + 1))
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k, best_rate


def predict(alpha: float, curve: Mapping[int, float], draft_cost: float, max_gamma: int | None = None) -> list[dict]:
    """Per gamma: expected tokens per pass, step seconds and speedup over plain decoding."""
    max_gamma = max_gamma or max(curve) - 1
    rows = []
    for gamma in range(1, max_gamma + 1):
        tokens = expected_tokens([alpha] * gamma, gamma)
        step = gamma * draft_cost + curve[gamma + 1]
        rows.append({
            "gamma": gamma,
            "tokens_per_target_forward": tokens,
            "step_seconds": step,
            "predicted_speedup": tokens * curve[1] / step,
        })
    return rows


def cost_model(alpha: float, curve: Mapping[int, float], draft_cost: float) -> dict:
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
