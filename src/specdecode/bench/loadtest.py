"""``specdecode loadtest``: concurrent streaming clients against a running OpenAI-compatible server.

Glossary:
- *level*: a concurrency C; every prompt of the suite is sent once, with at most C requests in
  flight (C clients, each sending its next prompt when its last answer has ended);
- *variant*: what a request asks of the server's drafting: ``default`` sends no ``drafter``
  field (the server's own setting), any other name is sent as the body field ``drafter``;
- *TTFT* (time to first token): from sending a request to the first streamed chunk that carries
  text, as the client sees it;
- *ITL* (inter-token latency): the gap between two consecutive text-carrying chunks of a
  request, divided by that request's mean tokens per text-carrying chunk (completion tokens /
  such chunks); where every chunk carries one token these are the raw gaps;
- *latency*: from sending a request to the end of its stream;
- *aggregate throughput*: every completion token of a (level, variant) run over that run's wall
  time, from the first request sent to the last answer ended;
- *completion tokens*: the ``usage`` a stream's last chunks carry (asked for with
  ``stream_options.include_usage``), else the number of text-carrying chunks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..errors import SpecDecodeError
from .command import parse_batch_sizes
from .endpoint import base_url
from .suites import Prompt, load_suite

log = logging.getLogger("specdecode.bench")
DEFAULT_VARIANT = "default"
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class LoadTestConfig:
    url: str  # the server base, without /v1
    model: str
    concurrency: tuple[int, ...]
    variants: tuple[str, ...] = (DEFAULT_VARIANT,)
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    timeout: float = 600.0


def parse_concurrency(text: str) -> tuple[int, ...]:
    """'1,2,4,8' -> (1, 2, 4, 8), ascending, each level once."""
    try:
        return tuple(sorted(set(parse_batch_sizes(text))))
    except SpecDecodeError:
        raise SpecDecodeError(f"--concurrency takes positive integers separated by commas, not '{text}'",
                              field="concurrency") from None


def parse_variants(text: str) -> tuple[str, ...]:
    variants = [v.strip() for v in text.split(",") if v.strip()]
    if not variants or len(set(variants)) != len(variants):
        raise SpecDecodeError(f"--variants takes distinct names separated by commas (default or a drafter), not '{text}'",
                              field="variants")
    return tuple(variants)


def server_base(url: str) -> str:
    """The server's base URL, given with or without ``/v1``."""
    try:
        return base_url(url)
    except SpecDecodeError:
        raise SpecDecodeError(f"--url takes an http(s) URL such as http://127.0.0.1:8000, not '{url}'", field="url") from None


def _api_key() -> str:
    return os.environ.get("OPENAI_API_KEY") or "unused"


