"""How many tokens to draft each step.

Glossary:
- *fixed*: always ``gamma`` (capped by the remaining budget).
- *adaptive* (``--gamma auto``): choose k in 0..max_gamma to maximise expected tokens per second,
  E(k) / (k * t_draft + T(k + 1)), where E(k) = 1 + sum_j prod_{i<=j} a_i from running per-position
  acceptance estimates a_i, t_draft is the measured cost of one draft token and T(m) the
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
- *re-test*: while drafting does not pay, a request decodes plainly without starting the drafter,
  except every ``retest_gap``-th one, which starts it with the request and probes at once (its
  cache is then up to date, so the probe feeds no backlog); the gap doubles after each re-test,
  up to ``LONGEST_RETEST_GAP`` requests, and returns to 1 once a step drafts because it pays.
- *probe back-off*: each probe after which plain decoding still wins doubles the gap to the
  next one (up to ``LONGEST_PROBE_GAP`` plain steps); a step that drafts resets it.
- *acceptance estimates*: a running (decayed) rate per draft position, conditional on the
  positions before it being accepted, shrunk towards the position before it (position 0 towards
  ``prior_acceptance``) with the weight of half an observation: an untested position reads as
  its predecessor, and a few early rejections do not outweigh what later steps measure.
- *confidence stop*: within the chosen length a draft model stops after a token it gave less
  than ``config.SpecConfig.stop_confidence`` (0.7 by default with this policy); the estimates
  above then measure the positions such drafts reach.
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


PRIOR_OBSERVATIONS = 0.5  # a position's prior weighs half of one observation
# A probe first feeds the draft model every token decoded since the last one (about 3 ms a token
# with a llama.cpp draft, some 5% of a plain step), whatever the gap; so a long losing streak
# backs off until requests seldom probe at all past the one at a re-test's start (which owes none).
LONGEST_PROBE_GAP = 256
RECENT_ANSWERS = 8  # answer lengths the deferred start looks back on
LONGEST_RETEST_GAP = 8  # requests


class FixedGamma:
    def __init__(self, gamma: int):
        self.gamma = gamma
        self.max_gamma = gamma

    def choose(self, remaining: int) -> int:
        return max(0, min(self.gamma, remaining - 1))

    def update(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        pass

    def start_after(self, context_tokens: int, budget: int) -> int:
        return 0  # a fixed draft length starts drafting at once

    def started(self, context_tokens: int, seconds: float) -> None:
        pass

    def finished(self, new_tokens: int) -> None:
        pass


@dataclass
class AdaptiveGamma:
    max_gamma: int = 8
    probe_every: int = 8
    decay: float = 0.9  # weight of the past in the running estimates
    longest_deferral: int = 64  # plain tokens a deferred start waits at most
    prior_acceptance: float = 0.6
    # running state
    accept_weight: list[float] = field(default_factory=list)  # [max_gamma] decayed accepted counts
    draft_weight: list[float] = field(default_factory=list)  # [max_gamma] decayed drafted counts
    draft_cost: float | None = None  # seconds per drafted token (mean)
    draft_fit: list[float] = field(default_factory=lambda: [0.0] * 5)  # decayed sums: n, k, k^2, y, k*y
    pass_cost: dict[int, float] = field(default_factory=dict)  # tokens scored -> seconds
    plain_steps: int = 0
    probe_gap: int = 0  # plain steps between probes now (0: probe_every)
    start_cost: float | None = None  # seconds per context token of a drafter start (mean)
    drafting_steps: int = 0  # drafting steps since the last stretch
    answer_lengths: deque = field(default_factory=lambda: deque(maxlen=RECENT_ANSWERS))  # new tokens of recent requests
    retest_gap: int = 1  # requests from one re-test to the next (glossary: re-test)
    requests_since_retest: int = 0
    probe_now: bool = False  # a drafter has just started: probe it on the next step

    def __post_init__(self) -> None:
        self.accept_weight = [0.0] * self.max_gamma
        self.draft_weight = [0.0] * self.max_gamma

    def acceptances(self) -> list[float]:
        """Estimated acceptance per draft position (glossary: acceptance estimates)."""
        prior_weight = PRIOR_OBSERVATIONS * (1 - self.decay)  # one observation adds 1 - decay
        out, prior = [], self.prior_acceptance
        for accepted, drafted in zip(self.accept_weight, self.draft_weight):
            prior = (accepted + prior_weight * prior) / (drafted + prior_weight)
            out.append(prior)
        return out

    def acceptance(self, position: int) -> float:
        return self.acceptances()[position]

    def expected_tokens(self, k: int, acceptances: list[float] | None = None) -> float:
        total, survive = 1.0, 1.0
        for a in (self.acceptances() if acceptances is None else acceptances)[:k]:
            survive *= a
            total += survive
        return total

    def _pass_seconds(self, m: int) -> float | None:
        if m in self.pass_cost:
            return self.pass_cost[m]
        known = sorted(self.pass_cost)
        if not known:
            return None
        lower = [x for x in known if x <= m]
        upper = [x for x in known if x >= m]
        if lower and upper:  # interpolate between measured block sizes
            a, b = lower[-1], upper[0]
            return self.pass_cost[a] + (self.pass_cost[b] - self.pass_cost[a]) * (m - a) / (b - a)
        return self.pass_cost[lower[-1] if lower else upper[0]]

    def draft_seconds(self, k: int) -> float:
        """Cost of drafting k tokens: an affine fit a + b k over past steps (the first draft call
        also feeds the tokens committed since the last one, so it costs more than the others)."""
        n, sk, skk, sy, sky = self.draft_fit
        var = skk / n - (sk / n) ** 2
        if var < 1e-9:
            return k * self.draft_cost
        slope = (sky / n - (sk / n) * (sy / n)) / var
        slope = max(slope, 1e-6)
        return max(0.0, sy / n - slope * sk / n) + slope * k

    def choose(self, remaining: int) -> int:
        cap = max(0, min(self.max_gamma, remaining - 1))
        if cap == 0:
            return 0
        if 1 not in self.pass_cost:
            return 0  # measure a plain step first
        if self.draft_cost is None:
            return min(cap, 2)  # then a short draft
        best_k, _ = self._best(cap)
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
                best_k += 1  # the stretch (glossary)
        if best_k == 0:
            self.plain_steps += 1
            if self.plain_steps >= (self.probe_gap or self.probe_every):
                # probe to keep the acceptance estimate fresh; the next one comes later if this
                # one does not change the verdict (drafting resets the gap below)
                self.plain_steps, self.probe_gap = 0, min(LONGEST_PROBE_GAP, 2 * (self.probe_gap or self.probe_every))
                return 1
        else:
            self.plain_steps, self.probe_gap = 0, 0
        return best_k

    def _best(self, cap: int) -> tuple[int, float]:
        """(k, tokens per second) of the best draft length up to cap; k = 0 is a plain step."""
        best_k, best_rate = 0, 1.0 / self.pass_cost[1]
        acceptances = self.acceptances()
        for k in range(1, cap + 1):
            rate = self.expected_tokens(k, acceptances) / (self.draft_seconds(k) + self._pass_seconds(k + 1))
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k, best_rate

    def start_after(self, context_tokens: int, budget: int) -> int:
        """Plain tokens a request with this budget decodes before its drafter starts (glossary:
        deferred start); budget or more means never. Called once per request: while drafting
        does not pay it counts requests towards the next re-test."""
        if self.start_cost is None or self.draft_cost is None or 1 not in self.pass_cost:
            return 0  # nothing measured: start, and measure
        best_k, rate = self._best(self.max_gamma)
        saving = self.pass_cost[1] - 1.0 / rate  # seconds saved per token while drafting
        if best_k == 0 or saving <= 0:  # drafting does not pay: plain, or a re-test (glossary)
            self.requests_since_retest += 1
            if self.requests_since_retest < self.retest_gap:
                return budget
            self.requests_since_retest = 0
            self.retest_gap = min(LONGEST_RETEST_GAP, 2 * self.retest_gap)
            return 0
        break_even = math.ceil(self.start_cost * context_tokens / saving)
        if budget <= break_even:
            return budget
        if any(n <= break_even for n in self.answer_lengths):
            return min(self.longest_deferral, break_even)
        return 0

    def started(self, context_tokens: int, seconds: float) -> None:
        """A drafter start over context_tokens took this long."""
        per_token = seconds / max(1, context_tokens)
        self.probe_now = True
        self.start_cost = per_token if self.start_cost is None else self.decay * self.start_cost + (1 - self.decay) * per_token

    def finished(self, new_tokens: int) -> None:
        """A request ended after new_tokens (read by the deferred start)."""
        self.answer_lengths.append(new_tokens)

    def update(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        m = drafted + 1
        old = self.pass_cost.get(m)
        self.pass_cost[m] = verify_seconds if old is None else self.decay * old + (1 - self.decay) * verify_seconds
        if drafted:
            self.draft_fit = [self.decay * v for v in self.draft_fit]
            for i, v in enumerate((1.0, drafted, drafted * drafted, draft_seconds, drafted * draft_seconds)):
                self.draft_fit[i] += v
            per_token = draft_seconds / drafted
            self.draft_cost = per_token if self.draft_cost is None else self.decay * self.draft_cost + (1 - self.decay) * per_token
        for i in range(drafted):
            self.accept_weight[i] = self.decay * self.accept_weight[i] + (1 - self.decay) * float(i < accepted)
            self.draft_weight[i] = self.decay * self.draft_weight[i] + (1 - self.decay)
            if i >= accepted:
                break  # positions after the first rejection were not tested
