"""Stops inside a block, token budgets mid-draft, seeding, and cache state after every step."""

import pytest
import torch

from specdecode.config import SamplingParams, SpecConfig
from specdecode.drafters import ModelDrafter
from specdecode.engine import SpecEngine
from specdecode.stats import GenerationStats
from specdecode.runners.hf import HFRunner

from helpers import perturbed, tiny_model, decode

VOCAB = 96


@pytest.fixture(scope="module")
def models():
    target = tiny_model("llama", seed=3, vocab_size=VOCAB)
    return target, perturbed(target, 0.03, seed=4)


def tokens_of(engine, prompt, params, eos=(), generator=None):
    stats = GenerationStats()
    steps = list(decode(engine, prompt, params, eos_ids=eos, generator=generator, stats=stats))
    return [t for s in steps for t in s.tokens], steps, stats


PROMPT = torch.tensor([[5, 17, 42, 8, 61]])


def test_eos_inside_an_accepted_block_ends_there(models):
    target, _ = models
    plain = SpecEngine(HFRunner(target), None, SpecConfig())
    ref, _, _ = tokens_of(plain, PROMPT, SamplingParams(max_new_tokens=40))
    cut = next(i for i in range(6, 40) if ref[i] not in ref[:i])
    eos = [ref[cut]]
    # a draft equal to the target accepts everything, so the EOS arrives mid-block
    spec = SpecEngine(HFRunner(target), ModelDrafter(HFRunner(target)), SpecConfig(gamma=5))
    out, steps, stats = tokens_of(spec, PROMPT, SamplingParams(max_new_tokens=40), eos=eos)
    assert out == ref[: cut + 1]
    assert steps[-1].finish_reason == "stop" and stats.new_tokens == cut + 1
    assert tokens_of(plain, PROMPT, SamplingParams(max_new_tokens=40), eos=eos)[0] == out


@pytest.mark.parametrize("budget", [1, 2, 5, 6, 7, 11, 13])
def test_max_new_tokens_mid_draft_is_exact(models, budget):
    target, draft = models
    plain = SpecEngine(HFRunner(target), None, SpecConfig())
    ref, _, _ = tokens_of(plain, PROMPT, SamplingParams(max_new_tokens=budget))
    for drafter_model in (target, draft):
        spec = SpecEngine(HFRunner(target), ModelDrafter(HFRunner(drafter_model)), SpecConfig(gamma=5))
        out, steps, stats = tokens_of(spec, PROMPT, SamplingParams(max_new_tokens=budget))
        assert out == ref and len(out) == budget
        assert steps[-1].finish_reason == "length" and stats.new_tokens == budget


def test_same_seed_same_output_and_seeds_matter(models):
    target, draft = models
    spec = SpecEngine(HFRunner(target), ModelDrafter(HFRunner(draft)), SpecConfig(gamma=4))
    params = SamplingParams(temperature=1.0, max_new_tokens=30, seed=1234)
    first = tokens_of(spec, PROMPT, params)[0]
    assert tokens_of(spec, PROMPT, params)[0] == first
    others = {tuple(tokens_of(spec, PROMPT, SamplingParams(temperature=1.0, max_new_tokens=30, seed=s))[0]) for s in range(5)}
    assert len(others) > 1


def cache_keys(runner):
    """Each layer's keys in the slots the row holds (slots past its length are stale by design)."""
    length = int(runner.lengths[0])
    return [layer.keys[:, :, :length] for layer in runner.cache.layers]


def assert_cache_holds(runner, model, tokens):
    """The runner's cache equals a fresh prefill of exactly these tokens."""
    assert runner.lengths.tolist() == [len(tokens)]
    fresh = HFRunner(model)
    fresh.prefill(torch.tensor([tokens]))
    for mine, ref in zip(cache_keys(runner), cache_keys(fresh)):
        assert mine.shape == ref.shape
        assert torch.allclose(mine, ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_hold_exactly_the_committed_tokens_after_every_step(models, temperature):
    target, draft = models
    target_runner, draft_runner = HFRunner(target), HFRunner(draft)
    spec = SpecEngine(target_runner, ModelDrafter(draft_runner), SpecConfig(gamma=4))
    committed = PROMPT[0].tolist()
    rejected_steps = 0
    for step in decode(spec, PROMPT, SamplingParams(temperature=temperature, max_new_tokens=30, seed=9)):
        committed += step.tokens
        if step.finish_reason is not None:
            break
        # the target holds everything but the pending (last) token
        assert_cache_holds(target_runner, target, committed[:-1])
        # the draft holds a prefix of the committed tokens, never a rejected draft
        n = int(draft_runner.lengths[0])
        assert n <= len(committed)
        assert_cache_holds(draft_runner, draft, committed[:n])
        rejected_steps += len(step.tokens) < 5
    assert rejected_steps > 0


def test_prompt_plus_budget_beyond_context_is_a_clear_error(models):
    from specdecode.errors import SpecDecodeError

    target, _ = models
    spec = SpecEngine(HFRunner(target), None, SpecConfig())
    with pytest.raises(SpecDecodeError, match="exceeds the target's context of 256"):
        list(decode(spec, torch.zeros((1, 250), dtype=torch.long), SamplingParams(max_new_tokens=10)))


def test_vocabulary_mismatch_is_refused(models):
    from specdecode.errors import SpecDecodeError

    target, _ = models
    other = tiny_model("llama", seed=5, vocab_size=VOCAB + 4)
    with pytest.raises(SpecDecodeError, match="vocabularies differ"):
        SpecEngine(HFRunner(target), ModelDrafter(HFRunner(other)), SpecConfig())