def served_model(base: str, model: str | None) -> str:
    """Check the server answers; -> ``model``, or the first id GET /v1/models lists."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key=_api_key(), max_retries=0, timeout=10.0)
    try:
        listed = [m.id for m in client.models.list().data]
    except openai.APIStatusError as exc:
        if model is not None:
            return model  # it answers, just not with a model list
        raise SpecDecodeError(f"{base}/v1/models answered HTTP {exc.status_code}; name the model with --model", field="model") from None
    except openai.APIError as exc:
        raise SpecDecodeError(f"cannot reach {base}: {exc.__cause__ or exc}", field="url") from None
    finally:
        client.close()
    if model is None and not listed:
        raise SpecDecodeError(f"{base}/v1/models lists no model; name one with --model", field="model")
    return model if model is not None else listed[0]


def _request_fields(config: LoadTestConfig, variant: str, max_tokens: int) -> dict:
    """Keyword arguments of one streaming create call."""
    extra = {} if variant == DEFAULT_VARIANT else {"drafter": variant}
    if config.ignore_eos:
        extra["ignore_eos"] = True
    fields = {"model": config.model, "max_tokens": max_tokens, "temperature": config.temperature, "stream": True,
              "stream_options": {"include_usage": True}, "extra_body": extra or None}
    if config.seed is not None:
        fields["seed"] = config.seed
    return fields


def _chunk_text(chunk, chat: bool) -> str:
    if not chunk.choices:
        return ""
    choice = chunk.choices[0]
    return (choice.delta.content if chat else choice.text) or ""


def _failure(exc: Exception) -> tuple[str, str]:
    """-> (status, message): the HTTP status, or timeout / connection / stream (an error event)."""
    import openai

    if isinstance(exc, openai.APIStatusError):
        return str(exc.status_code), str(exc.message)[:200]
    if isinstance(exc, openai.APITimeoutError):
        return "timeout", "request timed out"
    if isinstance(exc, openai.APIConnectionError):
        return "connection", str(exc.__cause__ or exc)[:200]
    return "stream", str(exc)[:200]


async def _stream(client, fields: dict, prompt: Prompt, t0: float, seen: dict) -> None:
    """Stream one answer into ``seen``: text pieces with their times from t0, usage, finish reason."""
    if prompt.chat:
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt.text}], **fields)
    else:
        stream = await client.completions.create(prompt=prompt.text, **fields)
    async for chunk in stream:
        piece = _chunk_text(chunk, prompt.chat)
        if piece:
            seen["times"].append(time.perf_counter() - t0)
            seen["pieces"].append(piece)
        seen["usage"] = chunk.usage or seen["usage"]
        seen["finish"] = (chunk.choices[0].finish_reason if chunk.choices else None) or seen["finish"]


async def _send(client, config: LoadTestConfig, prompt: Prompt, variant: str, max_tokens: int) -> dict:
    """One streamed request, ended after ``config.timeout`` seconds -> its record (times in
    seconds from sending it)."""
    import openai

    seen: dict = {"times": [], "pieces": [], "usage": None, "finish": None}
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(_stream(client, _request_fields(config, variant, max_tokens), prompt, t0, seen), config.timeout)
    except (openai.APIError, OSError, asyncio.TimeoutError) as exc:
        status, message = ("timeout", "request timed out") if isinstance(exc, asyncio.TimeoutError) else _failure(exc)
        return {"status": status, "error": message, "latency_seconds": time.perf_counter() - t0}
    latency = time.perf_counter() - t0
    times, pieces, usage = seen["times"], seen["pieces"], seen["usage"]
    counted = usage is not None and usage.completion_tokens is not None
    tokens = usage.completion_tokens if counted else len(pieces)
    per_chunk = tokens / len(pieces) if pieces else 1.0
    gaps = np.diff(times) / per_chunk if len(times) > 1 else np.array([])
    return {"status": "ok", "text": "".join(pieces), "finish_reason": seen["finish"], "completion_tokens": tokens,
            "tokens_from": "usage" if counted else "chunks", "text_chunks": len(pieces),
            "ttft_seconds": times[0] if times else None, "latency_seconds": latency,
            "itl_seconds": [float(g) for g in gaps]}


async def _run(client, config: LoadTestConfig, prompts: list[Prompt], level: int, variant: str) -> tuple[list[dict], float]:
    """Every prompt once, at most ``level`` in flight -> (records in prompt order, wall seconds)."""
    records: list[dict] = [{} for _ in prompts]
    todo = iter(enumerate(prompts))
    t0 = time.perf_counter()

    async def client_loop() -> None:
        for index, prompt in todo:
            sent = time.perf_counter() - t0
            record = await _send(client, config, prompt, variant, config.max_tokens)
            records[index] = {"concurrency": level, "variant": variant, "index": index, "id": prompt.id,
                              "sent_seconds": sent, **record}

    await asyncio.gather(*(client_loop() for _ in range(min(level, len(prompts)))))
    return records, time.perf_counter() - t0


async def _warm_up(client, config: LoadTestConfig, prompt: Prompt) -> None:
    """One short request per variant; a request the server rejects (4xx but 429) is a user error."""
    for variant in config.variants:
        record = await _send(client, config, prompt, variant, min(WARMUP_TOKENS, config.max_tokens))
        status = record["status"]
        if status.isdigit() and 400 <= int(status) < 500 and status != "429":
            raise SpecDecodeError(f"variant '{variant}': the server answered HTTP {status}: {record['error']}", field="variants")


async def _run_levels(config: LoadTestConfig, prompts: list[Prompt]) -> list[tuple[list[dict], float]]:
    import openai

    client = openai.AsyncOpenAI(base_url=config.url + "/v1", api_key=_api_key(), max_retries=0, timeout=config.timeout)
    runs = []
    try:
        await _warm_up(client, config, prompts[0])
        variants = list(config.variants)
        for turn, level in enumerate(config.concurrency):
            shift = turn % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                records, wall = await _run(client, config, prompts, level, variant)
                runs.append((records, wall))
                log.info("concurrency %d, variant %s: %d requests in %.2fs", level, variant, len(records), wall)
    finally:
        await client.close()
    return runs


def _percentiles(values: list[float], qs: tuple[int, ...]) -> dict[str, float | None]:
    if not values:
        return {f"p{q}": None for q in qs}
    return {f"p{q}": float(v) for q, v in zip(qs, np.percentile(values, qs))}


def summarize(records: list[dict], wall: float) -> dict:
    """One (level, variant) run's numbers; errors by status, 429s apart."""
    ok = [r for r in records if r["status"] == "ok"]
    tokens = sum(r["completion_tokens"] for r in ok)
    errors = Counter(r["status"] for r in records if r["status"] != "ok")
    return {
        "concurrency": records[0]["concurrency"], "variant": records[0]["variant"], "requests": len(records),
        "succeeded": len(ok), "completion_tokens": tokens, "wall_seconds": wall,
        "tokens_per_second": tokens / wall if wall > 0 else 0.0,
        "ttft_seconds": _percentiles([r["ttft_seconds"] for r in ok if r["ttft_seconds"] is not None], (50, 90, 99)),
        "itl_seconds": _percentiles([g for r in ok for g in r["itl_seconds"]], (50, 90, 99)),
        "latency_seconds": _percentiles([r["latency_seconds"] for r in ok], (50, 90)),
        "rate_limited": errors.pop("429", 0), "errors": dict(sorted(errors.items())),
    }


