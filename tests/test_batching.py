"""Batched speculative decoding: every row exactly as if it ran alone.

Rows of different prompt lengths share one batched target pass per step, accept different
numbers of drafts, finish at different times (their slots refilled from the queue) and keep
their own random streams.
"""

import pytest
import torch

from specdecode.config import SamplingParams, SpecConfig
from specdecode.drafters import ModelDrafter
from specdecode.drafters.hybrid import HybridDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.engine import Request, SpecEngine
from specdecode.stats import BatchStats
from specdecode.runners.factory import hf_runner
from specdecode.runners.hf import HFRunner
from specdecode.runners.int8 import int8_available, prepare_int8
from specdecode.sampling import processed_probs, sample
from specdecode.verify import VerifyResult

from helpers import perturbed, tiny_model, decode
from test_sampling_statistics import (
    GAMMA, P_VALUE_FLOOR, PROMPT, SAMPLES, VOCAB as TABLE_VOCAB, WINDOW, compare, exact_joint, make_pair,
)

VOCAB = 96


def mixed_prompts(n: int, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def budgets(n: int) -> list[int]:
    return [20 + (7 * i) % 23 for i in range(n)]  # rows finish at different steps


def run_batch(engine, prompts, params, batch_size, max_new=None, seeds=None, eos=()):
    max_new = max_new or [params.max_new_tokens] * len(prompts)
    requests = [
        Request(p, m, torch.Generator().manual_seed(seeds[i] if seeds else 0))
        for i, (p, m) in enumerate(zip(prompts, max_new))
    ]
    out = [[] for _ in prompts]
    finish = [None] * len(prompts)
    stats = BatchStats()
    for step in engine.generate(requests, params, eos, batch_size=batch_size, stats=stats):
        assert finish[step.index] is None, "a finished row produced more tokens"
        out[step.index].extend(step.tokens)
        finish[step.index] = step.finish_reason
    return out, finish, requests, stats


def run_alone(engine, prompt, params, max_new, seed=0, eos=()):
    p = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, max_new_tokens=max_new)
    g = torch.Generator().manual_seed(seed)
    return [t for s in decode(engine, torch.tensor([prompt]), p, eos_ids=eos, generator=g) for t in s.tokens]


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", seed=7, vocab_size=VOCAB)
    return target, perturbed(target, 0.03, seed=8)


@pytest.fixture(scope="module")
def greedy_reference(pair):
    target, _ = pair
    prompts = mixed_prompts(8)
    plain = SpecEngine(HFRunner(target), None, SpecConfig())
    return prompts, [run_alone(plain, p, SamplingParams(), m) for p, m in zip(prompts, budgets(8))]


@pytest.mark.parametrize("batch_size", [2, 3, 8])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_rows_equal_plain_greedy_alone(pair, greedy_reference, batch_size, gamma):
    target, draft = pair
    prompts, reference = greedy_reference
    params = SamplingParams()
    spec = SpecEngine(HFRunner(target), ModelDrafter(HFRunner(draft)), SpecConfig(gamma=gamma))
    out, finish, requests, stats = run_batch(spec, prompts, params, batch_size, budgets(8))
    assert out == reference
    assert finish == ["length"] * 8
    assert stats.batch_size == batch_size and stats.new_tokens == sum(budgets(8))
    assert 1 < stats.rows_per_forward <= batch_size  # rows really shared passes
    alone = [run_alone(spec, p, params, m) for p, m in zip(prompts[:3], budgets(3))]
    assert alone == reference[:3]
    # ragged acceptance really happened: rows accepted different numbers of drafts
    assert len({r.stats.acceptance_rate for r in requests}) > 1


def test_batched_plain_decoding_equals_alone(pair, greedy_reference):
    target, _ = pair
    prompts, reference = greedy_reference
    plain = SpecEngine(HFRunner(target), None, SpecConfig())
    out, _, _, stats = run_batch(plain, prompts, SamplingParams(), 4, budgets(8))
    assert out == reference and stats.target_forwards < sum(budgets(8))


@pytest.mark.parametrize("kind", ["ngram", "hybrid", "confidence", "auto"])
def test_other_drafters_in_a_batch_stay_exact(pair, greedy_reference, kind):
    target, draft = pair
    prompts, reference = greedy_reference
    prompts = [p + p[:6] for p in prompts]  # repeats, so lookups fire
    plain = SpecEngine(HFRunner(target), None, SpecConfig())
    reference = [run_alone(plain, p, SamplingParams(), m) for p, m in zip(prompts, budgets(8))]
    config = SpecConfig(gamma="auto") if kind == "auto" else SpecConfig(gamma=4, draft_confidence=0.5 if kind == "confidence" else None)
    if kind == "ngram":
        drafter = NgramDrafter(VOCAB, max_n=3)
    elif kind == "hybrid":
        drafter = HybridDrafter(ModelDrafter(HFRunner(draft)), NgramDrafter(VOCAB, max_n=3), min_lookup=2)
    else:
        drafter = ModelDrafter(HFRunner(draft))
    out, _, _, _ = run_batch(SpecEngine(HFRunner(target), drafter, config), prompts, SamplingParams(), 3, budgets(8))
    assert out == reference


