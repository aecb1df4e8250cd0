"""The adaptive draft-length schedule (``--gamma auto``), decided once per engine step.

Glossary:
- *fixed*: always ``gamma`` (capped by the remaining budget).
- *adaptive* (``--gamma auto``): choose k in 0..max_gamma to maximise expected tokens per second,
  E(k) / (t_draft(k) + T(k + 1)), where E(k) = 1 + sum_j prod_{i<=j} a_i from running per-position
  acceptance estimates a_i, t_draft(k) the measured cost of drafting k tokens and T(m) the
  measured cost of a target pass over m tokens. k = 0 is a plain decoding step; while it wins the
  policy stays plain and probes with a short draft every ``probe_every`` steps, so a request where
  drafting does not pay runs at about plain speed.
- *deferred start* (adaptive only): when a drafter's one-off start (a draft model's prompt
  prefill) is worth paying. Its break-even is n = start cost / time saved per drafted token, both
  measured on earlier requests. A request whose budget is at most n never starts the drafter (it
  could not earn the start back). Otherwise the drafter starts with the request, unless one of the
  last ``RECENT_ANSWERS`` answers on this engine ended within n tokens: then answers here are
  short enough for the start to lose, and the request decodes n plain tokens first (the ski-rental
  rule: an answer that ends within n tokens never pays for the start, a longer one loses at most
  twice what the start costs, and the deferral is at most ``longest_deferral`` tokens).
  A deferral costs every long answer n plain tokens, which is why it is not the default: starting
  at once loses only on answers shorter than n (about 9 tokens with the default pair). With
  nothing measured yet the drafter starts at once, and the first request measures the costs.
- *start re-test*: a request whose budget cannot earn the start back never starts the drafter,
  except every ``LONGEST_RETEST_GAP``-th such request, which starts it so that the start cost is
  measured again (a start cost read high once, say on a cold first call, would otherwise keep
  every later request from starting and never be corrected).
- *re-test*: while drafting does not pay, a request decodes plainly without starting the drafter,
  except every ``retest_gap``-th one, which starts it with the request and probes at once (its
  cache is then up to date, so the probe feeds no backlog); the gap doubles after each re-test,
  up to ``LONGEST_RETEST_GAP`` requests, and returns to 1 once a step drafts because it pays.
- *probe back-off*: each probe after which plain decoding still wins doubles the gap to the
  next one (up to ``LONGEST_PROBE_GAP`` plain steps); a step that drafts resets it.
- *estimates*: per-position acceptance and the measured costs (``policy.estimates``), the
  costs kept per number of rows in the pass, so a step's choice is made with the costs of the
  batch it runs in; the rate formula is ``costmodel``'s. In a batch where only some rows draft
  (the others have not started their drafters), the pass is read at its mean tokens a row and
  the others count as passengers: a step is worth its tokens over all rows.
- *lookup drafts*: the engine's lookup fill drafts prompt lookups where they are long enough,
  and on steps this policy makes plain. They cost no draft time, so their length is the best
  one for free drafts under their own per-position acceptance (``lookup_acceptance``, prior ``LOOKUP_PRIOR``) and the
  measured pass costs, with a one-token lookup every ``probe_every`` steps that would have
  none; their rows feed the pass costs and ``lookup_acceptance``, not the model's estimates.
- *confidence stop*: within the chosen length a draft model stops after a token it gave less
  than ``config.SpecConfig.stop_confidence`` (0.7 by default with this policy); the estimates
  above then measure the positions such drafts reach.
- *load-aware start*: in a batch of a size at which the costs measured there make plain steps
  the best, no drafter starts (a draft model's prefill would be paid for nothing); the rows'
  drafters start at a step where the batch has shrunk to a size where drafting pays, or every
  ``LONGEST_PROBE_GAP`` steps at that size, so its costs are measured again.
- *stretch*: every ``probe_every`` drafting steps the policy drafts one token past its best
  length, so a position whose estimate went stale (it stopped being drafted after a bad patch)
  is measured again.
The estimates carry over from one request to the next on the same engine (a pair's costs and
typical acceptance are properties of the models and the machine). The choice depends only on past steps, never on the current step's random draws, so the output
distribution stays exactly the target's.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Collection, Sequence

from ..costmodel import best_length
from .estimates import AcceptanceEstimates, CostEstimates

# A probe first feeds the draft model every token decoded since the last one (about 3 ms a token
# with a llama.cpp draft, some 5% of a plain step), whatever the gap; so a long losing streak
# backs off until requests seldom probe at all past the one at a re-test's start (which owes none).
LONGEST_PROBE_GAP = 256
RECENT_ANSWERS = 8  # answer lengths the deferred start looks back on
LONGEST_RETEST_GAP = 8  # requests
LOOKUP_PRIOR = 0.3  # acceptance of an untested lookup position (prompt lookups keep about 0.2-0.5 here)


def _cap(max_gamma: int, remaining: int | Sequence[int]) -> int:
    """The longest draft worth making: a step commits at least one target token."""
    longest = remaining if isinstance(remaining, int) else max(remaining, default=0)
    return max(0, min(max_gamma, longest - 1))


class FixedGamma:
    """Always ``gamma`` tokens (capped by the budget); measures nothing."""

    follows_load = False  # the engine's admission-first rules do not apply (engine glossary)

    def __init__(self, gamma: int):
        self.gamma = gamma
        self.max_gamma = gamma

    def choose(self, remaining: int | Sequence[int], rows: int = 1) -> int:
        return _cap(self.gamma, remaining)

    def observe(self, drafted: Sequence[int], accepted: Sequence[int], draft_seconds: float, verify_seconds: float,
                lookups: Collection[int] = ()) -> None:
        pass

    def start_after(self, context_tokens: int, budget: int) -> int:
        return 0  # a fixed draft length starts drafting at once

    def drafts_at(self, rows: int) -> bool:
        return True

    def started(self, context_tokens: int, seconds: float) -> None:
        pass

    def finished(self, new_tokens: int) -> None:
        pass


@dataclass
class AdaptiveGamma:
    """The schedule of the module glossary over ``acceptance`` and ``costs``."""

    follows_load = True  # (a class attribute) the engine applies its admission-first rules
    max_gamma: int = 8
    probe_every: int = 8
    decay: float = 0.9  # weight of the past in the running estimates
    longest_deferral: int = 64  # plain tokens a deferred start waits at most
    prior_acceptance: float = 0.6
    acceptance: AcceptanceEstimates = field(init=False)
    lookup_acceptance: AcceptanceEstimates = field(init=False)  # of the engine's lookup drafts
    costs: CostEstimates = field(init=False)
    plain_steps: int = 0  # plain steps since the last probe
    probe_gap: int = 0  # plain steps between probes now (0: probe_every)
    drafting_steps: int = 0  # drafting steps since the last stretch
    probe_now: bool = False  # a drafter has just started: probe it on the next step
    retest_gap: int = 1  # requests from one re-test to the next
    requests_since_retest: int = 0
    plain_lookup_steps: int = 0  # steps whose lookup length was 0 since the last lookup
    unearned_starts: int = 0  # requests since the last start re-test that could not earn a start back
    answer_lengths: deque = field(default_factory=lambda: deque(maxlen=RECENT_ANSWERS))  # new tokens of recent requests
    plain_batch_steps: dict = field(default_factory=dict)  # rows -> steps since drafters last started at that size

    def __post_init__(self) -> None:
        self.acceptance = AcceptanceEstimates(self.max_gamma, self.decay, self.prior_acceptance)
        self.lookup_acceptance = AcceptanceEstimates(self.max_gamma, self.decay, LOOKUP_PRIOR)
        self.costs = CostEstimates(self.decay)

    def best(self, cap: int, rows: int = 1, drafting: int | None = None) -> tuple[int, float]:
        """(k, tokens per second a drafting row) of the best draft length up to cap for a pass of
        ``rows`` rows of which ``drafting`` (default: all) draft; the others take one token."""
        costs, d = self.costs, rows if drafting is None else drafting
        return best_length(self.acceptance.rates(), lambda k: costs.draft_seconds(k, d),
                           lambda m: costs.pass_seconds(1 + d * (m - 1) / rows, rows), cap, (rows - d) / d)

    def choose(self, remaining: int | Sequence[int], rows: int = 1) -> int:
        """The draft length of the next step of a pass of ``rows`` rows; remaining: the budget
        left of the one drafting row, or of each drafting row (the longest bounds the length)."""
        cap = _cap(self.max_gamma, remaining)
        if cap == 0:
            return 0
        drafting = 1 if isinstance(remaining, int) else len(remaining)
        if not self.costs.knows_pass(rows):
            return 0  # measure a plain step first
        if not self.costs.knows_draft(drafting):
            return min(cap, 2)  # then a short draft
        best_k, _ = self.best(cap, rows, drafting)
        if self.probe_now:
            self.probe_now = False
            if best_k == 0:  # a re-test: probe while the draft's cache is up to date
                self.plain_steps = 0
                return 1
        if best_k > 0:
            self.retest_gap = 1
            self.drafting_steps += 1
            if best_k < cap and self.drafting_steps >= self.probe_every:
                self.drafting_steps = 0
                best_k += 1  # the stretch
            self.plain_steps, self.probe_gap = 0, 0
            return best_k
        self.plain_steps += 1
        if self.plain_steps >= (self.probe_gap or self.probe_every):
            # probe to keep the acceptance estimate fresh; the next one comes later if this one
            # does not change the verdict (a drafting step resets the gap)
            self.plain_steps, self.probe_gap = 0, min(LONGEST_PROBE_GAP, 2 * (self.probe_gap or self.probe_every))
            return 1
        return 0

    def observe(self, drafted: Sequence[int], accepted: Sequence[int], draft_seconds: float, verify_seconds: float,
                lookups: Collection[int] = ()) -> None:
        """One engine step: each row's drafted and accepted tokens, and the step's draft and
        verification seconds (all rows together); lookups: the rows whose drafts were lookups
        (glossary: lookup drafts), which feed the pass cost and the lookup acceptance only."""
        rows = len(drafted)
        self.costs.observe_pass(rows, 1 + sum(drafted) / rows, verify_seconds)
        model = [n for j, n in enumerate(drafted) if j not in lookups]
        if max(model, default=0):
            self.costs.observe_draft(sum(n > 0 for n in model), max(model), draft_seconds)
        for j, (n, kept) in enumerate(zip(drafted, accepted)):
            (self.lookup_acceptance if j in lookups else self.acceptance).observe(n, kept)

    def lookup_length(self, remaining: Sequence[int], rows: int = 1) -> int:
        """The length the engine looks up to in the next step, for a pass of ``rows`` rows with
        these budgets left (glossary: lookup drafts); 0: no lookup."""
        cap = _cap(self.max_gamma, remaining)
        if cap == 0 or not self.costs.knows_pass(rows):
            return 0
        costs = self.costs
        k = best_length(self.lookup_acceptance.rates(), lambda k: 0.0, lambda m: costs.pass_seconds(m, rows), cap)[0]
        self.plain_lookup_steps = 0 if k else self.plain_lookup_steps + 1
        if self.plain_lookup_steps >= self.probe_every:  # a one-token lookup now and then keeps the estimate fresh
            self.plain_lookup_steps = 0
            return 1
        return k

    def drafts_at(self, rows: int) -> bool:
        """Whether steps of this many rows draft: False once the costs measured at that batch size
        make plain steps the best (glossary: load-aware start), so no drafter is started then."""
        if not (self.costs.knows_pass(rows) and self.costs.knows_draft(rows)):
            return True  # measure
        if self.best(self.max_gamma, rows)[0] > 0:
            return True
        self.plain_batch_steps[rows] = self.plain_batch_steps.get(rows, 0) + 1
        if self.plain_batch_steps[rows] >= LONGEST_PROBE_GAP:  # now and then: start, and measure again
            self.plain_batch_steps[rows] = 0
            return True
        return False

    def start_after(self, context_tokens: int, budget: int) -> int:
        """Plain tokens a request with this budget decodes before its drafter starts (glossary:
        deferred start); budget or more means never. Called once per request: while drafting
        does not pay it counts requests towards the next re-test."""
        costs = self.costs
        if costs.start_cost is None or not costs.knows_draft() or not costs.knows_pass():
            return 0  # nothing measured: start, and measure
        best_k, rate = self.best(self.max_gamma)
        saving = costs.pass_seconds(1) - 1.0 / rate  # seconds saved per token while drafting
        if best_k == 0 or saving <= 0:  # drafting does not pay: plain, or a re-test (glossary)
            self.requests_since_retest += 1
            if self.requests_since_retest < self.retest_gap:
                return budget
            self.requests_since_retest = 0
            self.retest_gap = min(LONGEST_RETEST_GAP, 2 * self.retest_gap)
            return 0
        break_even = math.ceil(costs.start_cost * context_tokens / saving)
        if budget <= break_even:  # never, but every LONGEST_RETEST_GAP-th such request measures the start again
            self.unearned_starts += 1
            if self.unearned_starts < LONGEST_RETEST_GAP:
                return budget
            self.unearned_starts = 0
            return 0
        if any(n <= break_even for n in self.answer_lengths):
            return min(self.longest_deferral, break_even)
        return 0

    def started(self, context_tokens: int, seconds: float) -> None:
        """A drafter start over context_tokens took this long."""
        self.probe_now = True
        self.costs.observe_start(context_tokens, seconds)

    def finished(self, new_tokens: int) -> None:
        """A request ended after new_tokens (read by the deferred start)."""
        self.answer_lengths.append(new_tokens)
