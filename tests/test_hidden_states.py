"""Runners return the hidden states a draft head reads, on every path, without changing the logits.

Glossary: *states* are a pass's residual-stream states at the asked hidden-state indices
(``runners.hf``): 0 the embedding, i after decoder layer i, the layer count the normed final state.
"""

import pytest
import torch

from specdecode.runners.factory import hf_runner
from specdecode.runners.hf import HFRunner
from specdecode.runners.int4 import prepare_int4
from specdecode.runners.int8 import prepare_int8
from specdecode.runners.lean import LeanForward

from helpers import tiny_model

LAYERS = (0, 1, 2)  # embedding, after layer 1, normed final (the tiny models have 2 layers)


def runners():
    for arch in ("llama", "qwen2", "gpt2"):
        yield pytest.param(lambda arch=arch: HFRunner(tiny_model(arch, seed=1)), 1e-10, id=arch)
    for arch in ("llama", "qwen2"):  # int8 and int4 with the lean fast path: exact
        yield pytest.param(lambda arch=arch: hf_runner(prepare_int8(tiny_model(arch, seed=1, dtype=torch.float32))), 0.0,
                           id=f"int8-{arch}")
        yield pytest.param(lambda arch=arch: hf_runner(prepare_int4(tiny_model(arch, seed=1, dtype=torch.float32))), 0.0,
                           id=f"int4-{arch}")


def _ids(n, vocab, seed):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("make, tol", list(runners()))
def test_states_of_prefill_equal_prefill_then_forward_and_logits_are_unchanged(make, tol):
    runner = make()
    ids = _ids(20, runner.vocab_size, 0)
    plain = runner.prefill(ids)  # [1, V]
    logits, states = runner.prefill(ids, return_hidden=LAYERS)
    assert states.shape == (1, 20, len(LAYERS), 32)
    assert torch.equal(logits, plain)
    runner.prefill(ids[:, :1])  # the same blocks without states: the same logits, bit for bit
    runner.forward(ids[:, 1:13])
    plain_rest = runner.forward(ids[:, 13:])  # [1, 7, V]
    runner.prefill(ids[:, :1])
    _, head = runner.forward(ids[:, 1:13], return_hidden=LAYERS)
    rest_logits, rest = runner.forward(ids[:, 13:], return_hidden=LAYERS)
    assert torch.equal(rest_logits, plain_rest)
    assert torch.allclose(torch.cat([head, rest], dim=1), states[:, 1:], atol=tol, rtol=0)


@pytest.mark.parametrize("make, tol", list(runners()))
def test_ragged_batch_states_equal_each_row_alone(make, tol):
    runner = make()
    prompts = [_ids(9, runner.vocab_size, 1), _ids(5, runner.vocab_size, 2)]
    block = torch.cat([_ids(4, runner.vocab_size, 3), _ids(4, runner.vocab_size, 4)])  # [2, 4]
    counts = [4, 2]
    alone = []
    for prompt, new, count in zip(prompts, block, counts):
        runner.prefill(prompt)
        alone.append(runner.forward(new[None, :count], return_hidden=LAYERS)[1][0])  # [count, L, H]
    runner.reset(2)
    for row, prompt in enumerate(prompts):
        runner.prefill(prompt, rows=[row])
    _, states = runner.forward(block, counts=counts, return_hidden=LAYERS)  # [2, 4, L, H]
    for j, count in enumerate(counts):
        assert torch.allclose(states[j, :count], alone[j], atol=tol, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lean_states_are_bit_identical_to_the_module_path(arch):
    model = prepare_int8(tiny_model(arch, seed=3, dtype=torch.float32))
    assert LeanForward.supports(model)
    ids = _ids(12, model.config.vocab_size, 5)
    out = []
    for runner in (HFRunner(model, fast=LeanForward(model)), HFRunner(model, fast=None)):
        runner.prefill(ids[:, :6])
        out.append(runner.forward(ids[:, 6:], return_hidden=LAYERS))
    assert torch.equal(out[0][0], out[1][0])
    assert torch.equal(out[0][1], out[1][1])


def test_the_last_index_is_what_the_output_head_reads():
    model = tiny_model("qwen2", seed=2)
    runner = HFRunner(model)
    logits, states = runner.forward(_ids(7, 96, 6), return_hidden=(model.config.num_hidden_layers,))
    with torch.inference_mode():
        assert torch.allclose(model.lm_head(states[:, :, 0]), logits, atol=1e-12, rtol=0)
