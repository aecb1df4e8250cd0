"""The decode loop: propose -> verify -> commit/rollback -> stop check -> emit.

Glossary:
- *committed tokens*: the prompt plus every generated token kept so far.
- *pending token*: the last committed token. The target's cache holds every committed token
  but this one; each step feeds it together with the draft, so a step of k drafted tokens is
  one target pass over k + 1 positions, whose logits score the k drafts and the bonus.
- *accepted / rejected / bonus / residual*: see ``specdecode.verify``.
- *slot*: a row of the runners' caches. A ``Batch`` holds requests in its slots: one joins a free
  slot between steps (``add``) and leaves at the end of the step in which it ends. ``generate``
  runs a list of requests through a batch, refilling freed slots from its queue; the server's
  scheduler feeds one as requests arrive. One request is a batch of one on the same path: every
  call to a drafter or runner names its slots.
- *sampling group*: the rows of a step drawn with the same temperature, top-k and top-p; each
  group is drafted and verified with its own settings, all in the one target pass.
- *features*: with a drafter that reads the target's hidden states (a draft head), every
  target pass also returns them, and each row's committed ones go to the drafter
  (``drafters.base``), whether or not the row drafts yet.
- *drafting row*: a request whose drafter has started (the policy may defer a start). At most
  one deferred drafter starts a step.
- *admission first*: under a policy that follows the load (the adaptive one), a request that
  joins a busy batch (rows running or requests waiting) gets its first token as it joins, from
  a plain step of its row alone right after its prefill, and starts its drafter after that
  token; no deferred drafter starts in a step after which another request joins. A request's
  first token then waits for target prefills and one-row passes, not for the batch's steps or
  other requests' draft prefills. A fixed policy ignores all of this, so its rows draft, and
  its seeded rows sample, the same way in any batch.
- *lookup fill*: under the adaptive policy with a draft model, the engine also looks each row's
  context up (``drafters.ngram``) up to the length the policy finds best for drafts that cost
  nothing (``policy.adaptive``). A row drafts its lookup instead of the model where the lookup
  found at least ``LOOKUP_FIRST`` tokens (or as many as the length allows), and on a step the
  policy makes plain (no model draft pays, or none has started) wherever it found any; the other
  rows draft with the model as the policy chose. Lookup proposals are deterministic, so
  verification stays exact; the model's estimates learn only from the model's rows.

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
from .drafters.base import feature_layers, spread
from .drafters.model import ModelDrafter
from .drafters.ngram import NgramDrafter
from .errors import SpecDecodeError
from .policy import AdaptiveGamma, FixedGamma
from .runners import Runner, cache_all_but_last
from .stats import BatchStats, GenerationStats
from .verify import VerifyResult, verify

LOOKUP_FIRST = 3  # a lookup of this many tokens drafts instead of the model (glossary: lookup fill)

Verifier = Callable[..., VerifyResult]


@dataclass
class Request:
    """One request: its prompt, budget, random stream and stats.

    Set ``cancelled`` (for example when a stop string appears) to end it after the step just
    yielded; its slot is then refilled from the queue."""

    prompt_ids: Sequence[int]
    max_new_tokens: int
    generator: torch.Generator
    stats: GenerationStats = field(default_factory=GenerationStats)
    cancelled: bool = False
    params: SamplingParams | None = None  # its own sampling settings (None: the batch's)
    eos_ids: Sequence[int] | None = None  # its own end tokens (None: the batch's)


@dataclass
class RowStep:
    index: int  # the request's id: its position in the list given to generate, or the one given to Batch.add
    tokens: list[int]  # its new committed tokens of this step
    finish_reason: str | None  # "stop" (EOS or cancelled), "length" or None while running


@dataclass
class _Row:
    slot: int
    index: int
    request: Request
    context: list[int]  # committed tokens, the pending one last
    started: float
    params: SamplingParams
    eos: set[int]
    drafting: bool = False  # the drafter holds this request
    start_after: int = 0  # plain tokens before the drafter starts (policy.start_after)

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - self.request.stats.new_tokens


class SpecEngine:
    """Speculative decoding over a target Runner and an optional Drafter, for ragged batches of
    requests, each row with its own length, draft length, acceptance and random stream."""

    def __init__(self, target: Runner, drafter: Drafter | None, config: SpecConfig, verifier: Verifier = verify,
                 sync: Callable[[], None] | None = None):
        if drafter is not None and drafter.vocab_size != target.vocab_size:
            raise SpecDecodeError(
                f"draft and target vocabularies differ ({drafter.vocab_size} vs {target.vocab_size} logits)"
            )
        self.target = target
        self.drafter = drafter
        self.feature_layers = feature_layers(drafter)  # what the drafter reads of the target's states (None: nothing)
        self.config = config
        self.verifier = verifier
        self._sync = sync or (lambda: None)
        self.policy = AdaptiveGamma(max_gamma=config.max_gamma) if config.adaptive else FixedGamma(int(config.gamma))
        # glossary: lookup fill
        fills = config.adaptive and config.lookup_fill and isinstance(drafter, ModelDrafter)
        self.lookup = NgramDrafter(target.vocab_size) if fills else None
        self.last_draft_length = 0  # the draft length the policy chose for the last step

    def check_fits(self, prompt_length: int, max_new_tokens: int) -> None:
        limit = self.target.max_context
        if prompt_length + max_new_tokens > limit:
            raise SpecDecodeError(
                f"prompt of {prompt_length} tokens plus max_new_tokens={max_new_tokens} exceeds "
                f"the target's context of {limit} tokens",
                field="max_new_tokens" if prompt_length < limit else "prompt",
            )

    def batch(self, slots: int, params: SamplingParams, eos_ids: Sequence[int] = (),
              stats: BatchStats | None = None) -> "Batch":
        """An empty running batch of ``slots`` rows; ``params`` and ``eos_ids`` serve requests
        that bring none of their own. It resets the runners: one batch runs on them at a time."""
        if slots < 1 or slots > self.max_batch:
            raise SpecDecodeError(f"a batch takes 1..{self.max_batch} rows here, got {slots}", field="batch_size")
        return Batch(self, slots, params, eos_ids, stats if stats is not None else BatchStats())

    @property
    def max_batch(self) -> int:
        """The most rows the runners decode together."""
        return min(self.target.max_batch, self.drafter.max_batch if self.drafter is not None else self.target.max_batch)

    def check_request(self, request: Request) -> None:
        if len(request.prompt_ids) < 1:
            raise SpecDecodeError("prompt is empty", field="prompt")
        self.check_fits(len(request.prompt_ids), request.max_new_tokens)

    def generate(self, requests: Sequence[Request], params: SamplingParams, eos_ids: Sequence[int] = (),
                 batch_size: int = 8, stats: BatchStats | None = None) -> Iterator[RowStep]:
        """Decode every request, ``batch_size`` at a time; yield each row's committed tokens per
        step until EOS, its budget or cancellation. ``params`` and ``eos_ids`` apply to the
        requests that bring none of their own; budgets and random streams are per request."""
        if batch_size < 1:
            raise SpecDecodeError("batch_size must be at least 1", field="batch_size")
        for request in requests:
            self.check_request(request)
        batch = self.batch(max(1, min(batch_size, len(requests))), params, eos_ids, stats)
        queue = deque(enumerate(requests))
        try:
            while queue or batch.active:
                while queue and batch.free_slots():
                    batch.add(*queue.popleft())
                yield from batch.step()
        finally:
            batch.close()

    def _step(self, rows: list[_Row], hold_drafters: bool = False) -> Iterator[tuple[_Row, RowStep]]:
        """One engine step over the active rows, in numbered phases; hold_drafters: see Batch.step."""
        # 1. plan: start the first deferred drafter whose time has come (one a step, so no step
        # pays for several draft prefills); one draft length for the step. A request with one
        # token left would prefill the draft for nothing, and so would one in a batch of a size
        # at which the policy has found that drafting does not pay.
        held_back = hold_drafters and self.policy.follows_load
        if self.drafter is not None and not held_back and self.policy.drafts_at(len(rows)):
            due = [row for row in rows
                   if not row.drafting and row.request.stats.new_tokens >= row.start_after and row.remaining > 1]
            if due:
                self._start_drafter(due[0])
        drafting = [r for r in rows if r.drafting]
        k = self.policy.choose([r.remaining for r in drafting], rows=len(rows)) if drafting else 0
        self.last_draft_length = k
        limits = [min(k, r.remaining - 1) if r.drafting else 0 for r in rows]
        t0 = time.perf_counter()
        looked_up = self._look_up(rows, limits, k) if self.lookup is not None else None  # glossary: lookup fill
        if looked_up is not None:
            limits = [0 if j in looked_up[1] else limit for j, limit in enumerate(limits)]
        held = [j for j, limit in enumerate(limits) if limit > 0]  # the rows the drafter drafts
        # 2. propose, one call per group of rows sampled alike
        groups = _sampling_groups(rows)
        drafts = [self._propose([rows[j] for j in group], [limits[j] for j in group]) for group in groups]
        if looked_up is not None and looked_up[1]:
            drafts = [_with_lookups(d, group, *looked_up, self.target.vocab_size) for d, group in zip(drafts, groups)]
        draft = _joined(drafts, groups, len(rows))
        t1 = time.perf_counter()
        # 3. verify: one target pass over each row's [pending, drafts...]
        result, states = self._verify(rows, groups, drafts, draft)
        t2 = time.perf_counter()
        # 4. commit / rollback both caches to each row's pending + accepted tokens
        self._commit(rows, held, result, states)
        accepted = [int(n) for n in result.num_accepted]
        self.policy.observe(draft.lengths, accepted, t1 - t0, t2 - t1,
                            lookups=looked_up[1] if looked_up is not None else ())
        # 5. stop check and emit, row by row
        share = 1.0 / len(rows)
        for j, row in enumerate(rows):
            stats = row.request.stats
            stats.draft_seconds += (t1 - t0) * share
            stats.verify_seconds += (t2 - t1) * share
            stats.record_step(draft.lengths[j], accepted[j])
            new_tokens = [int(t) for t in draft.tokens[j, : accepted[j]]] + [int(result.next_tokens[j])]
            row.context.extend(new_tokens)
            new_tokens, finish = _stop_check(new_tokens, row.eos, row.remaining)
            stats.new_tokens += len(new_tokens)
            stats.wall_seconds = time.perf_counter() - row.started
            if finish is not None:  # (before the yield: a consumer may stop at the last step)
                self.policy.finished(stats.new_tokens)
            yield row, RowStep(row.index, new_tokens, finish)

    def _admit(self, slot: int, index: int, request: Request, params: SamplingParams, eos: set[int], rows: int,
               defer_draft: bool = False) -> _Row:
        """Cache every prompt token but the last (the first pending token) in ``slot``; ``rows``:
        the batch's rows with this one; defer_draft: see Batch.add."""
        t0 = time.perf_counter()
        gamma = self.config.longest_draft if self.drafter is not None else 0
        request.stats.accepted_by_position = [0] * gamma
        request.stats.drafted_by_position = [0] * gamma
        ids = [int(t) for t in request.prompt_ids]
        states = cache_all_but_last(self.target, [ids], rows=[slot], return_hidden=self.feature_layers)
        if self.feature_layers is not None:
            self.drafter.take_features([slot], [0], states)
        row = _Row(slot, index, request, ids, t0, params, eos)
        if self.lookup is not None:
            self.lookup.start([slot], [ids])
        if self.drafter is not None:
            row.start_after = self.policy.start_after(len(ids), request.max_new_tokens)
            if defer_draft and self.policy.follows_load:
                row.start_after = max(row.start_after, 1)
            if row.start_after == 0 and self.policy.drafts_at(rows):
                self._start_drafter(row)
        self._sync()
        request.stats.prefill_seconds += time.perf_counter() - t0
        return row

    def _start_drafter(self, row: _Row) -> None:
        """The drafter takes the request's committed context (all but the pending token cached)."""
        t0 = time.perf_counter()
        self.drafter.start([row.slot], [row.context])
        self._sync()
        row.drafting = True
        seconds = time.perf_counter() - t0
        self.policy.started(len(row.context), seconds)
        if row.request.stats.new_tokens:  # a deferred start: the request's prefill is already counted
            row.request.stats.prefill_seconds += seconds

    def _look_up(self, rows: list[_Row], limits: list[int], k: int) -> tuple[Draft, set[int]] | None:
        """(every row's lookup, the rows that draft it) for a step whose model draft length is
        k (glossary: lookup fill); None when no lookup is worth its pass."""
        length = self.policy.lookup_length([r.remaining for r in rows], rows=len(rows))
        if length == 0:
            return None
        caps = [min(length, r.remaining - 1) for r in rows]
        found = self.lookup.propose([r.slot for r in rows], [r.context for r in rows], caps, rows[0].params,
                                    [r.request.generator for r in rows])
        chosen = {j for j, n in enumerate(found.lengths)
                  if n > 0 and (limits[j] == 0 or n >= min(caps[j], LOOKUP_FIRST))}
        return found, chosen

    def _propose(self, rows: list[_Row], limits: list[int]) -> Draft:
        """The draft of rows sampled alike (the ones with a limit of 0 propose nothing)."""
        held = [j for j, limit in enumerate(limits) if limit > 0]
        if not held:
            return Draft.empty(len(rows))
        draft = self.drafter.propose([rows[j].slot for j in held], [rows[j].context for j in held],
                                     [limits[j] for j in held], rows[held[0]].params,
                                     [rows[j].request.generator for j in held], min_confidence=self.config.stop_confidence)
        self._sync()
        return draft if len(held) == len(rows) else spread(draft, held, len(rows))

    def _verify(self, rows: list[_Row], groups: list[list[int]], drafts: list[Draft],
                draft: Draft) -> tuple[VerifyResult, torch.Tensor | None]:
        """One target pass over every row; each group of rows sampled alike is verified with its
        settings. Also returns the pass's hidden states [n, k'+1, L, H] when the drafter reads them."""
        block = torch.cat([torch.tensor([[r.context[-1]] for r in rows]), draft.tokens.cpu()], dim=1)  # [n, k'+1]
        slots, counts = [r.slot for r in rows], [1 + n for n in draft.lengths]
        states = None
        if self.feature_layers is None:
            target_logits = self.target.forward(block, rows=slots, counts=counts)  # [n, k'+1, V]
        else:
            target_logits, states = self.target.forward(block, rows=slots, counts=counts, return_hidden=self.feature_layers)
        if len(groups) == 1:
            return self._verify_group(rows, drafts[0], target_logits), states
        num_accepted = torch.zeros(len(rows), dtype=torch.long)
        next_tokens = torch.zeros(len(rows), dtype=torch.long)
        for group, group_draft in zip(groups, drafts):
            width = group_draft.tokens.shape[1] + 1
            part = self._verify_group([rows[j] for j in group], group_draft, target_logits[group, :width])
            num_accepted[group], next_tokens[group] = part.num_accepted.cpu(), part.next_tokens.cpu()
        return VerifyResult(num_accepted, next_tokens), states

    def _verify_group(self, rows: list[_Row], draft: Draft, target_logits: torch.Tensor) -> VerifyResult:
        result = self.verifier(draft.tokens.to(target_logits.device), draft.probs, target_logits, rows[0].params,
                               [r.request.generator for r in rows], draft_lengths=draft.lengths)
        self._sync()
        return result

    def _commit(self, rows: list[_Row], held: list[int], result: VerifyResult, states: torch.Tensor | None) -> None:
        """states [n, k'+1, L, H] | None: the verify pass's hidden states (the drafter gets the kept ones)."""
        lengths = self.target.lengths.clone()
        for j, row in enumerate(rows):
            # the cache holds: committed (without pending) + pending + drafts; keep pending + accepted
            lengths[row.slot] = len(row.context) + int(result.num_accepted[j])
        self.target.truncate(lengths)
        if held:
            self.drafter.commit([rows[j].slot for j in held], result.num_accepted[held])
        if states is not None:
            kept = [states[j, : 1 + int(result.num_accepted[j])] for j in range(len(rows))]
            self.drafter.take_features([r.slot for r in rows], [len(r.context) - 1 for r in rows], kept)


