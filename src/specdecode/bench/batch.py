"""``bench --batch-size``: aggregate throughput of batched decoding, ours against transformers'.

Glossary:
- *aggregate tokens/s*: every new token of every prompt over the wall time of decoding the
  whole suite at that batch size (prefills included);
- ``ar``: our batched plain decoding; ``draft`` / ``ngram`` / ``hybrid``: our batched speculative
  decoding (ragged acceptance, finished rows refilled from the queue);
- ``hf``: transformers' batched ``generate`` on the same modules, the suite cut into batches of
  that size, left-padded (its rows wait for the batch's longest);
- *mismatch*: under greedy, a prompt whose tokens differ from ``ar`` at batch size 1.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from ..config import SamplingParams
from .methods import BenchContext, _cut_at_eos, hf_generate_kwargs

BATCH_METHODS = ("ar", "draft", "ngram", "hybrid", "hf")


def _ours(gen, encoded: list[list[int]], params: SamplingParams, batch_size: int, ctx: BenchContext) -> dict:
    ctx.sync()
    t0 = time.perf_counter()
    batch = gen.generate_batch(encoded, params, batch_size=batch_size)
    ctx.sync()
    wall = time.perf_counter() - t0
    rows = [r.stats for r in batch.results]
    drafted = sum(s.drafted_tokens for s in rows)
    return {
        "tokens": [r.token_ids for r in batch.results],
        "wall_seconds": wall,
        "target_forwards": batch.stats.target_forwards,
        "rows_per_forward": batch.stats.rows_per_forward,
        "acceptance_rate": sum(s.accepted_tokens for s in rows) / drafted if drafted else 0.0,
        "tokens_per_row_step": sum(s.new_tokens for s in rows) / max(1, sum(s.target_forwards for s in rows)),
        "prefill_seconds": sum(s.prefill_seconds for s in rows),
        "per_row": [{"new_tokens": s.new_tokens, "acceptance_rate": s.acceptance_rate, "prefill_seconds": s.prefill_seconds,
                     "tokens_per_target_forward": s.tokens_per_target_forward, "wall_seconds": s.wall_seconds} for s in rows],
    }


def _hf(ctx: BenchContext, encoded: list[list[int]], params: SamplingParams, batch_size: int) -> dict:
    model = ctx.spec.target.model
    device = next(model.parameters()).device
    kwargs = hf_generate_kwargs(ctx, params)
    eos, pad = set(kwargs["eos_token_id"]), kwargs["pad_token_id"]
    tokens: list[list[int]] = []
    ctx.sync()
    t0 = time.perf_counter()
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start : start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for j, p in enumerate(chunk):  # left padding
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        with torch.inference_mode():
            out = model.generate(ids.to(device), attention_mask=mask.to(device), **kwargs)
        tokens.extend(_cut_at_eos(row[width:].tolist(), eos) for row in out)
    ctx.sync()
    return {"tokens": tokens, "wall_seconds": time.perf_counter() - t0}


def run_batch_suite(
    ctx: BenchContext,
    prompts: Sequence,
    methods: Sequence[str],
    params: SamplingParams,
    batch_sizes: Sequence[int],
    progress: Callable | None = None,
) -> dict:
    """-> {"batch": {"B": {method: numbers}}, "batch_sizes": [...]} (the JSON's "batch" section)."""
    encoded = [ctx.spec.encode(p.text, chat=p.chat) for p in prompts]
    for ids in encoded:
        ctx.spec.engine.check_fits(len(ids), params.max_new_tokens)
    pick = {"ar": ctx.plain, "draft": ctx.spec, "ngram": ctx.ngram, "hybrid": ctx.hybrid}
    warm = params.warmup(8)

    def run(name: str, batch_size: int, p: SamplingParams, items) -> dict:
        if name == "hf":
            return _hf(ctx, items, p, batch_size)
        return _ours(pick[name], items, p, batch_size, ctx)

    for name in methods:
        run(name, min(2, len(encoded)), warm, encoded[:2])
    results: dict[str, dict] = {}
    reference = None
    bar = progress(total=len(batch_sizes) * len(methods)) if progress else None
    for turn, batch_size in enumerate(batch_sizes):
        order = list(methods[turn % len(methods):]) + list(methods[: turn % len(methods)])
        runs = {}
        for name in order:
            runs[name] = run(name, batch_size, params, encoded)
            if bar:
                bar.update(1)
        if reference is None and "ar" in runs:
            reference = runs["ar"]["tokens"] if batch_size == 1 else None
        ar_rate = _rate(runs["ar"]) if "ar" in runs else None
        entry = {}
        for name in methods:
            r = runs[name]
            numbers = {k: v for k, v in r.items() if k != "tokens"}
            numbers["new_tokens"] = sum(len(t) for t in r["tokens"])
            numbers["tokens_per_second"] = _rate(r)
            if ar_rate:
                numbers["speedup_vs_ar"] = _rate(r) / ar_rate
            if "hf" in runs and _rate(runs["hf"]) > 0:
                numbers["speedup_vs_hf"] = _rate(r) / _rate(runs["hf"])
            if params.greedy:
                base = reference if reference is not None else runs["ar"]["tokens"]
                numbers["mismatches"] = sum(a != b for a, b in zip(r["tokens"], base))
            entry[name] = numbers
        results[str(batch_size)] = entry
    if bar:
        bar.close()
    return {"batch_sizes": list(batch_sizes), "prompts": len(prompts), "batch": results,
            "mismatch_reference": "ar at batch size 1" if reference is not None else "ar at the same batch size"}


def _rate(run: dict) -> float:
    tokens = sum(len(t) for t in run["tokens"])
    return tokens / run["wall_seconds"] if run["wall_seconds"] > 0 else 0.0


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def format_batch_table(result: dict) -> str:
    lines = ["batch  method   tok/s    vs ar   vs hf   rows/fwd  accept  mismatches"]
    for batch_size, entry in result["batch"].items():
        for name, n in entry.items():
            lines.append(
                f"{batch_size:>5}  {name:<7} {n['tokens_per_second']:7.2f}  {_x(n.get('speedup_vs_ar')):>6}  "
                f"{_x(n.get('speedup_vs_hf')):>6}  {n.get('rows_per_forward', float('nan')):8.2f}  "
                f"{n.get('acceptance_rate', float('nan')):6.2f}  {n.get('mismatches', '-')}"
            )
    return "\n".join(lines)


def batch_markdown(result: dict, command: str) -> str:
    out = [f"Command: `{command}`", "", "| batch | method | aggregate tok/s | vs ar (same batch) | vs hf (same batch) | rows per forward | acceptance | mismatches |",
           "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for batch_size, entry in result["batch"].items():
        for name, n in entry.items():
            out.append(f"| {batch_size} | {name} | {n['tokens_per_second']:.2f} | {_x(n.get('speedup_vs_ar'))} | "
                       f"{_x(n.get('speedup_vs_hf'))} | {n.get('rows_per_forward', float('nan')):.2f} | "
                       f"{n.get('acceptance_rate', float('nan')):.2f} | {n.get('mismatches', '-')} |")
    return "\n".join(out) + "\n"
