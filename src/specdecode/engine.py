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
from collections import deque
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


@dataclass
class BatchRequest:
    """One row of a batch: its prompt, budget, random stream and stats.

    Set ``cancelled`` (for example when a stop string appears) to end the row after the step
    just yielded; its slot is then refilled from the queue."""

    prompt_ids: Sequence[int]
    max_new_tokens: int
    generator: torch.Generator
    stats: GenerationStats = field(default_factory=GenerationStats)
    cancelled: bool = False


@dataclass
class RowStep:
    index: int  # position of the request in the list given to generate_batch
    tokens: list[int]  # its new committed tokens of this step
    finish_reason: str | None  # "stop" (EOS or cancelled), "length" or None while running


@dataclass
class BatchStats:
    batch_size: int = 0  # slots
    new_tokens: int = 0  # over every row
    target_forwards: int = 0  # batched verification passes
    rows_per_forward: float = 0.0  # mean active rows per pass
    wall_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "batch_size": self.batch_size,
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "rows_per_forward": self.rows_per_forward,
            "wall_seconds": self.wall_seconds,
            "tokens_per_second": self.tokens_per_second,
        }


@dataclass
class _Slot:
    index: int
    request: BatchRequest
    context: list[int]  # committed tokens, the pending one last
    started: float
    drafting: bool = True  # the drafter holds this request (false until a deferred start)
    start_after: int = 0  # plain tokens before the drafter starts (policy.start_after)

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - self.request.stats.new_tokens


