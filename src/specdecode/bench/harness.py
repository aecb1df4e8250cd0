"""Running methods over a suite: warm-up, rotating order per prompt, pairing, mismatch checks.

Glossary:
- *rotation*: prompt i runs the methods starting at offset i, so drift on the machine falls on
  every method alike;
- *pairwise speedup*: method tokens/s over baseline tokens/s on the same prompt; summarised by
  geometric mean, min and max;
- *mismatch*: under greedy, a prompt where a method's tokens differ from ``ar``'s;
- *same text*: for a method outside our engine (``MethodRun.text`` set), under greedy, a prompt
  where its answer text equals ``ar``'s; counted, not held against it (bench.anchors).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from ..config import SamplingParams
from ..text import answer_text
from .methods import METHODS, BenchContext, MethodRun
from .suites import Prompt

WARMUP_TOKENS = 8


def run_suite(
    ctx: BenchContext,
    prompts: Sequence[Prompt],
    methods: Sequence[str],
    params: SamplingParams,
    progress: Callable | None = None,
) -> dict:
    """-> {"methods": {name: summary}, "per_prompt": [...]}"""
    encoded = [ctx.spec.encode(p.text, chat=p.chat) for p in prompts]
    for ids in encoded:
        ctx.spec.engine.check_fits(len(ids), params.max_new_tokens)
    if ctx.anchors is not None:
        ctx.anchors.reserve(max(len(ids) for ids in encoded) + params.max_new_tokens)
    warm = params.warmup(WARMUP_TOKENS)
    for name in methods:
        METHODS[name](ctx, encoded[0], warm)
    per_prompt = []
    bar = progress(total=len(prompts)) if progress else None
    for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
        order = list(methods[i % len(methods):]) + list(methods[: i % len(methods)])
        runs = {name: METHODS[name](ctx, ids, params) for name in order}
        per_prompt.append(_prompt_row(prompt, ids, runs, order, params, lambda tokens: answer_text(ctx.spec.tokenizer, ids, tokens)))
        if bar:
            bar.update(1)
    if bar:
        bar.close()
    return {"methods": {name: summarise(name, per_prompt) for name in methods}, "per_prompt": per_prompt}


def _prompt_row(prompt: Prompt, ids: list[int], runs: dict[str, MethodRun], order: list[str], params,
                decode: Callable[[list[int]], str]) -> dict:
    """decode: answer token ids -> their text (what ar's answer is compared with as text)."""
    reference = runs.get("ar") if params.greedy else None
    reference_text = None
    row = {"prompt_id": prompt.id, "prompt_tokens": len(ids), "order": order, "methods": {}}
    for name, run in runs.items():
        entry = {
            "new_tokens": run.new_tokens,
            "wall_seconds": run.wall_seconds,
            "tokens_per_second": run.new_tokens / run.wall_seconds if run.wall_seconds > 0 else 0.0,
            "stats": run.stats,
        }
        if reference is not None and run.text is None:
            entry["mismatch"] = run.tokens != reference.tokens
        if reference is not None and run.text is not None:
            reference_text = decode(reference.tokens) if reference_text is None else reference_text
            entry["same_text"] = run.text == reference_text
        if reference is not None and (run.text is None or run.tokens):
            entry["first_divergence"] = _first_divergence(run.tokens, reference.tokens)
        if run.extra:
            entry["extra"] = run.extra
        row["methods"][name] = entry
    return row


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _ratios(name: str, baseline: str, rows: list[dict]) -> dict | None:
    pairs = [(r["methods"][name], r["methods"][baseline]) for r in rows if name in r["methods"] and baseline in r["methods"]]
    ratios = [m["tokens_per_second"] / b["tokens_per_second"] for m, b in pairs if b["tokens_per_second"] > 0]
    if not ratios:
        return None
    return {
        "geomean": math.exp(sum(math.log(x) for x in ratios) / len(ratios)),
        "min": min(ratios),
        "max": max(ratios),
    }


def summarise(name: str, rows: list[dict]) -> dict:
    entries = [r["methods"][name] for r in rows]
    new_tokens = sum(e["new_tokens"] for e in entries)
    wall = sum(e["wall_seconds"] for e in entries)
    summary = {
        "new_tokens": new_tokens,
        "wall_seconds": wall,
        "tokens_per_second": new_tokens / wall if wall > 0 else 0.0,
        "speedup_vs_ar": _ratios(name, "ar", rows),
        "speedup_vs_hf_assisted": _ratios(name, "hf-assisted", rows),
        "mismatches": sum(1 for e in entries if e.get("mismatch")) if "mismatch" in entries[0] else None,
        "same_text_as_ar": sum(1 for e in entries if e.get("same_text")) if "same_text" in entries[0] else None,
        "prompts": len(entries),
        "acceptance_rate": None,
        "tokens_per_target_forward": None,
        "accepted_by_position": None,
        "draft_seconds": None,
        "verify_seconds": None,
    }
    stats = [e["stats"] for e in entries if e["stats"]]
    if stats:
        drafted = sum(s["drafted_tokens"] for s in stats)
        accepted = sum(s["accepted_tokens"] for s in stats)
        forwards = sum(s["target_forwards"] for s in stats)
        width = max(len(s["accepted_by_position"]) for s in stats)
        by_pos_acc = [sum(s["accepted_by_position"][i] for s in stats if i < len(s["accepted_by_position"])) for i in range(width)]
        by_pos_draft = [sum(s["drafted_by_position"][i] for s in stats if i < len(s["drafted_by_position"])) for i in range(width)]
        summary.update(
            acceptance_rate=accepted / drafted if drafted else None,
            tokens_per_target_forward=sum(s["new_tokens"] for s in stats) / forwards if forwards else None,
            accepted_by_position=[a / d if d else None for a, d in zip(by_pos_acc, by_pos_draft)],
            mean_accepted_per_step=accepted / forwards if forwards else None,
            draft_seconds=sum(s["draft_seconds"] for s in stats),
            verify_seconds=sum(s["verify_seconds"] for s in stats),
        )
    return summary


def attach_cost_model(result: dict, ctx: BenchContext, prompts: Sequence[Prompt], gamma: int) -> dict | None:
    """Measure the target's k-token pass curve and the draft's token cost; predict against measured."""
    from . import costmodel

    draft_summary = result["methods"].get("draft")
    if ctx.spec.drafter is None or not draft_summary or draft_summary.get("mean_accepted_per_step") is None:
        return None
    encoded = sorted((ctx.spec.encode(p.text, chat=p.chat) for p in prompts), key=len)
    typical = encoded[len(encoded) // 2]
    curve = costmodel.measure_target_curve(ctx.spec.target_runner, typical, sync=ctx.sync)
    draft_cost = costmodel.measure_draft_cost(ctx.spec.drafter.runner, typical, sync=ctx.sync)
    alpha = costmodel.alpha_from_mean_accepted(draft_summary["mean_accepted_per_step"], gamma)
    model = costmodel.cost_model(alpha, curve, draft_cost)
    at_gamma = next(r for r in model["by_gamma"] if r["gamma"] == gamma) if gamma < costmodel.MAX_K else None
    model["predicted_at_gamma"] = at_gamma["predicted_speedup"] if at_gamma else None
    measured = draft_summary["speedup_vs_ar"]
    model["measured_speedup"] = measured["geomean"] if measured else None
    model["context_tokens"] = len(typical)
    model["in_run"] = in_run_costs(result, gamma)
    result["cost_model"] = model
    return model


def in_run_costs(result: dict, gamma: int) -> dict | None:
    """The same model fed with the costs the run itself measured (draft feeding, kernels by block
    size, machine load included), and the share of wall time spent in prompt prefill."""
    rows = [r for r in result["per_prompt"] if r["methods"].get("ar", {}).get("stats") and r["methods"].get("draft", {}).get("stats")]
    if not rows:
        return None
    total = lambda name, key: sum(r["methods"][name]["stats"][key] for r in rows)  # noqa: E731
    t1 = total("ar", "verify_seconds") / total("ar", "target_forwards")
    forwards = total("draft", "target_forwards")
    t_draft = total("draft", "draft_seconds") / max(1, total("draft", "drafted_tokens"))
    t_verify = total("draft", "verify_seconds") / forwards
    tokens_per_forward = total("draft", "new_tokens") / forwards
    step_seconds = (total("draft", "draft_seconds") + total("draft", "verify_seconds")) / forwards
    decode_speedup = tokens_per_forward * t1 / step_seconds  # excludes prompt prefill
    return {
        "ar_seconds_per_forward": t1,
        "draft_seconds_per_drafted_token": t_draft,
        "verify_seconds_per_forward": t_verify,
        "tokens_per_target_forward": tokens_per_forward,
        "decode_only_speedup": decode_speedup,
        "prefill_share_ar": total("ar", "prefill_seconds") / total("ar", "wall_seconds"),
        "prefill_share_draft": total("draft", "prefill_seconds") / total("draft", "wall_seconds"),
    }
