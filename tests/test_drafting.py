"""Hybrid drafting, adaptive draft length and confidence stops: exact, and the policy's choices."""

import math
import random

import pytest
import torch

from specdecode.config import SamplingParams, SpecConfig
from specdecode.drafters import ModelDrafter
from specdecode.drafters.hybrid import HybridDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.engine import SpecEngine
from specdecode.stats import GenerationStats
from specdecode.errors import SpecDecodeError
from specdecode.policy import AdaptiveGamma, FixedGamma
from specdecode.policy.adaptive import LONGEST_RETEST_GAP
from specdecode.runners.hf import HFRunner

from helpers import perturbed, tiny_model, decode

VOCAB = 48


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", seed=51, vocab_size=VOCAB, init=0.8)
    return target, perturbed(target, 0.03, seed=52)


def drafters(target, draft):
    return {
        "hybrid": lambda: HybridDrafter(ModelDrafter(HFRunner(draft)), NgramDrafter(VOCAB), min_lookup=2),
        "confidence": lambda: ModelDrafter(HFRunner(draft)),
        "model": lambda: ModelDrafter(HFRunner(draft)),
    }


@pytest.mark.parametrize("kind", ["hybrid", "confidence", "model"])
@pytest.mark.parametrize("gamma", [3, "auto"])
def test_greedy_identity(pair, kind, gamma):
    target, draft = pair
    plain = SpecEngine(HFRunner(target), None, SpecConfig())
    config = SpecConfig(gamma=gamma, draft_confidence=0.5 if kind == "confidence" else 0.0)
    spec = SpecEngine(HFRunner(target), drafters(target, draft)[kind](), config)
    g = torch.Generator().manual_seed(2)
    drafted = 0
    for _ in range(10):
        base = torch.randint(0, VOCAB, (1, 5), generator=g)
        prompt = torch.cat([base, base, base[:, :2]], dim=1)
        params = SamplingParams(max_new_tokens=40)
        stats = GenerationStats()
        out = [t for s in decode(spec, prompt, params, stats=stats) for t in s.tokens]
        assert out == [t for s in decode(plain, prompt, params) for t in s.tokens]
        drafted += stats.drafted_tokens
    assert drafted > 0


def test_hybrid_uses_both_sources(pair):
    target, draft = pair
    hybrid = drafters(target, draft)["hybrid"]()
    spec = SpecEngine(HFRunner(target), hybrid, SpecConfig(gamma=4))
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2]])
    list(decode(spec, prompt, SamplingParams(max_new_tokens=40)))
    assert hybrid.lookup_steps > 0 and hybrid.model_steps > 0


def test_confidence_stop_shortens_drafts(pair):
    target, draft = pair
    stats_all, stats_conf = GenerationStats(), GenerationStats()
    prompt = torch.tensor([[3, 9, 27, 1]])
    for confidence, stats in ((None, stats_all), (0.9, stats_conf)):
        config = SpecConfig(gamma=6, draft_confidence=confidence)
        list(decode(SpecEngine(HFRunner(target), ModelDrafter(HFRunner(draft)), config), prompt, SamplingParams(max_new_tokens=40), stats=stats))
    assert stats_conf.drafted_tokens / stats_conf.target_forwards < stats_all.drafted_tokens / stats_all.target_forwards


def test_the_adaptive_policy_stops_on_confidence_unless_told_otherwise():
    from specdecode.config import ADAPTIVE_DRAFT_CONFIDENCE

    assert SpecConfig(gamma="auto").stop_confidence == ADAPTIVE_DRAFT_CONFIDENCE
    assert SpecConfig(gamma="auto", draft_confidence=0.0).stop_confidence == 0.0  # off when asked
    assert SpecConfig(gamma=5).stop_confidence == 0.0  # a fixed gamma drafts gamma tokens
    assert SpecConfig(gamma=5, draft_confidence=0.4).stop_confidence == 0.4


def feed(policy, steps, accept_rate_fn, draft_cost, pass_cost):
    chosen = []
    for _ in range(steps):
        k = policy.choose(remaining=1000)
        accepted = accept_rate_fn(k)
        policy.observe([k], [accepted], k * draft_cost, pass_cost(k + 1))
        chosen.append(k)
    return chosen


def test_adaptive_falls_back_to_plain_and_probes_when_drafts_are_rejected():
    policy = AdaptiveGamma(max_gamma=8)
    chosen = feed(policy, 80, lambda k: 0, draft_cost=0.03, pass_cost=lambda m: 0.1 + 0.005 * m)
    tail = chosen[20:]
    assert tail.count(0) >= 0.8 * len(tail)  # mostly plain steps
    assert any(k > 0 for k in tail)  # but it keeps probing


