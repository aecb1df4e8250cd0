"""The decode loop: propose -> verify -> commit/rollback -> stop check -> stream.

Glossary:
- *committed tokens*: the prompt plus every generated token kept so far.
- *pending token*: the last committed token. The target's cache holds every committed token
  but this one; each step feeds it together with the draft, so a step of k drafted tokens is
  one target pass over k + 1 positions, whose logits score the k drafts and the bonus.
- *accepted / rejected / bonus / residual*: see ``specdecode.verify``.
- *target forward*: one verification pass (the prompt prefill is counted apart).

With no drafter every step drafts nothing and the same loop is plain autoregressive decoding,
so a speedup always compares like with like.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from .config import SamplingParams, SpecConfig
from .drafters import Draft, Drafter
from .errors import SpecDecodeError
from .policy import AdaptiveGamma, FixedGamma
from .runners import Runner, cache_all_but_last
from .verify import VerifyResult, verify

Verifier = Callable[..., VerifyResult]


@dataclass
class GenerationStats:
    new_tokens: int = 0
    target_forwards: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_by_position: list[int] = field(default_factory=list)  # [gamma]: accepted at draft position i
    drafted_by_position: list[int] = field(default_factory=list)  # [gamma]: drafted at draft position i
    accepted_per_step: list[int] = field(default_factory=list)  # accepted drafts of each target forward
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    wall_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_target_forward": self.tokens_per_target_forward,
            "accepted_by_position": list(self.accepted_by_position),
            "drafted_by_position": list(self.drafted_by_position),
            "prefill_seconds": self.prefill_seconds,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "wall_seconds": self.wall_seconds,
            "tokens_per_second": self.tokens_per_second,
        }

    def record_step(self, drafted: int, accepted: int) -> None:
        self.target_forwards += 1
        self.accepted_per_step.append(accepted)
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        for i in range(drafted):
            self.drafted_by_position[i] += 1
            self.accepted_by_position[i] += int(i < accepted)


@dataclass
class StepOutput:
    tokens: list[int]  # the new committed tokens of this step (row 0)
    finish_reason: str | None  # "stop" (EOS), "length" (max_new_tokens) or None while running


class SpecEngine:
    """Speculative decoding over a target Runner and an optional Drafter (B = 1 per request)."""

    def __init__(
        self,
        target: Runner,
        drafter: Drafter | None,
        config: SpecConfig,
        verifier: Verifier = verify,
        sync: Callable[[], None] | None = None,
    ):
        if drafter is not None and drafter.vocab_size != target.vocab_size:
            raise SpecDecodeError(
                f"draft and target vocabularies differ ({drafter.vocab_size} vs {target.vocab_size} logits)"
            )
        self.target = target
        self.drafter = drafter
        self.config = config
        self.verifier = verifier
        self._sync = sync or (lambda: None)
        self.policy = AdaptiveGamma(max_gamma=config.max_gamma) if config.adaptive else FixedGamma(int(config.gamma))

    def generate(
        self,
        prompt_ids: torch.Tensor,  # [1, T]
        params: SamplingParams,
        eos_ids: Sequence[int] = (),
        generator: torch.Generator | None = None,
        stats: GenerationStats | None = None,
    ) -> Iterator[StepOutput]:
        """Yield the committed tokens of each step until EOS or max_new_tokens."""
        if prompt_ids.ndim != 2 or prompt_ids.shape[0] != 1 or prompt_ids.shape[1] < 1:
            raise ValueError("prompt_ids must have shape [1, T] with T >= 1")
        self.check_fits(prompt_ids.shape[1], params.max_new_tokens)
        stats = stats if stats is not None else GenerationStats()
        gamma = self.config.longest_draft if self.drafter is not None else 0
        stats.accepted_by_position = [0] * gamma
        stats.drafted_by_position = [0] * gamma
        generators = [generator or _seeded_generator(params.seed, self.target.device)]
        eos = set(int(t) for t in eos_ids)
        started = time.perf_counter()
        context = prompt_ids.to(torch.long).cpu()  # [1, L] committed tokens
        self._prefill(context, stats)
        try:
            while True:
                remaining = params.max_new_tokens - stats.new_tokens
                k = self.policy.choose(remaining) if gamma else 0
                spent = (stats.draft_seconds, stats.verify_seconds)
                draft = self._propose(context, k, params, generators, stats)
                result = self._verify(context, draft, params, generators, stats)
                new_tokens = self._commit(context, draft, result, stats)
                self.policy.update(draft.tokens.shape[1], int(result.num_accepted[0]),
                              stats.draft_seconds - spent[0], stats.verify_seconds - spent[1])
                context = torch.cat([context, torch.tensor([new_tokens])], dim=1)
                new_tokens, finish = _stop_check(new_tokens, eos, remaining)
                stats.new_tokens += len(new_tokens)
                stats.wall_seconds = time.perf_counter() - started
                yield StepOutput(new_tokens, finish)
                if finish is not None:
                    return
        finally:
            stats.wall_seconds = time.perf_counter() - started

    def check_fits(self, prompt_length: int, max_new_tokens: int) -> None:
        limit = self.target.max_context
        if prompt_length + max_new_tokens > limit:
            raise SpecDecodeError(
                f"prompt of {prompt_length} tokens plus max_new_tokens={max_new_tokens} exceeds "
                f"the target's context of {limit} tokens",
                field="max_new_tokens" if prompt_length < limit else "prompt",
            )

    # -- phases ---------------------------------------------------------------------------

    def _prefill(self, context: torch.Tensor, stats: GenerationStats) -> None:
        """0. Cache every prompt token but the last (the first pending token)."""
        t0 = time.perf_counter()
        cache_all_but_last(self.target, context)
        if self.drafter is not None:
            self.drafter.reset(context)
        self._sync()
        stats.prefill_seconds += time.perf_counter() - t0

    def _propose(self, context, k, params, generators, stats) -> Draft:
        """1. The drafter proposes up to k tokens."""
        if k <= 0 or self.drafter is None:
            return Draft(torch.empty((1, 0), dtype=torch.long), None)
        t0 = time.perf_counter()
        draft = self.drafter.propose(context, k, params, generators)
        self._sync()
        stats.draft_seconds += time.perf_counter() - t0
        return draft

    def _verify(self, context, draft: Draft, params, generators, stats) -> VerifyResult:
        """2. One target pass over [pending, drafts...] scores every draft and the bonus."""
        t0 = time.perf_counter()
        block = torch.cat([context[:, -1:], draft.tokens.cpu()], dim=1)  # [1, k'+1]
        target_logits = self.target.forward(block)  # [1, k'+1, V]
        result = self.verifier(draft.tokens.to(target_logits.device), draft.probs, target_logits, params, generators)
        self._sync()
        stats.verify_seconds += time.perf_counter() - t0
        return result

    def _commit(self, context, draft: Draft, result: VerifyResult, stats) -> list[int]:
        """3. Keep the accepted drafts plus one target token; roll both caches back to them."""
        n = int(result.num_accepted[0])
        stats.record_step(draft.tokens.shape[1], n)
        # cache now holds: committed (without pending) + pending + drafts; keep pending + n accepted
        self.target.truncate(torch.tensor([context.shape[1] + n]))
        if self.drafter is not None and draft.tokens.shape[1] > 0:
            self.drafter.commit(result.num_accepted)
        return [int(t) for t in draft.tokens[0, :n]] + [int(result.next_tokens[0])]


def _stop_check(tokens: list[int], eos: set[int], remaining: int) -> tuple[list[int], str | None]:
    """4. Cut a step's tokens at the first EOS (kept) or at the token budget."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1], "stop"
    if len(tokens) >= remaining:
        return tokens[:remaining], "length"
    return tokens, None


def _seeded_generator(seed: int | None, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