def _same_texts(records: list[dict], reference: list[dict]) -> dict:
    """Prompts answered in both runs, and how many of them got the same text."""
    pairs = [(a["text"], b["text"]) for a, b in zip(records, reference) if a["status"] == b["status"] == "ok"]
    return {"same": sum(a == b for a, b in pairs), "compared": len(pairs)}


def _compare(rows: list[dict], runs: dict[tuple[int, str], list[dict]], config: LoadTestConfig) -> None:
    """Ratios (tok/s vs the lowest level of the same variant, vs the first variant at the same
    level) and, under greedy, same-text counts against the same references."""
    base_level, first = config.concurrency[0], config.variants[0]
    rate = {(r["concurrency"], r["variant"]): r["tokens_per_second"] for r in rows}
    greedy = config.temperature == 0
    for row in rows:
        level, variant = row["concurrency"], row["variant"]
        for key, ref in (("vs_base_level", (base_level, variant)), ("vs_first_variant", (level, first))):
            row[f"tokens_per_second_{key}"] = rate[(level, variant)] / rate[ref] if rate[ref] > 0 else None
            row[f"same_text_{key}"] = _same_texts(runs[(level, variant)], runs[ref]) if greedy else None


def run_loadtest(config: LoadTestConfig, prompts: list[Prompt]) -> dict:
    """Warm up, then every level and variant -> {"config", "summary": rows, "requests": records}."""
    runs = asyncio.run(_run_levels(config, prompts))
    rows = [summarize(records, wall) for records, wall in runs]
    by_key = {(r["concurrency"], r["variant"]): records for r, (records, _) in zip(rows, runs)}
    _compare(rows, by_key, config)
    rows.sort(key=lambda r: (r["concurrency"], config.variants.index(r["variant"])))
    return {"config": {**asdict(config), "prompts": len(prompts), "base_level": config.concurrency[0],
                       "first_variant": config.variants[0]},
            "summary": rows, "requests": [r for records, _ in runs for r in records]}


def _ms(values: dict) -> str:
    return "/".join("-" if v is None else f"{v * 1e3:.0f}" for v in values.values())