def test_adaptive_drafts_long_when_everything_is_accepted_and_verification_is_flat():
    policy = AdaptiveGamma(max_gamma=8)
    chosen = feed(policy, 60, lambda k: k, draft_cost=0.01, pass_cost=lambda m: 0.1 + 0.002 * m)
    assert sum(chosen[-10:]) / 10 >= 6


def test_adaptive_drafts_short_when_verification_cost_grows_fast():
    policy = AdaptiveGamma(max_gamma=8)
    chosen = feed(policy, 60, lambda k: k, draft_cost=0.01, pass_cost=lambda m: 0.1 * m)
    assert max(chosen[-10:]) <= 2


def test_adaptive_drafts_long_when_acceptance_is_high_but_not_perfect():
    # 95% per position, a draft token a quarter of a flat target pass: the best length is 7-8.
    # (A prior that outweighed an observation kept untested-looking deep positions near it.)
    rng = random.Random(0)
    policy = AdaptiveGamma(max_gamma=8)
    chosen = feed(policy, 200, lambda k: next((i for i in range(k) if rng.random() > 0.95), k),
                  draft_cost=0.016, pass_cost=lambda m: 0.063 + 0.002 * m)
    assert sum(chosen[-100:]) / 100 >= 6, chosen[-100:]


def test_adaptive_stretches_past_a_position_that_stopped_paying_and_recovers():
    policy = AdaptiveGamma(max_gamma=8)
    flat = dict(draft_cost=0.016, pass_cost=lambda m: 0.063 + 0.002 * m)
    before = feed(policy, 60, lambda k: min(k, 3), **flat)  # position 3 (the fourth) always rejected
    assert 3 in before[-16:] and max(before[-16:]) <= 4  # three tokens (a stretch to four now and then)
    chosen = feed(policy, 150, lambda k: k, **flat)  # then everything is accepted
    assert sum(chosen[-20:]) / 20 >= 6, chosen[-40:]


def test_gamma_values_are_validated():
    with pytest.raises(SpecDecodeError):
        SpecConfig(gamma="sometimes")
    with pytest.raises(SpecDecodeError):
        SpecConfig(gamma=0)
    with pytest.raises(SpecDecodeError):
        SpecConfig(draft_confidence=1.5)
    assert SpecConfig(gamma="auto").adaptive and SpecConfig(gamma="4").gamma == 4


def test_deferred_start_pays_for_a_start_only_where_it_can_earn_it_back():
    policy = AdaptiveGamma(max_gamma=8)
    assert policy.start_after(100, 128) == 0  # nothing measured yet: start, and measure
    feed(policy, 40, lambda k: k, draft_cost=0.01, pass_cost=lambda m: 0.1 + 0.002 * m)  # drafting pays
    policy.started(100, 0.2)  # a draft prefill of 2 ms a context token
    assert policy.start_after(100, 128) == 0  # no short answers seen: start at once
    policy.finished(60)
    assert policy.start_after(100, 128) == 0
    break_even = math.ceil(0.2 / (0.1 + 0.002 - 1.0 / policy.best(8)[1]))
    assert 1 <= break_even < 60
    assert policy.start_after(100, break_even) == break_even  # a budget that cannot earn the start back: never
    policy.finished(1)  # an answer shorter than the break-even: the ski-rental deferral
    soon, later = policy.start_after(50, 128), policy.start_after(100, 128)
    assert 1 <= soon < later == break_even < policy.longest_deferral  # the start cost grows with the prompt
    for _ in range(policy.answer_lengths.maxlen):
        policy.finished(128)
    assert policy.start_after(100, 128) == 0  # the short answer has left the window
    policy.started(100, 200.0)
    assert policy.start_after(100, 128) == 128  # a start that costs too much never pays
    losing = AdaptiveGamma(max_gamma=8)
    feed(losing, 40, lambda k: 0, draft_cost=0.03, pass_cost=lambda m: 0.1 + 0.005 * m)
    losing.started(100, 0.01)
    assert losing.choose(remaining=1000) == 1  # a drafter that just started is probed at once
    # drafting does not pay: requests decode plainly, re-testing at once on every 2nd, 4th, 8th one
    starts = [losing.start_after(100, 128) for _ in range(30)]
    assert set(starts) == {0, 128}
    assert [i for i, s in enumerate(starts) if s == 0] == [0, 2, 6, 14, 22], starts
    feed(losing, 300, lambda k: k, draft_cost=0.001, pass_cost=lambda m: 0.1 + 0.002 * m)  # drafting pays again
    assert losing.retest_gap == 1 and losing.start_after(100, 128) == 0


