"""The Python API: load a pair once, generate many times.

Glossary: a *generator* here owns a loaded target, an optional draft, their runners and the
engine; one request runs at a time on it (runners hold the KV caches). *Plain decoding* is the
same generator with no draft.

    gen = SpeculativeGenerator.from_pretrained("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
    out = gen.generate("def fib(n):", max_new_tokens=64)
    print(out.text, out.stats.tokens_per_target_forward)
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Iterator, Sequence

import torch

from . import models, packs
from .config import (DEFAULT_DRAFT_PREFILL, DEFAULT_DRAFT_QUANT, DEFAULT_DRAFT_VOCAB, SamplingParams, SpecConfig,
                     check_draft_prefill, check_draft_quant)
from .drafters import make_drafter
from .engine import Request, SpecEngine
from .errors import SpecDecodeError
from .sampling import seeded_generator
from .results import BatchResult, GenerationResult, GenerationStream, StreamChunk, chunk_of_step
from .stats import BatchStats
from .text import TextStream

HEAD_PREFIX = "head:"  # a draft reference naming a head file: head:PATH


class SpeculativeGenerator:
    def __init__(
        self,
        target: models.LoadedModel,
        draft: models.LoadedModel | None = None,
        gamma: int | str = 5,
        drafter: str | None = None,
        draft_confidence: float | None = None,
        runners: tuple | None = None,
        head: str | None = None,
        lookup_fill: bool = True,
    ):
        """runners: (target runner, draft runner) to share with another generator (see ``variant``).
        drafter: "model" (the draft model; the default when one is given), "ngram", "hybrid"
        (n-gram lookup when it finds a continuation, else the draft model), "head" (the draft
        head file at ``head``, made by ``specdecode train-head`` for this target) or None (plain).
        gamma: tokens drafted per step, or "auto" for the adaptive policy.
        draft_confidence: stop a draft after a token the draft model gave less than this
        probability; None: 0.7 with gamma "auto", off with a fixed gamma (config.SpecConfig).
        lookup_fill: with gamma "auto" and the draft model, a prompt lookup of 3+ tokens drafts
        instead of the model, and steps the policy makes plain draft any lookup (the engine's
        lookup fill)."""
        self.target = target
        self.draft = draft
        self.spec_config = SpecConfig(gamma=gamma, draft_confidence=draft_confidence, lookup_fill=lookup_fill)
        self.tokenizer = target.tokenizer
        self.eos_ids = models.eos_token_ids(target)
        if target.runner == "llamacpp":
            raise SpecDecodeError("the llamacpp runner may only run drafts", field="runner")
        self.target_runner, self._draft_runner = runners or (target.make_runner(), None)
        kind = drafter or ("model" if draft is not None else None)
        if kind in ("model", "hybrid") and draft is not None:
            if not models.same_vocabulary(target.tokenizer, draft.tokenizer):
                raise SpecDecodeError(
                    f"draft '{draft.name}' and target '{target.name}' have different vocabularies; "
                    "speculative decoding needs the same tokenizer"
                )
            self._draft_runner = self._draft_runner or draft.make_runner()
        self.head = head
        self.drafter = make_drafter(kind, self.target_runner.vocab_size,
                                    self._draft_runner if kind in ("model", "hybrid") else None,
                                    head=head, target_model=target.model if kind == "head" else None)
        self.drafter_kind = kind
        self._sync = torch.cuda.synchronize if self.target_runner.device.type == "cuda" else None
        self.engine = self._engine(self.spec_config)
        self._engines: dict[SpecConfig, SpecEngine] = {}  # per-request gammas (stream)

    @classmethod
    def from_pretrained(
        cls,
        target: str = packs.DEFAULT_TARGET,
        draft: str | None = packs.DEFAULT_DRAFT,
        *,
        gamma: int | str = 5,
        drafter: str | None = None,
        draft_confidence: float | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        runner: str = "auto",
        draft_runner: str = "auto",
        draft_vocab: int | None = DEFAULT_DRAFT_VOCAB,
        draft_quant: str = DEFAULT_DRAFT_QUANT,
        draft_prefill: str = DEFAULT_DRAFT_PREFILL,
        progress: bool = True,
    ) -> "SpeculativeGenerator":
        """runner / draft_runner: auto, hf (transformers as loaded), int8 (fast batch-invariant CPU
        path) or llamacpp (drafts only). auto picks int8 / llama.cpp on CPU in float32.
        draft_vocab: token ids a llama.cpp draft scores (the lowest ones plus control tokens;
        None: all); the output is unchanged either way, only the draft's cost and acceptance move.
        draft_quant: the weights a llama.cpp draft runs ('source', or a cached copy llama.cpp
        requantizes: 'q4_0', 'q8_0'); again only cost and acceptance move.
        draft_prefill: where a llama.cpp draft prefills prompts: 'int8' (the same model on the
        int8 path, its keys and values copied into llama.cpp; loads that model too) or 'llamacpp'."""
        check_draft_quant(draft_quant)
        check_draft_prefill(draft_prefill)
        if draft_vocab is not None and (isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int) or draft_vocab < 1):
            raise SpecDecodeError(f"draft_vocab must be a positive number of token ids or None, got {draft_vocab!r}",
                                  field="draft_vocab")
        SpecConfig(gamma=gamma, draft_confidence=draft_confidence)  # validate before the slow part
        torch_device, torch_dtype = models.parse_device(device), models.parse_dtype(dtype)
        models.check_reference(target, runner, "target")
        if draft is not None and draft.lower() not in ("none", "ngram") and not draft.startswith(HEAD_PREFIX):
            models.check_reference(draft, draft_runner, "draft")
        loaded_target = models.load(target, torch_device, torch_dtype, progress, runner, "target")
        loaded_draft, kind, head = None, drafter, None
        if draft is not None and draft.lower() == "ngram":
            kind = "ngram"
        elif draft is not None and draft.startswith(HEAD_PREFIX):
            kind, head = "head", draft[len(HEAD_PREFIX):]
        elif draft is not None and draft.lower() != "none":
            loaded_draft = models.load(draft, torch_device, torch_dtype, progress, draft_runner, "draft", draft_vocab,
                                       draft_quant, draft_prefill)
        return cls(loaded_target, loaded_draft, gamma=gamma, drafter=kind, draft_confidence=draft_confidence, head=head)

    def variant(self, drafter: str | None, gamma: int | str | None = None, draft_confidence: float | None = None,
                lookup_fill: bool | None = None):
        """Another generator over the same loaded models and runners (one request at a time across both)."""
        return SpeculativeGenerator(
            self.target, self.draft if drafter in ("model", "hybrid") else None,
            gamma=self.spec_config.gamma if gamma is None else gamma, drafter=drafter,
            draft_confidence=self.spec_config.draft_confidence if draft_confidence is None else draft_confidence,
            runners=(self.target_runner, self._draft_runner), head=self.head if drafter == "head" else None,
            lookup_fill=self.spec_config.lookup_fill if lookup_fill is None else lookup_fill,
        )

    def _engine(self, config: SpecConfig) -> SpecEngine:
        return SpecEngine(self.target_runner, self.drafter, config, sync=self._sync)

    def engine_for(self, gamma: int | str | None) -> SpecEngine:
        """The engine of a per-request gamma (None: the generator's own), kept so an adaptive
        one's estimates carry over."""
        if gamma is None:
            return self.engine
        config = SpecConfig(gamma=gamma, draft_confidence=self.spec_config.draft_confidence,
                            lookup_fill=self.spec_config.lookup_fill)
        if config == self.spec_config:
            return self.engine
        if config not in self._engines:
            self._engines[config] = self._engine(config)
        return self._engines[config]

    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """A one-line SpecDecodeError when a prompt of this length and budget exceed the context."""
        self.engine.check_fits(prompt_tokens, max_new_tokens)

    def encode(self, prompt: str | Sequence[int] | Sequence[dict], chat: bool = False) -> list[int]:
        """Token ids of a prompt: text, token ids, or with ``chat`` a user message (text) or a
        list of chat messages (``{"role", "content"}``) put through the model's chat template."""
        if chat:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            try:
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception as exc:  # no template, or one that rejects these messages (jinja raises its own)
                raise SpecDecodeError(f"the chat template rejects these messages: {exc}", field="messages") from None
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise SpecDecodeError("prompt is empty", field="prompt")
        if any(t < 0 or t >= self.target_runner.vocab_size for t in ids):
            raise SpecDecodeError("prompt has token ids outside the vocabulary", field="prompt")
        return ids

    def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        chat: bool = False,
        gamma: int | str | None = None,
        **sampling,
    ) -> GenerationStream:
        """Start a request; iterate the returned stream for text as it is committed."""
        params = params or SamplingParams(**_stop_tuple(sampling))
        engine = self.engine_for(gamma)
        prompt_ids = self.encode(prompt, chat)
        engine.check_fits(len(prompt_ids), params.max_new_tokens)
        stream = GenerationStream(iter(()))
        stream._chunks = self._chunks(engine, prompt_ids, params, stream)
        return stream

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, **kwargs) -> GenerationResult:
        stream = self.stream(prompt, params, **kwargs)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def generate_batch(
        self,
        prompts: Sequence[str | Sequence[int] | dict],
        params: SamplingParams | None = None,
        *,
        batch_size: int = 8,
        chat: bool = False,
        **sampling,
    ) -> BatchResult:
        """Decode many prompts, ``batch_size`` rows at a time (finished rows are refilled).

        A prompt is text, token ids, or a dict with ``prompt`` and optional ``max_new_tokens``
        and ``seed``. Sampling settings are shared; a row without its own seed gets
        ``params.seed + its index`` (random when params.seed is None). A row gives the same
        tokens alone or in any batch for the same seed (fixed gamma, batch-invariant runners)."""
        params = params or SamplingParams(**_stop_tuple(sampling))
        if batch_size > self.target_runner.max_batch:
            raise SpecDecodeError("the target runner decodes one row at a time", field="batch_size")
        if self._draft_runner is not None and batch_size > self._draft_runner.max_batch:
            raise SpecDecodeError("the draft runner decodes one row at a time; batches need --draft-runner int8 or hf",
                                  field="batch_size")
        rows, texts = [], []
        for i, item in enumerate(prompts):
            spec = item if isinstance(item, dict) else {"prompt": item}
            if "prompt" not in spec:
                raise SpecDecodeError(f"prompt {i}: missing 'prompt'", field="prompt")
            row_params = replace(
                params, max_new_tokens=spec.get("max_new_tokens", params.max_new_tokens),
                seed=spec.get("seed", None if params.seed is None else params.seed + i),
            )
            ids = self.encode(spec["prompt"], chat)
            self.engine.check_fits(len(ids), row_params.max_new_tokens)
            generator = seeded_generator(row_params.seed, self.target_runner.device)
            rows.append(Request(ids, row_params.max_new_tokens, generator))
            texts.append(TextStream(self.tokenizer, ids, params.stop))
        stats = BatchStats()
        finish: list[str | None] = [None] * len(rows)
        for step in self.engine.generate(rows, params, params.stopping_ids(self.eos_ids), batch_size=batch_size, stats=stats):
            row = rows[step.index]
            chunk = chunk_of_step(texts[step.index], row.stats, step)
            stats.new_tokens -= len(step.tokens) - len(chunk.token_ids)
            finish[step.index] = chunk.finish_reason
            row.cancelled = chunk.finish_reason is not None
        results = [GenerationResult(t.text, list(t.token_ids), f or "length", len(r.prompt_ids), r.stats)
                   for t, r, f in zip(texts, rows, finish)]
        return BatchResult(results, stats)

    def _chunks(self, engine, prompt_ids, params, stream: GenerationStream) -> Iterator[StreamChunk]:
        request = Request(prompt_ids, params.max_new_tokens, seeded_generator(params.seed, self.target_runner.device))
        stats = request.stats
        text = TextStream(self.tokenizer, prompt_ids, params.stop)
        steps = engine.generate([request], params, params.stopping_ids(self.eos_ids), batch_size=1)
        finish = "length"
        t0 = time.perf_counter()
        try:
            for step in steps:
                chunk = chunk_of_step(text, stats, step)
                if chunk.finish_reason is not None:
                    finish = chunk.finish_reason
                    yield chunk
                    return
                if chunk.text or chunk.token_ids:
                    yield chunk
        finally:
            steps.close()
            stats.wall_seconds = time.perf_counter() - t0
            stream.result = GenerationResult(text.text, list(text.token_ids), finish, len(prompt_ids), stats)


def _stop_tuple(sampling: dict) -> dict:
    stop = sampling.get("stop")
    if stop is None:
        sampling.pop("stop", None)
    elif isinstance(stop, str):
        sampling["stop"] = (stop,)
    else:
        sampling["stop"] = tuple(stop)
    return sampling

