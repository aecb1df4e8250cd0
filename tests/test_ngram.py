"""The n-gram drafter: correct lookups from an incremental index, and exact decoding with it."""

import random

import pytest
import torch

from specdecode.config import SamplingParams, SpecConfig
from specdecode.drafters.ngram import NgramDrafter
from specdecode.engine import SpecEngine
from specdecode.stats import GenerationStats
from specdecode.runners.hf import HFRunner

from helpers import tiny_model, decode


def brute_force(tokens, k, min_n, max_n):
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) < n:
            continue
        tail = tokens[-n:]
        for start in range(len(tokens) - 1, n - 1, -1):  # continuation start, most recent first
            if start < len(tokens) and tokens[start - n:start] == tail:
                return tokens[start:start + k]
    return []


def test_incremental_index_matches_a_full_rescan():
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(30)]
    drafter = NgramDrafter(vocab_size=6, min_n=1, max_n=3)
    drafter.reset(1)
    drafter.start([0], [tokens])
    for step in range(200):
        got = drafter.propose([0], [tokens], [5], SamplingParams(), [torch.Generator()]).tokens[0].tolist()
        assert got == brute_force(tokens, 5, 1, 3), step
        tokens.extend(rng.randrange(6) for _ in range(rng.randrange(1, 4)))


def test_no_match_gives_an_empty_draft():
    drafter = NgramDrafter(vocab_size=10, min_n=2, max_n=3)
    drafter.reset(1)
    drafter.start([0], [[1, 2, 3, 4]])
    assert drafter.propose([0], [[1, 2, 3, 4]], [4], SamplingParams(), [torch.Generator()]).tokens.shape == (1, 0)


def test_repeated_text_is_proposed():
    drafter = NgramDrafter(vocab_size=10)
    ids = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    drafter.reset(1)
    drafter.start([0], [ids])
    assert drafter.propose([0], [ids], [3], SamplingParams(), [torch.Generator()]).tokens.tolist() == [[4, 5, 9]]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_with_ngram_is_identical_to_plain(arch, gamma):
    # a sharper model falls into loops, where lookup proposals get accepted
    target = tiny_model(arch, seed=31, vocab_size=32, init=1.0)
    plain = SpecEngine(HFRunner(target), None, SpecConfig())
    spec = SpecEngine(HFRunner(target), NgramDrafter(32), SpecConfig(gamma=gamma))
    g = torch.Generator().manual_seed(5)
    accepted = 0
    for _ in range(12):
        base = torch.randint(0, 32, (1, 6), generator=g)
        prompt = torch.cat([base, base, base[:, :3]], dim=1)
        params = SamplingParams(max_new_tokens=48)
        ref = [t for s in decode(plain, prompt, params) for t in s.tokens]
        stats = GenerationStats()
        out = [t for s in decode(spec, prompt, params, stats=stats) for t in s.tokens]
        assert out == ref
        accepted += stats.accepted_tokens
    assert accepted > 0