def test_probe_gap_doubles_while_drafting_does_not_pay():
    policy = AdaptiveGamma(max_gamma=8)
    chosen = feed(policy, 300, lambda k: 0, draft_cost=0.03, pass_cost=lambda m: 0.1 + 0.005 * m)
    probes = [i for i, k in enumerate(chosen) if k > 0][1:]  # after the opening short draft
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[0] <= 2 * policy.probe_every + 1 and gaps[-1] > 4 * policy.probe_every, gaps
    policy.observe([1], [1], 0.001, 0.1)  # drafts start paying again: the gap resets
    for _ in range(20):
        policy.observe([2], [2], 0.002, 0.1)
    assert policy.choose(remaining=1000) > 0 and policy.probe_gap == 0


class CountingRunner(HFRunner):
    prefills = 0

    def prefill(self, ids, rows=None):
        CountingRunner.prefills += 1
        return super().prefill(ids, rows)


class StartsAfter(AdaptiveGamma):
    """The adaptive policy with a fixed deferral (the real one depends on measured times)."""

    def start_after(self, context_tokens, budget):
        return min(budget, 12)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_adaptive_defers_the_draft_prefill_and_stays_exact(pair, batch_size):
    from specdecode.engine import Request

    target, draft = pair
    plain = SpecEngine(HFRunner(target), None, SpecConfig())
    spec = SpecEngine(HFRunner(target), ModelDrafter(CountingRunner(draft)), SpecConfig(gamma="auto"))
    spec.policy = StartsAfter(max_gamma=8)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (1, n), generator=g) for n in (9, 5, 12, 7)]
    short = SamplingParams(max_new_tokens=12)
    CountingRunner.prefills = 0
    for prompt in prompts:  # answers no longer than the deferral: the draft model never runs
        assert [t for s in decode(spec, prompt, short) for t in s.tokens] == [t for s in decode(plain, prompt, short) for t in s.tokens]
    assert CountingRunner.prefills == 0
    assert list(spec.policy.answer_lengths) == [12] * 4  # the engine reports each answer's length
    params = SamplingParams(max_new_tokens=60)
    alone = [[t for s in decode(plain, p, params) for t in s.tokens] for p in prompts]
    requests = [Request(p[0].tolist(), 60, torch.Generator().manual_seed(0)) for p in prompts]
    got = {i: [] for i in range(len(prompts))}
    for step in spec.generate(requests, params, batch_size=batch_size):
        got[step.index].extend(step.tokens)
    assert [got[i] for i in range(len(prompts))] == alone
    assert CountingRunner.prefills > 0 and sum(r.stats.drafted_tokens for r in requests) > 0


def test_adaptive_drafts_at_a_batch_size_only_where_its_costs_say_it_pays():
    policy = AdaptiveGamma(max_gamma=8)
    assert policy.drafts_at(4)  # nothing measured at 4 rows: draft, and measure
    for _ in range(30):
        policy.observe([3], [1], 0.012, 0.065)  # one row: cheap drafts, a flat pass
        policy.observe([0], [0], 0.0, 0.065)
        policy.observe([3] * 4, [1] * 4, 0.05, 0.40)  # four rows: a wider pass costs more than it gives
        policy.observe([0] * 4, [0] * 4, 0.0, 0.09)
    assert policy.drafts_at(1) and not policy.drafts_at(4)
    assert FixedGamma(3).drafts_at(4)


class DraftsAlone(AdaptiveGamma):
    """The adaptive policy as measured costs would make it: drafting pays with one row only."""

    def drafts_at(self, rows):
        return rows == 1


def test_a_batch_where_drafting_does_not_pay_starts_no_drafter_until_it_shrinks(pair):
    from specdecode.engine import Request

    target, draft = pair
    plain = SpecEngine(HFRunner(target), None, SpecConfig())
    spec = SpecEngine(HFRunner(target), ModelDrafter(CountingRunner(draft)), SpecConfig(gamma="auto", lookup_fill=False))
    spec.policy = DraftsAlone(max_gamma=8)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, VOCAB, (1, n), generator=g)[0].tolist() for n in (9, 5)]
    params = SamplingParams(max_new_tokens=40)
    alone = [[t for s in decode(plain, torch.tensor([p]), params) for t in s.tokens] for p in prompts]
    requests = [Request(prompts[0], 40, torch.Generator().manual_seed(0)),
                Request(prompts[1], 10, torch.Generator().manual_seed(0))]  # ends first
    CountingRunner.prefills = 0
    got = {0: [], 1: []}
    for step in spec.generate(requests, params, batch_size=2):
        got[step.index].extend(step.tokens)
    assert got[0] == alone[0] and got[1] == alone[1][:10]
    assert requests[1].stats.drafted_tokens == 0  # it only ever ran beside the other
    assert CountingRunner.prefills == 1 and requests[0].stats.drafted_tokens > 0  # started once alone


