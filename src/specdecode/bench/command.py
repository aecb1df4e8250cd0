"""``specdecode bench`` and ``specdecode tune``: load once, run, write JSON / Markdown / PNG.

Glossary: the *baseline* is ``ar``; *tune* runs only the draft method on a few prompts plus
the cost-model calibration and prints the gamma it predicts is best.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from ..config import SamplingParams, SpecConfig, draft_prefill_for, parse_draft_vocab
from ..errors import SpecDecodeError
from . import harness, report
from .anchors import ANCHOR_METHODS, SERVER_METHODS, Anchors
from .methods import METHODS, NEEDS_DRAFT, BenchContext
from .suites import load_suite


DEFAULT_METHODS = "ar,draft,draft-hf,ngram,hf,hf-assisted,hf-lookup"
log = logging.getLogger("specdecode.bench")


def _load(args):
    import torch

    from ..api import SpeculativeGenerator

    from .. import models

    draft_runner = args.draft_runner
    if getattr(args, "batch_sizes", None) and draft_runner == "auto" and args.device == "cpu" and args.dtype == "float32":
        draft_runner = "int8"  # batches need a draft runner that batches; llama.cpp runs one row
    spec = SpeculativeGenerator.from_pretrained(args.target, args.draft, gamma=args.gamma, device=args.device,
                                                dtype=args.dtype, runner=args.runner, draft_runner=draft_runner,
                                                draft_confidence=args.draft_confidence, draft_vocab=parse_draft_vocab(args.draft_vocab),
                                                draft_quant=args.draft_quant, draft_prefill=draft_prefill_for(args.draft_prefill))
    plain = spec.variant(None)
    ngram = spec.variant("ngram")
    hybrid = spec.variant("hybrid") if spec.draft is not None else None
    auto = spec.variant("model", gamma="auto") if spec.draft is not None else None
    auto_nofill = spec.variant("model", gamma="auto", lookup_fill=False) if spec.draft is not None else None
    hf_draft = None
    if spec.draft is not None and spec.draft.model is None and not getattr(args, "batch_sizes", None):  # a llama.cpp draft: load its transformers twin
        twin = models.load(args.draft, models.parse_device(args.device), models.parse_dtype(args.dtype),
                           runner=spec.target.runner, role="draft")
        hf_draft = SpeculativeGenerator(spec.target, twin, gamma=args.gamma, runners=(spec.target_runner, None))
    sync = torch.cuda.synchronize if spec.target_runner.device.type == "cuda" else (lambda: None)
    return BenchContext(spec, plain, ngram, hf_draft, hybrid, auto, sync, auto_nofill=auto_nofill)


def default_methods(args) -> str:
    """DEFAULT_METHODS, plus the methods --llama-server and --endpoint make available."""
    extra = [*(SERVER_METHODS if getattr(args, "llama_server", None) else ()), *(["endpoint"] if getattr(args, "endpoint", None) else [])]
    return ",".join([DEFAULT_METHODS, *extra])


def _anchors(args, methods: list[str]) -> Anchors | None:
    """Check what the anchor methods need before the models load (a one-line error otherwise)."""
    server, endpoint = getattr(args, "llama_server", None), getattr(args, "endpoint", None)
    for flag, value, uses in (("--llama-server", server, SERVER_METHODS), ("--endpoint", endpoint, ("endpoint",))):
        if value is not None and not set(uses) & set(methods):
            log.warning("%s is given but no method uses it (add %s to --methods)", flag, " or ".join(uses))
    if not set(ANCHOR_METHODS) & set(methods):
        return None
    return Anchors(methods, args.target, args.draft, server, endpoint)


def parse_methods(text: str, has_draft: bool) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise SpecDecodeError(f"unknown method(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(METHODS)}", field="methods")
    if not has_draft and NEEDS_DRAFT & set(methods):
        raise SpecDecodeError(f"methods {', '.join(sorted(NEEDS_DRAFT & set(methods)))} need a --draft model", field="methods")
    if "ar" not in methods:
        methods.insert(0, "ar")  # the baseline of every ratio
    return methods


def parse_batch_sizes(text: str | None) -> list[int]:
    if text is None:
        return []
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(b < 1 for b in sizes):
        raise SpecDecodeError(f"--batch-size takes positive integers separated by commas, not '{text}'", field="batch_size")
    return sizes


def run_batch_command(args, params: SamplingParams, command_line: str, has_draft: bool) -> str:
    from tqdm import tqdm

    from .batch import BATCH_METHODS, batch_markdown, format_batch_table, run_batch_suite

    methods = [m.strip() for m in (args.methods or "ar,draft,hf").split(",") if m.strip()]
    unknown = [m for m in methods if m not in BATCH_METHODS]
    if unknown:
        raise SpecDecodeError(f"with --batch-size, methods are {', '.join(BATCH_METHODS)} (not {', '.join(unknown)})", field="methods")
    if {"draft", "hybrid"} & set(methods) and not has_draft:
        raise SpecDecodeError("methods draft and hybrid need a --draft model", field="methods")
    if "ar" not in methods:
        methods.insert(0, "ar")
    prompts = load_suite(args.suite, args.limit, args.offset)
    ctx = _load(args)
    batch = run_batch_suite(ctx, prompts, methods, params, args.batch_sizes,
                            progress=lambda total: tqdm(total=total, desc="batch runs", file=sys.stderr))
    result = {"config": {
        "command": command_line, "target": args.target, "draft": args.draft, "gamma": args.gamma, "device": args.device,
        "dtype": args.dtype, "suite": args.suite, "prompts": len(prompts), "offset": args.offset,
        "max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
        "ignore_eos": params.ignore_eos, "methods": methods,
        "batch_sizes": args.batch_sizes, "runner": ctx.spec.target.runner,
        "draft_runner": ctx.spec.draft.runner if ctx.spec.draft else None, "draft_gguf": _draft_gguf(ctx),
    }, **batch}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(batch_markdown(batch, command_line))
    log.info("wrote %s, %s", out, out.with_suffix(".md"))
    return format_batch_table(batch)


def _draft_gguf(ctx) -> str | None:
    """The file a llama.cpp draft ran (its name says any requantization or trimmed vocabulary)."""
    draft = ctx.spec.draft
    return draft.gguf_path if draft is not None and draft.runner == "llamacpp" else None


def run_command(args, params: SamplingParams, command_line: str) -> str:
    """Run ``bench`` or ``tune`` as the parsed flags say; -> the text for standard output
    (files written are logged)."""
    args.gamma = int(args.gamma) if args.gamma.isdigit() else args.gamma
    args.batch_sizes = parse_batch_sizes(getattr(args, "batch_size", None))
    if args.gamma == "auto":
        raise SpecDecodeError("bench runs fixed-gamma methods; the adaptive one is the method draft-auto", field="gamma")
    SpecConfig(gamma=args.gamma, draft_confidence=args.draft_confidence)
    parse_draft_vocab(args.draft_vocab)  # a bad value fails before the models load
    if args.drafter != "model":
        raise SpecDecodeError("bench picks drafters by --methods (ngram, hybrid, ...); leave --drafter at model",
                              field="drafter")
    has_draft = args.draft is not None and args.draft.lower() not in ("none", "ngram")
    if args.batch_sizes:
        if getattr(args, "llama_server", None) or getattr(args, "endpoint", None):
            raise SpecDecodeError("--llama-server and --endpoint time single requests; leave out --batch-size", field="batch_size")
        return run_batch_command(args, params, command_line, has_draft)
    methods = parse_methods(args.methods or default_methods(args), has_draft) if args.command == "bench" else ["ar", "draft"]
    if args.command == "tune" and not has_draft:
        raise SpecDecodeError("tune needs a --draft model", field="draft")
    prompts = load_suite(args.suite, args.limit, args.offset)
    anchors = _anchors(args, methods)
    try:
        ctx = _load(args)
        ctx.anchors = anchors
        from tqdm import tqdm

        result = harness.run_suite(ctx, prompts, methods, params, progress=lambda total: tqdm(total=total, desc="prompts", file=sys.stderr))
    finally:
        if anchors is not None:
            anchors.close()
    result["config"] = {
        "command": command_line, "target": args.target, "draft": args.draft, "gamma": args.gamma,
        "device": args.device, "dtype": args.dtype, "suite": args.suite, "prompts": len(prompts), "offset": args.offset,
        "max_new_tokens": params.max_new_tokens, "temperature": params.temperature, "top_k": params.top_k,
        "top_p": params.top_p, "seed": params.seed, "ignore_eos": params.ignore_eos, "methods": methods,
        "runner": ctx.spec.target.runner, "draft_runner": ctx.spec.draft.runner if ctx.spec.draft else None,
        "draft_gguf": _draft_gguf(ctx),
        "hf_defaults": "assisted: transformers defaults; lookup: prompt_lookup_num_tokens=10",
        "anchors": anchors.describe() if anchors is not None else None,
    }
    if has_draft and not getattr(args, "no_cost_model", False):
        harness.attach_cost_model(result, ctx, prompts, args.gamma)
    result = {"config": result.pop("config"), **result}
    table = report.format_table(result)
    if args.command == "tune":
        cm = result.get("cost_model")
        if cm:
            table += f"\nrecommended: --gamma {cm['best_gamma']} (predicted {cm['best_predicted_speedup']:.2f}x over plain decoding)"
        return table
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(report.markdown(result))
    written = report.plots(result, out.parent)
    log.info("wrote %s", ", ".join(str(p) for p in [out, out.with_suffix(".md"), *written]))
    return table