class Batch:
    """A running batch (glossary: slot): requests join with ``add``, which prefills the prompt
    into a free slot at once, and leave at the end of the step in which they end, or at the next
    step once cancelled; ``step`` runs one engine step over every row."""

    def __init__(self, engine: SpecEngine, slots: int, params: SamplingParams, eos_ids: Sequence[int], stats: BatchStats):
        self.engine, self.params, self.stats = engine, params, stats
        self.eos = set(int(t) for t in eos_ids)
        self.rows: list[_Row | None] = [None] * slots
        stats.batch_size = slots
        self.started = time.perf_counter()
        engine.target.reset(slots)
        if engine.drafter is not None:
            engine.drafter.reset(slots)
        if engine.lookup is not None:
            engine.lookup.reset(slots)

    @property
    def draft_length(self) -> int:
        """The draft length the policy chose for the last step."""
        return self.engine.last_draft_length

    @property
    def active(self) -> int:
        return sum(row is not None for row in self.rows)

    def free_slots(self) -> list[int]:
        self._release_cancelled()
        return [slot for slot, row in enumerate(self.rows) if row is None]

    def add(self, index: int, request: Request, defer_draft: bool = False) -> list[RowStep]:
        """Admit ``request`` (``index`` names it in the RowSteps) into a free slot. defer_draft:
        under a policy that follows the load, the request's drafter starts after its first
        token instead of with its prompt, and that first token comes at once, from a plain step
        of this row alone, returned here (glossary: admission first); otherwise nothing is."""
        self.engine.check_request(request)
        free = self.free_slots()
        if not free:
            raise SpecDecodeError("the batch is full", field="batch_size")
        eos = self.eos if request.eos_ids is None else set(int(t) for t in request.eos_ids)
        row = self.engine._admit(free[0], index, request, request.params or self.params, eos, self.active + 1, defer_draft)
        self.rows[free[0]] = row
        if defer_draft and self.engine.policy.follows_load:
            return self._run([row], hold_drafters=True)
        return []

    def step(self, hold_drafters: bool = False) -> list[RowStep]:
        """One step over every row; rows that end in it leave the batch. hold_drafters: under a
        policy that follows the load, no deferred drafter starts in this step (glossary:
        admission first)."""
        self._release_cancelled()
        active = [row for row in self.rows if row is not None]
        return self._run(active, hold_drafters) if active else []

    def _run(self, active: list[_Row], hold_drafters: bool) -> list[RowStep]:
        """One engine step over ``active``; the rows that end in it leave the batch."""
        batch = self.stats
        batch.target_forwards += 1
        batch.rows_per_forward += (len(active) - batch.rows_per_forward) / batch.target_forwards
        steps = []
        for row, step in self.engine._step(active, hold_drafters):
            batch.new_tokens += len(step.tokens)
            steps.append(step)
            if step.finish_reason is not None:
                self._release(row)
        batch.wall_seconds = time.perf_counter() - self.started
        return steps

    def close(self) -> None:
        for row in self.rows:
            if row is not None:
                self._release(row)
        self.stats.wall_seconds = time.perf_counter() - self.started

    def _release(self, row: _Row) -> None:
        row.request.stats.wall_seconds = time.perf_counter() - row.started
        self.rows[row.slot] = None

    def _release_cancelled(self) -> None:
        for row in self.rows:
            if row is not None and row.request.cancelled:
                self._release(row)


