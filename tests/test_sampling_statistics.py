"""Speculative sampling through the real engine has exactly the target's joint distribution.

A tiny-vocabulary order-2 Markov model (TableRunner) is the target; a noisy copy is the draft.
For a window of gamma + 1 new tokens (every drafted position plus the bonus) we enumerate the
exact joint distribution of the target alone, sample the engine many times with fixed seeds and
compare by total variation distance and a chi-square test. The TV threshold is calibrated by
sampling the exact distribution itself at the same sample size. Broken verifiers (always accept;
bonus drawn from the draft; rejection resampled from the target instead of the residual) must
fail the very same test, which shows it has the power to catch them.
"""

import itertools

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from specdecode.config import SamplingParams, SpecConfig
from specdecode.drafters import ModelDrafter
from specdecode.engine import SpecEngine
from specdecode.policy import FixedGamma
from specdecode.sampling import processed_probs, sample
from specdecode.verify import VerifyResult, verify

from helpers import TableRunner, decode

VOCAB = 4
GAMMA = 3
WINDOW = GAMMA + 1
SAMPLES = 12000
PROMPT = [1, 3, 0]
P_VALUE_FLOOR = 1e-3  # a correct sampler passes with probability ~0.999 per configuration


def make_pair():
    target = TableRunner(VOCAB, seed=11)
    draft = TableRunner(VOCAB, seed=11)
    noise = torch.randn(draft.table.shape, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    draft.table = draft.table + 1.2 * noise
    return target, draft


def exact_joint(target: TableRunner, params: SamplingParams) -> dict[tuple, float]:
    joint = {}
    for seq in itertools.product(range(VOCAB), repeat=WINDOW):
        context, prob = list(PROMPT), 1.0
        for token in seq:
            prob *= float(processed_probs(target.next_logits(context)[None], params)[0, token])
            context.append(token)
        joint[seq] = prob
    return joint


def sample_engine(engine: SpecEngine, params: SamplingParams, n: int) -> dict[tuple, int]:
    counts: dict[tuple, int] = {}
    prompt = torch.tensor([PROMPT])
    for seed in range(n):
        g = torch.Generator().manual_seed(seed)
        seq = tuple(t for step in decode(engine, prompt, params, generator=g) for t in step.tokens)
        assert len(seq) == WINDOW
        counts[seq] = counts.get(seq, 0) + 1
    return counts


def calibrated_tv_threshold(probs: np.ndarray, n: int, quantile: float = 0.999) -> float:
    rng = np.random.default_rng(0)
    draws = rng.multinomial(n, probs, size=400) / n
    return float(np.quantile(0.5 * np.abs(draws - probs).sum(axis=1), quantile))


def compare(joint, counts, n):
    """-> (tv, tv_threshold, chi-square p-value, samples in zero-probability cells)."""
    cells = sorted(joint)
    probs = np.array([joint[c] for c in cells])
    observed = np.array([counts.get(c, 0) for c in cells], dtype=float)
    outside = int(observed[probs == 0].sum()) + sum(v for c, v in counts.items() if c not in joint)
    tv = 0.5 * np.abs(observed / n - probs).sum()
    expected = probs * n
    big = expected >= 5  # pool small cells so the chi-square approximation holds
    obs = np.append(observed[big], observed[~big & (probs > 0)].sum())
    exp = np.append(expected[big], expected[~big & (probs > 0)].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    chi2 = ((obs - exp) ** 2 / exp).sum()
    p_value = float(scipy_stats.chi2.sf(chi2, df=len(exp) - 1))
    return tv, calibrated_tv_threshold(probs, n), p_value, outside


CONFIGS = [
    pytest.param(SamplingParams(temperature=1.0, max_new_tokens=WINDOW), id="t1"),
    pytest.param(SamplingParams(temperature=0.7, top_k=3, max_new_tokens=WINDOW), id="t0.7-topk3"),
    pytest.param(SamplingParams(temperature=1.4, top_p=0.8, max_new_tokens=WINDOW), id="t1.4-topp0.8"),
]


@pytest.mark.parametrize("params", CONFIGS)
def test_speculative_sampling_matches_target_joint(params):
    target, draft = make_pair()
    engine = SpecEngine(target, ModelDrafter(draft), SpecConfig(gamma=GAMMA))
    joint = exact_joint(target, params)
    tv, threshold, p_value, outside = compare(joint, sample_engine(engine, params, SAMPLES), SAMPLES)
    assert outside == 0, "a token outside the target's truncated set was emitted"
    assert tv < threshold, (tv, threshold)
    assert p_value > P_VALUE_FLOOR, p_value


def test_plain_sampling_matches_target_joint():
    params = CONFIGS[0].values[0]
    target, _ = make_pair()
    engine = SpecEngine(target, None, SpecConfig())
    tv, threshold, p_value, outside = compare(exact_joint(target, params), sample_engine(engine, params, SAMPLES), SAMPLES)
    assert outside == 0 and tv < threshold and p_value > P_VALUE_FLOOR


# -- negative controls: each broken rule must fail the same test -------------------------------


def always_accept(draft_tokens, draft_probs, target_logits, params, generators, draft_lengths=None):  # one row: its draft is the whole block
    k = draft_tokens.shape[1]
    bonus = sample(processed_probs(target_logits[:, k], params), generators[0])
    return VerifyResult(torch.full((draft_tokens.shape[0],), k), bonus)


def bonus_from_draft(draft_tokens, draft_probs, target_logits, params, generators, draft_lengths=None):  # one row: its draft is the whole block
    result = verify(draft_tokens, draft_probs, target_logits, params, generators)
    k = draft_tokens.shape[1]
    if int(result.num_accepted[0]) == k and draft_probs is not None:
        result.next_tokens = sample(draft_probs[:, k - 1], generators[0])
    return result


def resample_from_target(draft_tokens, draft_probs, target_logits, params, generators, draft_lengths=None):  # one row: its draft is the whole block
    result = verify(draft_tokens, draft_probs, target_logits, params, generators)
    n = int(result.num_accepted[0])
    if n < draft_tokens.shape[1]:
        result.next_tokens = sample(processed_probs(target_logits[:, n], params), generators[0])
    return result


@pytest.mark.parametrize("broken", [always_accept, bonus_from_draft, resample_from_target])
def test_broken_verifier_fails_the_same_test(broken):
    params = CONFIGS[0].values[0]
    target, draft = make_pair()
    engine = SpecEngine(target, ModelDrafter(draft), SpecConfig(gamma=GAMMA), verifier=broken)
    tv, threshold, p_value, _ = compare(exact_joint(target, params), sample_engine(engine, params, SAMPLES), SAMPLES)
    assert tv > threshold and p_value < 1e-6, (broken.__name__, tv, threshold, p_value)


def test_ngram_drafter_sampling_matches_target_joint():
    """Deterministic proposals (one-hot) keep sampling exact; the prompt repeats so lookups fire."""
    from specdecode.drafters.ngram import NgramDrafter

    params = SamplingParams(temperature=1.0, max_new_tokens=WINDOW)
    target, _ = make_pair()
    engine = SpecEngine(target, NgramDrafter(VOCAB, min_n=1, max_n=2), SpecConfig(gamma=GAMMA))
    joint = exact_joint(target, params)
    counts = sample_engine(engine, params, SAMPLES)
    tv, threshold, p_value, outside = compare(joint, counts, SAMPLES)
    assert outside == 0 and tv < threshold and p_value > P_VALUE_FLOOR, (tv, threshold, p_value)


class TrimmedVocabulary:
    """A draft runner that scores only some token ids, as a llama.cpp draft with a trimmed
    vocabulary does (runners.llamacpp.VocabularyMap): the others get -inf logits."""

    def __init__(self, runner, kept: list[int]):
        from specdecode.runners.llamacpp import VocabularyMap

        self.runner, self.kept, self.map = runner, kept, VocabularyMap(kept, runner.vocab_size)

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def _trim(self, logits):  # [..., V] -> [..., V] with the dropped ids at -inf
        return self.map.source_logits(logits[..., self.kept].reshape(-1, len(self.kept))).reshape(logits.shape)

    def prefill(self, ids, rows=None):
        return self._trim(self.runner.prefill(ids, rows))

    def forward(self, ids, rows=None, counts=None):
        return self._trim(self.runner.forward(ids, rows, counts))


class DeferredStart(FixedGamma):
    def start_after(self, context_tokens: int, budget: int) -> int:
        return 1


@pytest.mark.parametrize("variant", ["hybrid", "adaptive", "lookup-fill", "lookup-first", "deferred-start", "confidence", "trimmed-vocabulary"])
def test_other_drafting_modes_sample_the_target_joint(variant):
    from specdecode.drafters.hybrid import HybridDrafter
    from specdecode.drafters.ngram import NgramDrafter

    params = SamplingParams(temperature=1.0, max_new_tokens=WINDOW)
    target, draft = make_pair()
    if variant == "hybrid":
        drafter, config = HybridDrafter(ModelDrafter(draft), NgramDrafter(VOCAB, max_n=2), min_lookup=2), SpecConfig(gamma=GAMMA)
    elif variant in ("adaptive", "lookup-fill", "lookup-first"):
        drafter, config = ModelDrafter(draft), SpecConfig(gamma="auto", max_gamma=GAMMA)
    elif variant == "deferred-start":
        drafter, config = ModelDrafter(draft), SpecConfig(gamma=GAMMA)
    elif variant == "trimmed-vocabulary":  # the draft never proposes token 2; the target still emits it
        drafter, config = ModelDrafter(TrimmedVocabulary(draft, [0, 1, 3])), SpecConfig(gamma=GAMMA)
    else:
        drafter, config = ModelDrafter(draft), SpecConfig(gamma=GAMMA, draft_confidence=0.4)
    engine = SpecEngine(target, drafter, config)
    looked_up = []
    if variant in ("adaptive", "lookup-fill", "lookup-first"):  # the drafter starts with the request (tiny models: no deferral to measure)
        engine.policy.start_after = lambda context_tokens, budget: 0
    if variant.startswith("lookup"):  # lookup-fill: the model's drafts never pay, every step drafts a lookup;
        # lookup-first: the model drafts every step, except where a lookup is long enough
        engine.policy.choose = lambda remaining, rows=1: 0 if variant == "lookup-fill" else min(GAMMA, max(remaining) - 1)
        engine.policy.lookup_length = lambda remaining, rows=1: GAMMA  # (timings of the table runner are noise)
        engine.policy.drafts_at = lambda rows: True  # the drafter starts with the request, whatever was timed
        look_up, model_propose = engine._look_up, engine.drafter.propose
        engine._look_up = lambda *a: looked_up.append(look_up(*a)) or looked_up[-1]
        engine.drafter.propose = lambda *a, **k: looked_up.append("model") or model_propose(*a, **k)
    elif variant == "deferred-start":  # the drafter starts after the first plain token, then drafts every step
        engine.policy = DeferredStart(GAMMA)
    tv, threshold, p_value, outside = compare(exact_joint(target, params), sample_engine(engine, params, SAMPLES), SAMPLES)
    assert outside == 0 and tv < threshold and p_value > P_VALUE_FLOOR, (variant, tv, threshold, p_value)
    if variant.startswith("lookup"):
        chosen = sum(len(x[1]) for x in looked_up if x is not None and x != "model")
        models = looked_up.count("model")
        assert chosen > SAMPLES // 4 and (models == 0 if variant == "lookup-fill" else models > SAMPLES // 20), (chosen, models)