class AlwaysDrafts(AdaptiveGamma):
    """The adaptive policy as measured costs would make it at every batch size: drafting pays."""

    def drafts_at(self, rows):
        return True

    def start_after(self, context_tokens, budget):
        return 0


@pytest.mark.parametrize("policy", ["adaptive", "fixed"])
def test_admission_first_keeps_draft_prefills_out_of_a_joining_requests_way(pair, policy):
    from specdecode.engine import Request

    target, draft = pair
    plain = SpecEngine(HFRunner(target), None, SpecConfig())
    spec = SpecEngine(HFRunner(target), ModelDrafter(CountingRunner(draft)), SpecConfig(gamma=3))
    if policy == "adaptive":
        spec.policy = AlwaysDrafts(max_gamma=3)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, VOCAB, (1, n), generator=g)[0].tolist() for n in (9, 5, 7)]
    params = SamplingParams(max_new_tokens=24)
    alone = [[t for s in decode(plain, torch.tensor([p]), params) for t in s.tokens] for p in prompts]
    requests = [Request(p, 24, torch.Generator().manual_seed(0)) for p in prompts]
    got = {i: [] for i in range(3)}

    def take(steps):
        for s in steps:
            got[s.index].extend(s.tokens)
        return len(steps)

    CountingRunner.prefills = 0
    batch = spec.batch(3, params)
    first = [take(batch.add(0, requests[0], defer_draft=True)), take(batch.add(1, requests[1], defer_draft=True))]
    starts_at_join = CountingRunner.prefills
    take(batch.step(hold_drafters=True))  # another request joins after this step
    after_held_step = CountingRunner.prefills
    first.append(take(batch.add(2, requests[2], defer_draft=True)))
    take(batch.step())
    after_free_step = CountingRunner.prefills
    while batch.active:
        take(batch.step())
    batch.close()
    assert [got[i] for i in range(3)] == alone  # greedy output is the same either way
    if policy == "fixed":  # a fixed schedule drafts the same in any batch: every drafter starts at its join
        assert first == [0, 0, 0]  # and the first tokens come with the batch's steps
        assert starts_at_join == 2 and after_held_step == 2 and after_free_step == 3
    else:  # the first token at the join; no draft prefill there nor in a held step; then one a step
        assert first == [1, 1, 1]
        assert starts_at_join == 0 and after_held_step == 0 and after_free_step == 1
        assert CountingRunner.prefills == 3 and all(r.stats.drafted_tokens > 0 for r in requests)


def test_a_start_cost_read_high_once_is_measured_again_and_corrected():
    policy = AdaptiveGamma(max_gamma=8)
    feed(policy, 40, lambda k: k, draft_cost=0.01, pass_cost=lambda m: 0.1 + 0.002 * m)  # drafting pays
    policy.started(100, 20.0)  # a cold first start: 200 ms a context token
    starts = [policy.start_after(100, 128) for _ in range(2 * LONGEST_RETEST_GAP)]
    assert [i for i, s in enumerate(starts) if s == 0] == [LONGEST_RETEST_GAP - 1, 2 * LONGEST_RETEST_GAP - 1]
    policy.started(100, 0.2)  # the re-test's start: 2 ms a token, which replaces the high reading
    assert policy.costs.start_cost == pytest.approx(0.002)
    assert policy.start_after(100, 128) == 0
    policy.started(100, 2.0)  # a reading above the estimate only moves it by the decay's share
    assert policy.costs.start_cost == pytest.approx(0.9 * 0.002 + 0.1 * 0.02)


