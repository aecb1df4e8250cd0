"""Draft heads (eagle, medusa) through the real engine: exact greedy, rollback, the sampled joint.

Glossary: a *random head* is an untrained head (exactness may not depend on its quality); the
*feature table* is the order-2 table target with fixed per-token hidden states, fast enough
for the statistical test.
"""

import pytest
import torch

from specdecode.config import SamplingParams, SpecConfig
from specdecode.drafters.head import HeadConfig, HeadDrafter, build_head, default_layers, fingerprint
from specdecode.engine import SpecEngine
from specdecode.runners.hf import HFRunner

from helpers import TableRunner, decode, tiny_model
from test_sampling_statistics import GAMMA, P_VALUE_FLOOR, PROMPT, SAMPLES, VOCAB, always_accept, compare, exact_joint, sample_engine


def head_for(model, kind: str, draft_ids=None, seed: int = 0):
    config = HeadConfig(kind=kind, hidden_size=model.config.hidden_size,
                        layers=default_layers(model.config.num_hidden_layers, kind),
                        draft_ids=tuple(range(model.config.vocab_size) if draft_ids is None else draft_ids),
                        attention_heads=4, medusa_count=3, fingerprint=fingerprint(model))
    return build_head(config, model, torch.Generator().manual_seed(seed))


def plain_tokens(runner, prompt, n):
    engine = SpecEngine(runner, None, SpecConfig())
    return [t for step in decode(engine, prompt, SamplingParams(temperature=0, max_new_tokens=n)) for t in step.tokens]


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_with_a_head_is_token_identical_to_plain_decoding(kind, gamma):
    model = tiny_model("qwen2", seed=4)
    runner = HFRunner(model)
    prompt = [5, 9, 11, 3, 7, 20, 5, 9]
    expected = plain_tokens(runner, prompt, 40)
    head = head_for(model, kind, draft_ids=list(range(0, 96, 2)))  # half the vocabulary: drafts outside it are never made
    drafter = HeadDrafter(head, model.get_input_embeddings(), runner.vocab_size)
    proposed = []
    propose = drafter.propose
    drafter.propose = lambda *a, **k: proposed.append(propose(*a, **k)) or proposed[-1]
    engine = SpecEngine(runner, drafter, SpecConfig(gamma=gamma))
    steps = list(decode(engine, prompt, SamplingParams(temperature=0, max_new_tokens=40)))
    assert [t for s in steps for t in s.tokens] == expected
    drafted = [int(t) for d in proposed for t in d.tokens[0, : d.lengths[0]]]
    assert drafted and all(t % 2 == 0 for t in drafted)  # only ids of its draft vocabulary


def test_after_generation_the_head_cache_holds_exactly_the_real_positions():
    """Drafted positions are rolled back at every commit: the head's keys and values equal one
    fresh pass of the head over the target's states of the context it last drafted from."""
    model = tiny_model("qwen2", seed=6)
    runner = HFRunner(model)
    head = head_for(model, "eagle", seed=2)
    layers = head.config.layers
    drafter = HeadDrafter(head, model.get_input_embeddings(), runner.vocab_size)
    engine = SpecEngine(runner, drafter, SpecConfig(gamma=3))
    prompt = [4, 8, 15, 16, 23, 42]
    from specdecode.stats import GenerationStats

    stats = GenerationStats()
    tokens = [t for s in decode(engine, prompt, SamplingParams(temperature=0, max_new_tokens=30), stats=stats) for t in s.tokens]
    assert tokens == plain_tokens(HFRunner(model), prompt, 30)
    context = prompt + tokens
    fed = drafter._fed[0]
    assert len(context) - 1 - 4 <= fed < len(context) - 1  # fed at the last proposal, one step back at most
    fresh = HFRunner(model)
    _, states = fresh.prefill(torch.tensor([context[:fed]]), return_hidden=layers)
    with torch.inference_mode():
        embeds = model.get_input_embeddings()(torch.tensor([context[1 : fed + 1]])).float()
        _, _, (keys, values) = head(head.fused(states.float()), embeds, 0)
    assert drafter._past[0][0].shape[2] == fed
    assert torch.allclose(drafter._past[0][0], keys, atol=1e-5)
    assert torch.allclose(drafter._past[0][1], values, atol=1e-5)
    assert stats.drafted_tokens > 0