def test_eos_in_one_row_mid_block_leaves_the_others_alone(pair):
    target, _ = pair
    prompts = mixed_prompts(4, seed=9)
    plain = SpecEngine(HFRunner(target), None, SpecConfig())
    free = [run_alone(plain, p, SamplingParams(), 30) for p in prompts]
    cut = next(i for i in range(5, 30) if free[0][i] not in free[0][:i] and all(free[0][i] not in f for f in free[1:]))
    eos = [free[0][cut]]
    # a draft equal to the target accepts everything, so row 0's EOS arrives inside a block
    spec = SpecEngine(HFRunner(target), ModelDrafter(HFRunner(target)), SpecConfig(gamma=5))
    out, finish, requests, _ = run_batch(spec, prompts, SamplingParams(), 4, [30] * 4, eos=eos)
    assert out[0] == free[0][: cut + 1] and finish[0] == "stop"
    assert (cut + 1) % 6 != 0  # the EOS was not the last token of a block
    assert out[1:] == free[1:] and finish[1:] == ["length"] * 3
    assert requests[0].stats.new_tokens == cut + 1


def test_more_prompts_than_slots_refill_and_cancel(pair, greedy_reference):
    target, draft = pair
    prompts, reference = greedy_reference
    spec = SpecEngine(HFRunner(target), ModelDrafter(HFRunner(draft)), SpecConfig(gamma=3))
    requests = [Request(p, m, torch.Generator().manual_seed(0)) for p, m in zip(prompts, budgets(8))]
    out = [[] for _ in prompts]
    stats = BatchStats()
    for step in spec.generate(requests, SamplingParams(), batch_size=2, stats=stats):
        out[step.index].extend(step.tokens)
        if step.index == 1 and len(out[1]) >= 5:
            requests[1].cancelled = True  # e.g. a stop string was seen: the slot frees up
    assert out[0] == reference[0] and out[2:] == reference[2:]
    assert out[1] == reference[1][: len(out[1])] and len(out[1]) < len(reference[1])
    assert stats.rows_per_forward > 1.5


def test_a_seeded_row_is_the_same_alone_or_in_any_batch(pair):
    target, draft = pair
    params = SamplingParams(temperature=1.0, max_new_tokens=24)
    spec = SpecEngine(HFRunner(target), ModelDrafter(HFRunner(draft)), SpecConfig(gamma=4))
    prompts = mixed_prompts(8, seed=21)
    alone = run_alone(spec, prompts[0], params, 24, seed=77)
    for batch_size in (3, 8):
        order = list(range(8)) if batch_size == 8 else [5, 0, 2, 7, 1, 3, 4, 6]
        seeds = [77 if i == 0 else 1000 + i for i in order]
        out, _, _, _ = run_batch(spec, [prompts[i] for i in order], params, batch_size, [24] * 8, seeds=seeds)
        assert out[order.index(0)] == alone
    other = run_alone(spec, prompts[0], params, 24, seed=78)
    assert other != alone  # the seed matters


@pytest.mark.skipif(not int8_available(), reason="this torch build has no fbgemm engine")
def test_int8_rows_are_bit_identical_alone_and_batched():
    import copy

    model = prepare_int8(tiny_model("qwen2", seed=3, vocab_size=VOCAB, dtype=torch.float32))
    runner, alone = hf_runner(model), hf_runner(copy.deepcopy(model))  # the lean loop where it applies
    prompts = mixed_prompts(3, seed=4)
    runner.reset(3)
    for row, p in enumerate(prompts):
        runner.prefill(torch.tensor([p]), rows=[row])
    block = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(1))
    counts = [5, 2, 4]
    batched = runner.forward(block, counts=counts)
    for row, p in enumerate(prompts):
        alone.prefill(torch.tensor([p]))
        single = alone.forward(block[row : row + 1, : counts[row]])
        assert torch.equal(batched[row, : counts[row]], single[0])
    assert runner.lengths.tolist() == [len(p) + c for p, c in zip(prompts, counts)]
    # a row that skips a step (finished rows drop out) is untouched
    later = runner.forward(block[:2, :1], rows=[0, 2])
    alone.prefill(torch.tensor([prompts[2] + block[2, :4].tolist()]))
    assert torch.equal(later[1], alone.forward(block[1:2, :1])[0])
    assert runner.lengths.tolist() == [len(prompts[0]) + 6, len(prompts[1]) + 2, len(prompts[2]) + 5]
    # ragged blocks run packed (no padding computed); the unpacked padded pass gives the same bits
    assert runner._packs()
    padded = HFRunner(copy.deepcopy(model))
    padded._packs = lambda: False
    padded.reset(3)
    for row, p in enumerate(prompts):
        padded.prefill(torch.tensor([p]), rows=[row])
    unpacked = padded.forward(block, counts=counts)
    for row, c in enumerate(counts):
        assert torch.equal(unpacked[row, :c], batched[row, :c])


