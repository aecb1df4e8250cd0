"""What the adaptive policy measures: per-position acceptance, and the costs of passes and drafts.

Glossary:
- *decayed rate*: each observation adds weight ``1 - decay`` and every earlier one keeps
  ``decay`` of its weight, so old steps fade.
- *acceptance estimate*: per draft position, the decayed rate at which a drafted token there was
  accepted, counted only on steps where every position before it was accepted; each is shrunk
  towards the position before it (position 0 towards ``prior``) with the weight of half an
  observation, so an untested position reads as its predecessor and a few early rejections do
  not outweigh what later steps measure.
- *pass cost*: decayed seconds of one target pass, per rows in the pass and mean tokens a row m
  (the pending token plus the row's draft, averaged over the rows: the ragged pass runs the
  tokens it is given); read between measured widths by ``costmodel.interpolate``.
- *draft cost*: seconds a draft call of k tokens takes, per rows drafting, as an affine fit
  a + b k over past steps (a call first feeds the tokens committed since the last one, so the
  first token costs more than the others); with one length seen, k times the mean per token.
- *start cost*: seconds per context token of starting a drafter (a draft model's prefill): a
  reading below the estimate replaces it, one above it is decayed in. A start's cost has a floor
  and only noise above it (a cold first call, a busy machine), so one low reading is the
  better guide.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..costmodel import interpolate

PRIOR_OBSERVATIONS = 0.5  # a position's prior weighs half of one observation


@dataclass
class AcceptanceEstimates:
    max_gamma: int
    decay: float = 0.9
    prior: float = 0.6
    accepted: list[float] = field(default_factory=list)  # [max_gamma] decayed accepted counts
    drafted: list[float] = field(default_factory=list)  # [max_gamma] decayed drafted counts

    def __post_init__(self) -> None:
        self.accepted = [0.0] * self.max_gamma
        self.drafted = [0.0] * self.max_gamma

    def rates(self) -> list[float]:
        """[max_gamma] estimated acceptance per draft position (see the glossary)."""
        prior_weight = PRIOR_OBSERVATIONS * (1 - self.decay)  # one observation adds 1 - decay
        out, prior = [], self.prior
        for accepted, drafted in zip(self.accepted, self.drafted):
            prior = (accepted + prior_weight * prior) / (drafted + prior_weight)
            out.append(prior)
        return out

    def observe(self, drafted: int, accepted: int) -> None:
        """One row of a step: drafted tokens, of which the first ``accepted`` were kept."""
        for i in range(drafted):
            self.accepted[i] = self.decay * self.accepted[i] + (1 - self.decay) * float(i < accepted)
            self.drafted[i] = self.decay * self.drafted[i] + (1 - self.decay)
            if i >= accepted:
                break  # positions after the first rejection were not tested


@dataclass
class CostEstimates:
    decay: float = 0.9
    passes: dict[int, dict[float, float]] = field(default_factory=dict)  # rows -> mean tokens a row -> seconds
    draft_fits: dict[int, list[float]] = field(default_factory=dict)  # rows -> decayed n, k, k^2, y, k*y
    draft_means: dict[int, float] = field(default_factory=dict)  # rows -> seconds per drafted token
    start_cost: float | None = None  # seconds per context token

    def _decayed(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def observe_pass(self, rows: int, width: float, seconds: float) -> None:
        curve, width = self.passes.setdefault(rows, {}), round(width, 2)
        curve[width] = self._decayed(curve.get(width), seconds)

    def observe_draft(self, rows: int, k: int, seconds: float) -> None:
        fit = [self.decay * v for v in self.draft_fits.get(rows, [0.0] * 5)]
        for i, v in enumerate((1.0, k, k * k, seconds, k * seconds)):
            fit[i] += v
        self.draft_fits[rows] = fit
        self.draft_means[rows] = self._decayed(self.draft_means.get(rows), seconds / k)

    def observe_start(self, context_tokens: int, seconds: float) -> None:
        reading = seconds / max(1, context_tokens)
        old = self.start_cost
        self.start_cost = reading if old is None or reading < old else self._decayed(old, reading)

    def knows_pass(self, rows: int = 1) -> bool:
        return 1 in self.passes.get(rows, {})

    def knows_draft(self, rows: int = 1) -> bool:
        return rows in self.draft_means

    def pass_seconds(self, width: float, rows: int = 1) -> float:
        return interpolate(self.passes[rows], width)

    def draft_seconds(self, k: int, rows: int = 1) -> float:
        """Seconds to draft k tokens for ``rows`` rows (the affine fit of the glossary)."""
        n, sk, skk, sy, sky = self.draft_fits[rows]
        var = skk / n - (sk / n) ** 2
        if var < 1e-9:
            return k * self.draft_means[rows]
        slope = max((sky / n - (sk / n) * (sy / n)) / var, 1e-6)
        return max(0.0, sy / n - slope * sk / n) + slope * k