def test_a_pass_where_some_rows_draft_is_costed_at_its_mean_tokens_a_row():
    from specdecode.costmodel import expected_tokens

    policy = AdaptiveGamma(max_gamma=8)
    for _ in range(20):
        policy.observe([0] * 8, [0] * 8, 0.0, 0.2)  # eight rows, plain: 8 tokens
        policy.observe([8] * 8, [8] * 8, 0.32, 1.0)  # all draft 8: 72 tokens
        policy.observe([8] + [0] * 7, [8] + [0] * 7, 0.04, 0.3)  # one drafts 8: 16 tokens, 2 a row
    assert sorted(policy.costs.passes[8]) == [1.0, 2.0, 9.0]
    assert policy.costs.knows_draft(1) and policy.costs.knows_draft(8)
    rates = policy.acceptance.rates()
    one = (7 + expected_tokens(rates, 8)) / (policy.costs.draft_seconds(8, 1) + policy.costs.pass_seconds(2.0, 8))
    k, rate = policy.best(8, rows=8, drafting=1)
    assert (k, rate) == (8, pytest.approx(one))  # the seven passengers' tokens count, at the pass's real width
    assert policy.choose([100], rows=8) == 8
    all_k, all_rate = policy.best(8, rows=8)
    assert all_rate == pytest.approx(max(8 / 0.2 / 8, expected_tokens(rates, all_k)
                                         / (policy.costs.draft_seconds(all_k, 8) + policy.costs.pass_seconds(1 + all_k, 8))))


def test_lookup_fill_drafts_lookups_on_plain_steps_and_keeps_greedy_output(pair):
    """Under the adaptive policy a step it makes plain drafts the context's prompt lookup; the
    draft model is never called for it and the output is plain decoding's."""
    target, draft = pair
    g = torch.Generator().manual_seed(3)
    motif = torch.randint(0, VOCAB, (6,), generator=g).tolist()
    prompt = torch.tensor([motif * 4])  # a repeating prompt: lookups find continuations
    params = SamplingParams(max_new_tokens=48)
    plain = [t for s in decode(SpecEngine(HFRunner(target), None, SpecConfig()), prompt, params) for t in s.tokens]
    outputs, drafted, proposals = {}, {}, []
    for fill in (True, False):
        engine = SpecEngine(HFRunner(target), ModelDrafter(HFRunner(draft)), SpecConfig(gamma="auto", lookup_fill=fill))
        engine.policy.choose = lambda remaining, rows=1: 0  # the model's drafts never pay
        engine.drafter.propose = lambda *a, **k: proposals.append(a)
        stats = GenerationStats()
        outputs[fill] = [t for s in decode(engine, prompt, params, stats=stats) for t in s.tokens]
        drafted[fill] = stats.drafted_tokens
    assert outputs[True] == outputs[False] == plain
    assert drafted[True] > 0 and drafted[False] == 0 and proposals == []
    # drafting with the model on every step: rows whose lookup is long enough draft it instead
    sampled = SamplingParams(max_new_tokens=48, temperature=0.8)
    seen = {}
    for fill in (True, False):
        engine = SpecEngine(HFRunner(target), ModelDrafter(HFRunner(draft)), SpecConfig(gamma="auto", lookup_fill=fill))
        first = iter([0])  # a plain step measures the pass, then the model drafts 3 every step
        engine.policy.choose = lambda remaining, rows=1, first=first: next(first, 3)
        engine.policy.start_after = lambda context_tokens, budget: 0
        stats = GenerationStats()
        greedy = [t for s in decode(engine, prompt, params, stats=stats) for t in s.tokens]
        assert greedy == plain
        lookups = engine.policy.lookup_acceptance.drafted[0]
        seen[fill] = (lookups, stats.drafted_tokens)
        assert len([t for s in decode(engine, prompt, sampled) for t in s.tokens]) == 48  # mixed sampled steps run
    assert seen[True][0] > 0 and seen[False][0] == 0 and seen[True][1] > 0
    assert SpecEngine(HFRunner(target), None, SpecConfig(gamma="auto")).lookup is None  # plain decoding stays plain
    assert SpecEngine(HFRunner(target), ModelDrafter(HFRunner(draft)), SpecConfig(gamma=3)).lookup is None  # a fixed gamma


def test_lookup_length_is_the_best_for_free_drafts_and_probes_when_none_pays():
    policy = AdaptiveGamma(max_gamma=8)
    assert policy.lookup_length([100]) == 0  # no pass measured yet
    for _ in range(30):
        policy.observe([0], [0], 0.0, 0.050)  # plain pass
        policy.observe([4], [4], 0.0, 0.060, lookups={0})  # four lookups, all kept, in a pass of five tokens
    assert policy.lookup_length([100]) >= 4 and policy.acceptance.rates()[0] == pytest.approx(0.6)  # the model's estimates untouched
    assert policy.lookup_length([2]) == 1  # the budget bounds it
    for _ in range(60):
        policy.observe([4], [0], 0.0, 0.060, lookups={0})  # now none is kept: a wider pass buys nothing
    lengths = [policy.lookup_length([100]) for _ in range(2 * policy.probe_every)]
    assert lengths == ([0] * (policy.probe_every - 1) + [1]) * 2  # plain, with a one-token probe now and then