def _sampling_groups(rows: list[_Row]) -> list[list[int]]:
    """Positions of the rows, grouped by the settings their tokens are drawn with."""
    groups: dict[tuple, list[int]] = {}
    for j, row in enumerate(rows):
        groups.setdefault((row.params.temperature, row.params.top_k, row.params.top_p), []).append(j)
    return list(groups.values())


def _with_lookups(draft: Draft, group: list[int], found: Draft, chosen: set[int], vocab: int) -> Draft:
    """A group's model draft (over ``group``'s rows, in order) with the chosen rows' lookups in
    place; lookup rows are one-hot where the model's rows carry probabilities."""
    mine = [i for i, j in enumerate(group) if j in chosen]
    if not mine:
        return draft
    lengths = [found.lengths[j] if j in chosen else draft.lengths[i] for i, j in enumerate(group)]
    tokens = torch.zeros((len(group), max(lengths, default=0)), dtype=torch.long)
    width = min(draft.tokens.shape[1], tokens.shape[1])
    tokens[:, :width] = draft.tokens[:, :width].cpu()
    probs = None
    if draft.probs is not None:
        probs = draft.probs.new_zeros((len(group), tokens.shape[1], vocab))
        probs[:, :width] = draft.probs[:, :width]
    for i in mine:
        j = group[i]
        row = found.tokens[j, : found.lengths[j]]
        tokens[i] = 0
        tokens[i, : len(row)] = row
        if probs is not None:
            probs[i] = 0
            probs[i, torch.arange(len(row)), row] = 1
    return Draft(tokens, probs, lengths)


def _joined(drafts: list[Draft], groups: list[list[int]], n: int) -> Draft:
    """The groups' drafts as one right-padded block over all n rows (tokens and lengths only)."""
    if len(drafts) == 1:
        return drafts[0]
    tokens = torch.zeros((n, max(d.tokens.shape[1] for d in drafts)), dtype=torch.long)
    lengths = [0] * n
    for group, draft in zip(groups, drafts):
        tokens[group, : draft.tokens.shape[1]] = draft.tokens.cpu()
        for j, length in zip(group, draft.lengths):
            lengths[j] = length
    return Draft(tokens, None, lengths)


def _stop_check(tokens: list[int], eos: set[int], remaining: int) -> tuple[list[int], str | None]:
    """Cut a step's tokens at the first EOS (kept) or at the token budget."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1], "stop"
    if len(tokens) >= remaining:
        return tokens[:remaining], "length"
    return tokens, None
