"""Hybrid drafting, adaptive draft length and confidence stops: exact, and the policy's choices."""

import pytest
import torch

from specdecode.config import SamplingParams, SpecConfig
from specdecode.drafters import ModelDrafter
from specdecode.drafters.hybrid import HybridDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.engine import GenerationStats, SpecEngine
from specdecode.errors import SpecDecodeError
from specdecode.policy import AdaptiveGamma
from specdecode.runners.hf import HFRunner

from helpers import perturbed, tiny_model

VOCAB = 48


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", seed=51, vocab_size=VOCAB, init=0.8)
    return target, perturbed(target, 0.03, seed=52)


def drafters(target, draft):
    return {
        "hybrid": lambda: HybridDrafter(ModelDrafter(HFRunner(draft)), NgramDrafter(VOCAB), min_lookup=2),
        "confidence": lambda: ModelDrafter(HFRunner(draft), min_confidence=0.5),
        "model": lambda: ModelDrafter(HFRunner(draft)),
    }


@pytest.mark.parametrize("kind", ["hybrid", "confidence", "model"])
@pytest.mark.parametrize("gamma", [3, "auto"])
def test_greedy_identity(pair, kind, gamma):
    target, draft = pair
    plain = SpecEngine(HFRunner(target), None, SpecConfig())
    spec = SpecEngine(HFRunner(target), drafters(target, draft)[kind](), SpecConfig(gamma=gamma))
    g = torch.Generator().manual_seed(2)
    drafted = 0
    for _ in range(10):
        base = torch.randint(0, VOCAB, (1, 5), generator=g)
        prompt = torch.cat([base, base, base[:, :2]], dim=1)
        params = SamplingParams(max_new_tokens=40)
        stats = GenerationStats()
        out = [t for s in spec.generate(prompt, params, stats=stats) for t in s.tokens]
        assert out == [t for s in plain.generate(prompt, params) for t in s.tokens]
        drafted += stats.drafted_tokens
    assert drafted > 0


def test_hybrid_uses_both_sources(pair):
    target, draft = pair
    hybrid = drafters(target, draft)["hybrid"]()
    spec = SpecEngine(HFRunner(target), hybrid, SpecConfig(gamma=4))
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2]])
    list(spec.generate(prompt, SamplingParams(max_new_tokens=40)))
    assert hybrid.lookup_steps > 0 and hybrid.model_steps > 0


def test_confidence_stop_shortens_drafts(pair):
    target, draft = pair
    stats_all, stats_conf = GenerationStats(), GenerationStats()
    prompt = torch.tensor([[3, 9, 27, 1]])
    for drafter, stats in ((ModelDrafter(HFRunner(draft)), stats_all), (ModelDrafter(HFRunner(draft), min_confidence=0.9), stats_conf)):
        list(SpecEngine(HFRunner(target), drafter, SpecConfig(gamma=6)).generate(prompt, SamplingParams(max_new_tokens=40), stats=stats))
    assert stats_conf.drafted_tokens / stats_conf.target_forwards < stats_all.drafted_tokens / stats_all.target_forwards


def feed(policy, steps, accept_rate_fn, draft_cost, pass_cost):
    chosen = []
    for _ in range(steps):
        k = policy.choose(remaining=1000)
        accepted = accept_rate_fn(k)
        policy.update(k, accepted, k * draft_cost, pass_cost(k + 1))
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


def test_gamma_values_are_validated():
    with pytest.raises(SpecDecodeError):
        SpecConfig(gamma="sometimes")
    with pytest.raises(SpecDecodeError):
        SpecConfig(gamma=0)
    with pytest.raises(SpecDecodeError):
        SpecConfig(draft_confidence=1.5)
    assert SpecConfig(gamma="auto").adaptive and SpecConfig(gamma="4").gamma == 4