class SpecEngine:
    """Speculative decoding over a target Runner and an optional Drafter.

    ``generate`` runs one request; ``generate_batch`` runs many in ``batch_size`` slots, each
    row with its own length, draft length, acceptance and random stream (see runners.hf)."""

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
        request = BatchRequest(prompt_ids[0].tolist(), params.max_new_tokens,
                               generator or _seeded_generator(params.seed, self.target.device),
                               stats if stats is not None else GenerationStats())
        for step in self.generate_batch([request], params, eos_ids, batch_size=1):
            yield StepOutput(step.tokens, step.finish_reason)

    def generate_batch(
        self,
        requests: Sequence[BatchRequest],
        params: SamplingParams,
        eos_ids: Sequence[int] = (),
        batch_size: int = 8,
        stats: BatchStats | None = None,
    ) -> Iterator[RowStep]:
        """Decode every request, ``batch_size`` at a time; a finished row's slot takes the next
        request. Yields each row's committed tokens per step. ``params`` supplies the shared
        sampling settings (temperature, top-k, top-p); budgets and random streams are per row."""
        if batch_size < 1:
            raise SpecDecodeError("batch_size must be at least 1", field="batch_size")
        for request in requests:
            if len(request.prompt_ids) < 1:
                raise SpecDecodeError("prompt is empty", field="prompt")
            self.check_fits(len(request.prompt_ids), request.max_new_tokens)
        slots_total = max(1, min(batch_size, len(requests)))
        batched = slots_total > 1
        batch = stats if stats is not None else BatchStats()
        batch.batch_size = slots_total
        gamma = self.config.longest_draft if self.drafter is not None else 0
        eos = set(int(t) for t in eos_ids)
        queue = deque(enumerate(requests))
        slots: list[_Slot | None] = [None] * slots_total
        started = time.perf_counter()
        if batched:
            self.target.reset(slots_total)
            if self.drafter is not None:
                self.drafter.begin_batch(slots_total)

        def admit(slot: int) -> None:
            index, request = queue.popleft()
            t0 = time.perf_counter()
            request.stats.accepted_by_position = [0] * gamma
            request.stats.drafted_by_position = [0] * gamma
            ids = [int(t) for t in request.prompt_ids]
            if batched:
                cache_all_but_last(self.target, [ids], rows=[slot])
            else:
                cache_all_but_last(self.target, torch.tensor([ids]))
            slots[slot] = row = _Slot(index, request, ids, t0, drafting=False)
            if self.drafter is not None:
                row.start_after = self.policy.start_after(len(ids), request.max_new_tokens)
                if row.start_after == 0:
                    start_drafter(slot, row)
            self._sync()
            request.stats.prefill_seconds += time.perf_counter() - t0

        def start_drafter(slot: int, row: _Slot) -> None:
            """The drafter takes the request's committed context (all but the pending token cached)."""
            t0 = time.perf_counter()
            self.drafter.reset([row.context], rows=[slot]) if batched else self.drafter.reset(torch.tensor([row.context]))
            self._sync()
            row.drafting = True
            seconds = time.perf_counter() - t0
            self.policy.started(len(row.context), seconds)
            if row.request.stats.new_tokens:  # a deferred start: the request's prefill is already counted
                row.request.stats.prefill_seconds += seconds

        try:
            for slot in range(slots_total):
                if queue:
                    admit(slot)
            while any(s is not None for s in slots):
                active = [i for i, s in enumerate(slots) if s is not None]
                rows = [slots[i] for i in active]
                for slot, row in zip(active, rows):
                    # (a request with one token left would prefill the draft for nothing)
                    if gamma and not row.drafting and row.request.stats.new_tokens >= row.start_after and row.remaining > 1:
                        start_drafter(slot, row)
                limits = [self.policy.choose(r.remaining) if gamma and r.drafting else 0 for r in rows]
                spent = time.perf_counter()
                draft = self._propose(rows, active if batched else None, limits, params)
                drafted_at = time.perf_counter()
                result = self._verify(rows, active if batched else None, draft, params)
                verified_at = time.perf_counter()
                lengths = draft.row_lengths()
                self._commit(rows, active, draft, result, batched)
                batch.target_forwards += 1
                batch.rows_per_forward += (len(rows) - batch.rows_per_forward) / batch.target_forwards
                share = 1.0 / len(rows)
                for j, (slot, row) in enumerate(zip(active, rows)):
                    accepted = int(result.num_accepted[j])
                    row.request.stats.draft_seconds += (drafted_at - spent) * share
                    row.request.stats.verify_seconds += (verified_at - drafted_at) * share
                    self.policy.update(lengths[j], accepted, (drafted_at - spent) * share, (verified_at - drafted_at) * share)
                    new_tokens = [int(t) for t in draft.tokens[j, :accepted]] + [int(result.next_tokens[j])]
                    row.context.extend(new_tokens)
                    new_tokens, finish = _stop_check(new_tokens, eos, row.remaining)
                    row.request.stats.new_tokens += len(new_tokens)
                    row.request.stats.wall_seconds = time.perf_counter() - row.started
                    batch.new_tokens += len(new_tokens)
                    batch.wall_seconds = time.perf_counter() - started
                    if finish is not None:  # (before the yield: a consumer may stop at the last step)
                        self.policy.finished(row.request.stats.new_tokens)
                    yield RowStep(row.index, new_tokens, finish)
                    if finish is None and row.request.cancelled:
                        finish = "stop"
                    if finish is not None:
                        slots[slot] = None
                        if queue:
                            admit(slot)
        finally:
            batch.wall_seconds = time.perf_counter() - started
            for row in slots:
                if row is not None:
                    row.request.stats.wall_seconds = time.perf_counter() - row.started

    def check_fits(self, prompt_length: int, max_new_tokens: int) -> None:
        limit = self.target.max_context
        if prompt_length + max_new_tokens > limit:
            raise SpecDecodeError(
                f"prompt of {prompt_length} tokens plus max_new_tokens={max_new_tokens} exceeds "
                f"the target's context of {limit} tokens",
                field="max_new_tokens" if prompt_length < limit else "prompt",
            )

    # -- phases ---------------------------------------------------------------------------
    # 0. admit: cache every prompt token but the last (the first pending token), see above.

    def _propose(self, rows: list[_Slot], slots: list[int] | None, limits: list[int], params) -> Draft:
        """1. The drafter proposes up to limits[j] tokens for row j."""
        if self.drafter is None or max(limits) <= 0:
            return Draft(torch.empty((len(rows), 0), dtype=torch.long), None)
        held = [j for j, r in enumerate(rows) if r.drafting]  # rows whose drafter has started
        contexts = [rows[j].context for j in held]
        draft = self.drafter.propose(contexts if slots is not None else torch.tensor(contexts), [limits[j] for j in held],
                                     params, [rows[j].request.generator for j in held],
                                     rows=None if slots is None else [slots[j] for j in held],
                                     min_confidence=self.config.stop_confidence)
        self._sync()
        return draft if len(held) == len(rows) else _spread(draft, held, len(rows))

    def _verify(self, rows: list[_Slot], slots: list[int] | None, draft: Draft, params) -> VerifyResult:
        """2. One target pass over each row's [pending, drafts...] scores every draft and the bonus."""
        lengths = draft.row_lengths()
        block = torch.cat([torch.tensor([[r.context[-1]] for r in rows]), draft.tokens.cpu()], dim=1)  # [n, k'+1]
        if slots is None:
            target_logits = self.target.forward(block)  # [1, k'+1, V]
        else:
            target_logits = self.target.forward(block, rows=slots, counts=[1 + n for n in lengths])
        extra = {} if draft.lengths is None else {"draft_lengths": lengths}
        result = self.verifier(draft.tokens.to(target_logits.device), draft.probs, target_logits, params,
                               [r.request.generator for r in rows], **extra)
        self._sync()
        return result

    def _commit(self, rows: list[_Slot], slots: list[int], draft: Draft, result: VerifyResult, batched: bool) -> None:
        """3. Keep each row's accepted drafts plus one target token; roll both caches back to them."""
        lengths = self.target.lengths.clone()
        for j, (slot, row) in enumerate(zip(slots, rows)):
            n = int(result.num_accepted[j])
            row.request.stats.record_step(draft.row_lengths()[j], n)
            # the cache holds: committed (without pending) + pending + drafts; keep pending + n accepted
            lengths[slot] = len(row.context) + n
        self.target.truncate(lengths)
        if self.drafter is not None and draft.tokens.shape[1] > 0:
            held = [j for j, r in enumerate(rows) if r.drafting]
            self.drafter.commit(result.num_accepted[held], rows=[slots[j] for j in held] if batched else None)


def _spread(draft: Draft, held: list[int], n: int) -> Draft:
    """A draft over rows ``held`` of n -> a draft over all n; the other rows propose nothing."""
    width = draft.tokens.shape[1]
    tokens = torch.zeros((n, width), dtype=torch.long)
    tokens[held] = draft.tokens
    probs = None
    if draft.probs is not None:
        probs = draft.probs.new_zeros((n,) + tuple(draft.probs.shape[1:]))
        probs[held] = draft.probs
    lengths = [0] * n
    for j, length in zip(held, draft.row_lengths()):
        lengths[j] = length
    return Draft(tokens, probs, lengths)


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