def _same(counts: dict | None) -> str:
    return "-" if counts is None else f"{counts['same']}/{counts['compared']}"


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def format_table(result: dict) -> str:
    """One row per (level, variant)."""
    base, first = result["config"]["base_level"], result["config"]["first_variant"]
    header = ("conc", "variant", "reqs", "tokens", "tok/s", f"vs c={base}", f"vs {first}", "TTFT ms p50/90/99",
              "ITL ms p50/90/99", "latency s p50/90", "429", "errors", f"same as c={base}", f"same as {first}")
    table = [header]
    for r in result["summary"]:
        latency = "/".join("-" if v is None else f"{v:.2f}" for v in r["latency_seconds"].values())
        errors = " ".join(f"{k}:{n}" for k, n in r["errors"].items()) or "0"
        table.append((str(r["concurrency"]), r["variant"], str(r["requests"]), str(r["completion_tokens"]),
                      f"{r['tokens_per_second']:.2f}", _x(r["tokens_per_second_vs_base_level"]),
                      _x(r["tokens_per_second_vs_first_variant"]), _ms(r["ttft_seconds"]), _ms(r["itl_seconds"]),
                      latency, str(r["rate_limited"]), errors, _same(r["same_text_vs_base_level"]),
                      _same(r["same_text_vs_first_variant"])))
    widths = [max(len(cells[i]) for cells in table) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i > 1 else cell.ljust(w) for i, (cell, w) in enumerate(zip(cells, widths)))
             for cells in table]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def plots(result: dict, folder: Path) -> list[Path]:
    """throughput.png (tok/s vs concurrency per variant), ttft.png and itl.png (percentiles)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, levels = result["summary"], result["config"]["concurrency"]
    charts = (("throughput.png", "aggregate tok/s", lambda r: {"": r["tokens_per_second"]}),
              ("ttft.png", "TTFT (ms)", lambda r: {f" p{q}": _scaled(r["ttft_seconds"][f"p{q}"]) for q in (50, 90, 99)}),
              ("itl.png", "ITL (ms)", lambda r: {f" p{q}": _scaled(r["itl_seconds"][f"p{q}"]) for q in (50, 90, 99)}))
    written = []
    for name, ylabel, values in charts:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for color, variant in enumerate(result["config"]["variants"]):  # a colour a variant, a line style a percentile
            series = [values(r) for r in rows if r["variant"] == variant]
            for (suffix, _), style in zip(series[0].items(), ("-", "--", ":")):
                ax.plot(levels, [s[suffix] for s in series], style, color=f"C{color}", marker="o", label=variant + suffix)
        ax.set(xscale="log", xlabel="concurrency", ylabel=ylabel)
        ax.minorticks_off()
        ax.set(xticks=levels, xticklabels=[str(c) for c in levels])
        ax.legend(fontsize="small")
        fig.tight_layout()
        written.append(folder / name)
        fig.savefig(written[-1])
        plt.close(fig)
    return written


def _scaled(seconds: float | None) -> float:
    return float("nan") if seconds is None else seconds * 1e3


def write_outputs(result: dict, folder: Path) -> list[Path]:
    """loadtest.json (config, summary, every request) and the plots -> the paths written."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "loadtest.json"
    out.write_text(json.dumps(result, indent=2))
    return [out, *plots(result, folder)]


def command(args) -> str:
    """``specdecode loadtest`` from its parsed flags; -> the table for standard output."""
    if args.max_tokens < 1:
        raise SpecDecodeError(f"--max-tokens must be at least 1, got {args.max_tokens}", field="max_tokens")
    if args.temperature < 0:
        raise SpecDecodeError(f"--temperature must be >= 0, got {args.temperature}", field="temperature")
    if args.timeout <= 0:
        raise SpecDecodeError(f"--timeout must be positive, got {args.timeout}", field="timeout")
    levels, variants = parse_concurrency(args.concurrency), parse_variants(args.variants)
    prompts = load_suite(args.suite, args.limit, args.offset)
    base = server_base(args.url)
    config = LoadTestConfig(base, served_model(base, args.model), levels, variants, args.max_tokens, args.temperature,
                            args.seed, args.ignore_eos, args.timeout)
    result = run_loadtest(config, prompts)
    if args.out:
        log.info("wrote %s", ", ".join(str(p) for p in write_outputs(result, Path(args.out))))
    return format_table(result)
