"""Greedy speculative decoding is token-identical to the target's own greedy decode."""

import pytest
import torch

from specdecode.config import SamplingParams, SpecConfig
from specdecode.drafters import ModelDrafter
from specdecode.engine import SpecEngine
from specdecode.stats import GenerationStats
from specdecode.runners.hf import HFRunner

from helpers import perturbed, tiny_model, decode

NEW_TOKENS = 64
N_PROMPTS = 32
VOCAB = 96
GAMMAS = (1, 2, 3, 5, 8)


def prompts():
    g = torch.Generator().manual_seed(123)
    return [torch.randint(0, VOCAB, (1, int(torch.randint(1, 24, (1,), generator=g))), generator=g) for _ in range(N_PROMPTS)]


def run(engine, prompt, params=SamplingParams(max_new_tokens=NEW_TOKENS)):
    stats = GenerationStats()
    tokens = [t for step in decode(engine, prompt, params, stats=stats) for t in step.tokens]
    return tokens, stats


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def setup(request):
    target = tiny_model(request.param, seed=7, vocab_size=VOCAB)
    related = perturbed(target, 0.03, seed=8)
    unrelated = tiny_model(request.param, seed=99, vocab_size=VOCAB)
    ps = prompts()
    plain = SpecEngine(HFRunner(target), None, SpecConfig())
    reference = [run(plain, p)[0] for p in ps]
    return target, related, unrelated, ps, reference


def test_plain_decoding_matches_transformers_generate(setup):
    target, _, _, ps, reference = setup
    for p, ref in zip(ps, reference):
        out = target.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert out[0, p.shape[1]:].tolist() == ref


@pytest.mark.parametrize("gamma", GAMMAS)
def test_speculative_greedy_matches_plain(setup, gamma):
    target, related, _, ps, reference = setup
    engine = SpecEngine(HFRunner(target), ModelDrafter(HFRunner(related)), SpecConfig(gamma=gamma))
    accepted = drafted = 0
    for p, ref in zip(ps, reference):
        tokens, stats = run(engine, p)
        assert tokens == ref
        assert stats.new_tokens == NEW_TOKENS
        accepted += stats.accepted_tokens
        drafted += stats.drafted_tokens
    # the perturbed draft is neither perfect nor useless, so both branches of verify ran
    assert 0.05 < accepted / drafted < 0.98


@pytest.mark.parametrize("gamma", (1, 3, 8))
def test_draft_equal_to_target_accepts_everything(setup, gamma):
    target, _, _, ps, reference = setup
    engine = SpecEngine(HFRunner(target), ModelDrafter(HFRunner(target)), SpecConfig(gamma=gamma))
    for p, ref in list(zip(ps, reference))[:8]:
        tokens, stats = run(engine, p)
        assert tokens == ref
        assert stats.accepted_tokens == stats.drafted_tokens > 0
        assert stats.target_forwards == -(-NEW_TOKENS // (gamma + 1))


@pytest.mark.parametrize("gamma", (2, 5))
def test_unrelated_draft_still_identical(setup, gamma):
    target, _, unrelated, ps, reference = setup
    engine = SpecEngine(HFRunner(target), ModelDrafter(HFRunner(unrelated)), SpecConfig(gamma=gamma))
    for p, ref in list(zip(ps, reference))[:12]:
        assert run(engine, p)[0] == ref