@pytest.mark.skipif(not int8_available(), reason="this torch build has no fbgemm engine")
def test_int8_greedy_batch_equals_plain_alone():
    target = prepare_int8(tiny_model("qwen2", seed=3, vocab_size=VOCAB, dtype=torch.float32, init=0.1))
    draft = prepare_int8(perturbed(tiny_model("qwen2", seed=3, vocab_size=VOCAB, dtype=torch.float32, init=0.1), 0.02, seed=5))
    prompts = mixed_prompts(5, seed=6)
    plain = SpecEngine(HFRunner(target), None, SpecConfig())
    reference = [run_alone(plain, p, SamplingParams(), 32) for p in prompts]
    spec = SpecEngine(HFRunner(target), ModelDrafter(HFRunner(draft)), SpecConfig(gamma=4))
    out, _, requests, _ = run_batch(spec, prompts, SamplingParams(), 3, [32] * 5)
    assert out == reference
    assert sum(r.stats.accepted_tokens for r in requests) > 0


# -- the statistical test, for a row inside a batch --------------------------------------------


OTHERS = [[2], [0, 1, 2, 3, 1, 0, 2], [3, 3], [1, 0, 2, 2, 0]]


def sample_rows_in_batches(engine, params, n):
    """n requests of PROMPT interleaved with other prompts and budgets, 4 slots, refilled as rows
    finish: each PROMPT row runs beside rows of other lengths at other positions."""
    requests, tested = [], []
    for seed in range(n):
        tested.append(len(requests))
        requests.append(Request(PROMPT, WINDOW, torch.Generator().manual_seed(seed)))
        other = OTHERS[seed % len(OTHERS)]
        requests.append(Request(other, 1 + seed % 7, torch.Generator().manual_seed(10**6 + seed)))
    out = [[] for _ in requests]
    for step in engine.generate(requests, params, batch_size=4):
        out[step.index].extend(step.tokens)
    counts = {}
    for i in tested:
        assert len(out[i]) == WINDOW
        counts[tuple(out[i])] = counts.get(tuple(out[i]), 0) + 1
    return counts


def test_a_row_inside_a_batch_samples_the_target_joint():
    params = SamplingParams(temperature=1.0, max_new_tokens=WINDOW)
    target, draft = make_pair()
    engine = SpecEngine(target, ModelDrafter(draft), SpecConfig(gamma=GAMMA, draft_confidence=0.3))
    tv, threshold, p_value, outside = compare(exact_joint(target, params), sample_rows_in_batches(engine, params, SAMPLES), SAMPLES)
    assert outside == 0 and tv < threshold and p_value > P_VALUE_FLOOR, (tv, threshold, p_value)


def accept_every_real_draft(draft_tokens, draft_probs, target_logits, params, generators, draft_lengths=None):
    lengths = draft_lengths or [draft_tokens.shape[1]] * draft_tokens.shape[0]
    bonus = torch.stack([sample(processed_probs(target_logits[j, n][None], params), generators[j])[0]
                         for j, n in enumerate(lengths)])
    return VerifyResult(torch.tensor(lengths), bonus)


def test_a_broken_verifier_fails_the_batched_test():
    params = SamplingParams(temperature=1.0, max_new_tokens=WINDOW)
    target, draft = make_pair()
    engine = SpecEngine(target, ModelDrafter(draft), SpecConfig(gamma=GAMMA, draft_confidence=0.3), verifier=accept_every_real_draft)
    tv, threshold, p_value, _ = compare(exact_joint(target, params), sample_rows_in_batches(engine, params, SAMPLES), SAMPLES)
    assert tv > threshold and p_value < 1e-6, (tv, threshold, p_value)


@pytest.mark.skipif(not int8_available(), reason="this torch build has no fbgemm engine")
def test_transformers_left_padded_batch_over_int8_matches_its_rows_alone():
    """The bench's batched hf method: row-wise attention gathers exactly the unpadded keys."""
    model = prepare_int8(tiny_model("qwen2", seed=3, vocab_size=VOCAB, dtype=torch.float32, init=0.1))
    prompts = mixed_prompts(3, seed=8)
    width = max(len(p) for p in prompts)
    ids = torch.zeros((3, width), dtype=torch.long)
    mask = torch.zeros((3, width), dtype=torch.long)
    for j, p in enumerate(prompts):
        ids[j, width - len(p):] = torch.tensor(p)
        mask[j, width - len(p):] = 1
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    batched = model.generate(ids, attention_mask=mask, **kwargs)[:, width:]
    for j, p in enumerate(prompts):
        alone = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), **kwargs)
        assert batched[j].tolist() == alone[0, len(p):].tolist()
