"""The one-step acceptance rule reproduces the target distribution in closed form."""

import pytest
import torch

from specdecode.config import SamplingParams
from specdecode.sampling import processed_probs
from specdecode.verify import acceptance_probability, residual_distribution, verify


def implied_output(target_probs, draft_probs):
    """Distribution of the token one step emits: accepted draft, else a residual draw. [V] -> [V]"""
    drawn = draft_probs > 0
    accept = torch.zeros_like(target_probs)
    accept[drawn] = acceptance_probability(target_probs[drawn], draft_probs[drawn])
    accepted_mass = draft_probs * accept  # P(draft x and accept it)
    residual = residual_distribution(target_probs, draft_probs)
    assert torch.isfinite(residual).all()
    return accepted_mass + (1 - accepted_mass.sum()) * residual


def random_dist(v, g, zeros=0):
    x = torch.rand(v, generator=g, dtype=torch.float64) ** 3
    if zeros:
        x[torch.randperm(v, generator=g)[: min(zeros, v - 1)]] = 0
    return x / x.sum()


@pytest.mark.parametrize("seed", range(50))
def test_random_distributions(seed):
    g = torch.Generator().manual_seed(seed)
    v = int(torch.randint(2, 40, (1,), generator=g))
    target = random_dist(v, g, zeros=seed % 3)
    draft = random_dist(v, g, zeros=(seed // 3) % 3)
    assert torch.allclose(implied_output(target, draft), target, atol=1e-12, rtol=0)


def test_equal_distributions_accept_everything_and_have_no_nan():
    target = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    assert torch.equal(acceptance_probability(target, target.clone()), torch.ones(3, dtype=torch.float64))
    residual = residual_distribution(target, target.clone())
    assert torch.isfinite(residual).all() and torch.isclose(residual.sum(), torch.tensor(1.0, dtype=torch.float64))
    assert torch.allclose(implied_output(target, target.clone()), target, atol=1e-15)


def test_disjoint_supports_reject_always_and_resample_target():
    target = torch.tensor([0.6, 0.4, 0.0, 0.0], dtype=torch.float64)
    draft = torch.tensor([0.0, 0.0, 0.3, 0.7], dtype=torch.float64)
    assert torch.equal(acceptance_probability(target[2:], draft[2:]), torch.zeros(2, dtype=torch.float64))
    assert torch.allclose(residual_distribution(target, draft), target)
    assert torch.allclose(implied_output(target, draft), target, atol=1e-15)


@pytest.mark.parametrize("token", [0, 2, 4])
def test_one_hot_draft(token):
    target = torch.tensor([0.1, 0.2, 0.3, 0.0, 0.4], dtype=torch.float64)
    draft = torch.nn.functional.one_hot(torch.tensor(token), 5).to(torch.float64)
    assert torch.allclose(implied_output(target, draft), target, atol=1e-15)


def test_target_zero_where_draft_positive():
    target = torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64)
    draft = torch.tensor([0.8, 0.1, 0.1], dtype=torch.float64)
    assert acceptance_probability(target[:1], draft[:1]).item() == 0.0
    out = implied_output(target, draft)
    assert out[0].item() == 0.0 and torch.allclose(out, target, atol=1e-15)


def test_verify_greedy_takes_longest_agreeing_prefix_and_target_token():
    logits = torch.full((2, 4, 6), -1.0, dtype=torch.float64)
    target_argmax = torch.tensor([[3, 1, 4, 5], [2, 2, 0, 1]])
    logits.scatter_(-1, target_argmax[..., None], 1.0)
    drafts = torch.tensor([[3, 1, 0], [2, 2, 0]])
    out = verify(drafts, None, logits, SamplingParams(), [torch.Generator()] * 2)
    assert out.num_accepted.tolist() == [2, 3]
    assert out.next_tokens.tolist() == [4, 1]  # replacement for row 0, bonus for row 1


def test_verify_one_hot_draft_never_accepts_a_token_the_target_excludes():
    target_logits = torch.tensor([[[0.0, 0.0, -float("inf")], [0.0, 1.0, 2.0]]], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        out = verify(torch.tensor([[2]]), None, target_logits, SamplingParams(temperature=1.0), [g])
        assert out.num_accepted.item() == 0 and out.next_tokens.item() in (0, 1)


def test_processed_probs_top_k_top_p_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]], dtype=torch.float64)
    hot = processed_probs(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(hot, torch.softmax(logits / 0.5, -1))
    top2 = processed_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (top2[0, 2:] == 0).all() and torch.allclose(top2[0, :2], torch.softmax(logits[0, :2], -1))
    probs = torch.softmax(logits, -1)[0]
    nucleus = processed_probs(logits, SamplingParams(temperature=1.0, top_p=float(probs[0] + 0.01)))
    assert (nucleus[0] > 0).tolist() == [True, True, False, False, False]
    assert torch.allclose(nucleus.sum(-1), torch.ones(1, dtype=torch.float64))
    only_top = processed_probs(logits, SamplingParams(temperature=1.0, top_p=1e-9))
    assert only_top[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