def test_batched_rows_with_a_head_equal_each_row_alone():
    from specdecode.engine import Request

    model = tiny_model("llama", seed=8)
    runner = HFRunner(model)
    prompts = [[3, 4, 5, 6], [9], [10, 11, 12, 13, 14, 15, 16]]
    expected = [plain_tokens(runner, p, 16) for p in prompts]
    drafter = HeadDrafter(head_for(model, "eagle"), model.get_input_embeddings(), runner.vocab_size)
    engine = SpecEngine(runner, drafter, SpecConfig(gamma=3))
    params = SamplingParams(temperature=0, max_new_tokens=16)
    requests = [Request(p, 16, torch.Generator().manual_seed(0)) for p in prompts]
    got = [[] for _ in prompts]
    for step in engine.generate(requests, params, batch_size=2):
        got[step.index].extend(step.tokens)
    assert got == expected


class FeatureTable(TableRunner):
    """The table target with hidden states: a fixed random vector per token at each index."""

    WIDTH = 8

    def __init__(self, vocab_size, seed):
        super().__init__(vocab_size, seed)
        self.vectors = torch.randn(vocab_size, self.WIDTH, generator=torch.Generator().manual_seed(seed + 1))

    def _states(self, ids, layers):  # ids [n, S] -> [n, S, L, W]
        return self.vectors[ids][:, :, None].expand(-1, -1, len(layers), -1) * torch.arange(1, len(layers) + 1)[:, None]

    def prefill(self, ids, rows=None, return_hidden=None):
        logits = super().prefill(ids, rows)
        return logits if not return_hidden else (logits, self._states(ids, return_hidden))

    def forward(self, ids, rows=None, counts=None, return_hidden=None):
        logits = super().forward(ids, rows, counts)
        return logits if not return_hidden else (logits, self._states(ids, return_hidden))


def table_head(kind: str):
    config = HeadConfig(kind=kind, hidden_size=FeatureTable.WIDTH, layers=(0, 1), draft_ids=(0, 2, 3),
                        attention_heads=2, medusa_count=GAMMA)
    generator = torch.Generator().manual_seed(3)
    head = build_head(config, generator=generator)
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(3.0)
    embedding = torch.nn.Embedding(VOCAB, FeatureTable.WIDTH)
    with torch.no_grad():
        embedding.weight.copy_(torch.randn(embedding.weight.shape, generator=generator))
    return HeadDrafter(head, embedding, VOCAB)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_head_sampling_matches_target_joint(kind):
    """The draft vocabulary leaves token 1 out: its zero draft mass must still give the target's joint."""
    params = SamplingParams(temperature=1.0, max_new_tokens=GAMMA + 1)
    target = FeatureTable(VOCAB, seed=11)
    engine = SpecEngine(target, table_head(kind), SpecConfig(gamma=GAMMA))
    counts = sample_engine(engine, params, SAMPLES)
    tv, threshold, p_value, outside = compare(exact_joint(target, params), counts, SAMPLES)
    assert outside == 0 and tv < threshold and p_value > P_VALUE_FLOOR, (tv, threshold, p_value)


def test_a_broken_verifier_fails_the_head_sampling_test():
    params = SamplingParams(temperature=1.0, max_new_tokens=GAMMA + 1)
    target = FeatureTable(VOCAB, seed=11)
    engine = SpecEngine(target, table_head("eagle"), SpecConfig(gamma=GAMMA), verifier=always_accept)
    tv, threshold, p_value, _ = compare(exact_joint(target, params), sample_engine(engine, params, SAMPLES), SAMPLES)
    assert tv > threshold and p_value < 1e-6, (tv, threshold, p_value)
