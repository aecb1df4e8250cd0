"""Decoding methods a benchmark compares, all over the same loaded target and prompts.

Glossary:
- ``ar``: our engine with no drafter, the baseline of every ratio;
- ``draft``: our engine with the draft model at a fixed gamma (its own runner, e.g. llama.cpp);
- ``draft-hf``: our engine with the draft as the transformers module hf-assisted gets;
- ``ngram``: our engine with n-gram prompt lookup (no draft model);
- ``hybrid``: lookup when it finds a continuation, else the draft model;
- ``draft-auto``: the draft model with the adaptive draft length (``--gamma auto``, which brings
  the 0.7 confidence stop unless ``--draft-confidence`` is given, and the engine's lookup fill);
  ``draft-auto-nofill``: the same without the lookup fill;
- ``hf``, ``hf-assisted``, ``hf-lookup``: transformers ``generate`` plain, with the draft as
  ``assistant_model``, and with ``prompt_lookup_num_tokens`` (Hugging Face's defaults otherwise);
- ``llamacpp``, ``llamacpp-server``, ``llamacpp-server-spec``, ``endpoint``: runs outside our
  engine, registered by ``bench.anchors`` (see its glossary).
A drafter added later registers its method with ``@register("name")``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..api import SpeculativeGenerator
from ..config import SamplingParams

HF_LOOKUP_TOKENS = 10


@dataclass
class BenchContext:
    spec: SpeculativeGenerator  # target + draft
    plain: SpeculativeGenerator  # the same target, no drafter
    ngram: SpeculativeGenerator  # the same target, n-gram prompt lookup
    hf_draft: SpeculativeGenerator | None = None  # the same target with the transformers draft module
    hybrid: SpeculativeGenerator | None = None  # lookup when it finds a continuation, else the draft
    auto: SpeculativeGenerator | None = None  # the draft model with adaptive gamma
    sync: Callable[[], None] = lambda: None
    anchors: object | None = None  # bench.anchors.Anchors when an anchor method runs
    auto_nofill: SpeculativeGenerator | None = None  # the draft model with adaptive gamma, no lookup fill

    @property
    def hf_draft_model(self):
        """The draft as a transformers module (what hf-assisted gets; same quantisation as ours)."""
        return (self.hf_draft or self.spec).draft.model


@dataclass
class MethodRun:
    tokens: list[int]
    wall_seconds: float
    stats: dict | None = None  # our engine's stats; None for Hugging Face methods
    extra: dict = field(default_factory=dict)  # what a method outside our engine reports (server timings)
    text: str | None = None  # the answer's text, for methods outside our engine (compared with ar's as text)
    token_count: int | None = None  # new tokens where the ids are not known (tokens is then empty)

    @property
    def new_tokens(self) -> int:
        return len(self.tokens) if self.token_count is None else self.token_count


Method = Callable[[BenchContext, list[int], SamplingParams], MethodRun]
METHODS: dict[str, Method] = {}


def register(name: str):
    def wrap(fn: Method) -> Method:
        METHODS[name] = fn
        return fn

    return wrap


def _ours(gen: SpeculativeGenerator, prompt_ids: list[int], params: SamplingParams, ctx: BenchContext) -> MethodRun:
    ctx.sync()
    t0 = time.perf_counter()
    result = gen.generate(prompt_ids, params)
    ctx.sync()
    return MethodRun(result.token_ids, time.perf_counter() - t0, result.stats.to_dict())


def _register_ours(name: str, pick: Callable[[BenchContext], SpeculativeGenerator]) -> None:
    """Our engine under the generator pick(ctx) selects."""
    METHODS[name] = lambda ctx, prompt_ids, params: _ours(pick(ctx), prompt_ids, params, ctx)


_register_ours("ar", lambda ctx: ctx.plain)
_register_ours("draft", lambda ctx: ctx.spec)
# exactly the draft module hf-assisted uses: compares algorithms, not kernels
_register_ours("draft-hf", lambda ctx: ctx.hf_draft or ctx.spec)
_register_ours("hybrid", lambda ctx: ctx.hybrid)
_register_ours("draft-auto", lambda ctx: ctx.auto)
_register_ours("draft-auto-nofill", lambda ctx: ctx.auto_nofill)
_register_ours("ngram", lambda ctx: ctx.ngram)


def run_ar(ctx: BenchContext, prompt_ids: list[int], params: SamplingParams) -> MethodRun:
    return METHODS["ar"](ctx, prompt_ids, params)


def hf_generate_kwargs(ctx: BenchContext, params: SamplingParams) -> dict:
    """transformers ``generate`` settings for these sampling params; seeds its global RNG."""
    kwargs = dict(max_new_tokens=params.max_new_tokens,
                  eos_token_id=params.stopping_ids(ctx.spec.eos_ids),  # [] stops on nothing (None: the model's own)
                  pad_token_id=(ctx.spec.eos_ids or [0])[0])
    if params.greedy:
        kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    else:
        kwargs.update(do_sample=True, temperature=params.temperature, top_k=params.top_k or None, top_p=params.top_p)
        # transformers samples from the global RNG; seeding it is the only way to make its runs repeatable
        torch.manual_seed(params.seed if params.seed is not None else 0)
    return kwargs


def _hf(ctx: BenchContext, prompt_ids: list[int], params: SamplingParams, **extra) -> MethodRun:
    model = ctx.spec.target.model
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    kwargs = hf_generate_kwargs(ctx, params)
    ctx.sync()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs, **extra)
    ctx.sync()
    wall = time.perf_counter() - t0
    tokens = out[0, len(prompt_ids):].tolist()
    return MethodRun(_cut_at_eos(tokens, set(kwargs["eos_token_id"])), wall)


def _cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


@register("hf")
def run_hf(ctx: BenchContext, prompt_ids: list[int], params: SamplingParams) -> MethodRun:
    return _hf(ctx, prompt_ids, params)


@register("hf-assisted")
def run_hf_assisted(ctx: BenchContext, prompt_ids: list[int], params: SamplingParams) -> MethodRun:
    return _hf(ctx, prompt_ids, params, assistant_model=ctx.hf_draft_model)


@register("hf-lookup")
def run_hf_lookup(ctx: BenchContext, prompt_ids: list[int], params: SamplingParams) -> MethodRun:
    return _hf(ctx, prompt_ids, params, prompt_lookup_num_tokens=HF_LOOKUP_TOKENS)


NEEDS_DRAFT = {"draft", "draft-hf", "draft-auto", "draft-auto-nofill", "hybrid", "hf-assisted", "llamacpp-server-spec"}
