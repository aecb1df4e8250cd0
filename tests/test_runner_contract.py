"""The Runner contract on tiny float64 models of several architectures."""

import pytest
import torch

from specdecode.runners.hf import HFRunner

from helpers import ARCHS, TableRunner, tiny_model

TOL = 1e-10


def runners():
    for arch in ARCHS:
        yield pytest.param(lambda arch=arch: HFRunner(tiny_model(arch, seed=1)), id=arch)
    yield pytest.param(lambda: TableRunner(12, seed=0), id="table")


@pytest.fixture(params=list(runners()))
def runner(request):
    return request.param()


def _ids(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, n), generator=g)


def test_prefill_equals_prefill_then_forward(runner):
    ids = _ids(20, runner.vocab_size, 0)
    whole = runner.prefill(ids)  # [1, V]
    assert whole.shape == (1, runner.vocab_size)
    runner.prefill(ids[:, :13])
    pieces = runner.forward(ids[:, 13:])  # [1, 7, V]
    assert pieces.shape == (1, 7, runner.vocab_size)
    assert torch.allclose(pieces[:, -1], whole, atol=TOL, rtol=0)
    assert runner.lengths.tolist() == [20]


def test_forward_logits_match_a_fresh_pass_at_every_position(runner):
    ids = _ids(18, runner.vocab_size, 1)
    runner.prefill(ids[:, :1])
    full = runner.forward(ids[:, 1:])  # logits after tokens 1..17
    for cut in (2, 9, 17):
        runner.prefill(ids[:, :cut])
        assert torch.allclose(runner.forward(ids[:, cut:cut + 1])[:, 0], full[:, cut - 1], atol=TOL, rtol=0)


def test_truncate_then_forward_equals_fresh_pass(runner):
    ids = _ids(24, runner.vocab_size, 2)
    other = _ids(6, runner.vocab_size, 3)
    runner.prefill(ids[:, :16])
    runner.forward(other)  # tokens that will be rolled back
    runner.truncate(torch.tensor([12]))
    assert runner.lengths.tolist() == [12]
    after = runner.forward(ids[:, 12:24])
    runner.prefill(ids[:, :12])
    fresh = runner.forward(ids[:, 12:24])
    assert torch.allclose(after, fresh, atol=TOL, rtol=0)


def test_truncate_rejects_growing(runner):
    runner.prefill(_ids(5, runner.vocab_size, 4))
    with pytest.raises(ValueError):
        runner.truncate(torch.tensor([9]))
