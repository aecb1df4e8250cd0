"""The bench harness on tiny models: schema, pairing, rotation, mismatch detection, cost model."""

import json

import pytest

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.bench import costmodel, harness, report
from specdecode.bench.methods import METHODS, BenchContext, MethodRun, run_ar
from specdecode.bench.suites import load_suite
from specdecode.errors import SpecDecodeError
from specdecode.models import LoadedModel

from helpers import char_tokenizer, perturbed, tiny_model

ALL = ["ar", "draft", "draft-hf", "draft-auto", "ngram", "hybrid", "hf", "hf-assisted", "hf-lookup"]


@pytest.fixture(scope="module")
def ctx():
    tok = char_tokenizer()
    target = tiny_model("llama", seed=41, vocab_size=len(tok.get_vocab()))
    draft = perturbed(target, 0.03, seed=42)
    t, d = LoadedModel("t", target, tok), LoadedModel("d", draft, tok)
    spec = SpeculativeGenerator(t, d, gamma=3)
    return BenchContext(spec, spec.variant(None), spec.variant("ngram"), None, spec.variant("hybrid"),
                        spec.variant("model", gamma="auto"))


@pytest.fixture
def suite(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):", "abc abc ab", "hello", "x = [1, 2"]))
    return load_suite(f"file:{path}")


def test_schema_pairing_rotation_and_greedy_agreement(ctx, suite):
    result = harness.run_suite(ctx, suite, ALL, SamplingParams(max_new_tokens=20))
    assert set(result["methods"]) == set(ALL) and len(result["per_prompt"]) == len(suite)
    for name, m in result["methods"].items():
        assert {"new_tokens", "wall_seconds", "tokens_per_second", "speedup_vs_ar", "speedup_vs_hf_assisted",
                "acceptance_rate", "tokens_per_target_forward", "mismatches"} <= set(m)
        assert m["mismatches"] == 0, name  # every method is exact under greedy
        assert m["new_tokens"] == sum(r["methods"][name]["new_tokens"] for r in result["per_prompt"])
    assert result["methods"]["ar"]["speedup_vs_ar"] == {"geomean": pytest.approx(1.0), "min": 1.0, "max": 1.0}
    assert result["methods"]["hf-assisted"]["speedup_vs_hf_assisted"]["geomean"] == pytest.approx(1.0)
    assert result["methods"]["draft"]["acceptance_rate"] > 0 and result["methods"]["hf"]["acceptance_rate"] is None
    orders = [tuple(r["order"]) for r in result["per_prompt"]]
    assert len(set(orders)) == len(orders) and all(sorted(o) == sorted(ALL) for o in orders)
    # pairwise ratio: per-prompt tokens/s over ar's, geometric mean
    ratios = [r["methods"]["draft"]["tokens_per_second"] / r["methods"]["ar"]["tokens_per_second"] for r in result["per_prompt"]]
    geo = result["methods"]["draft"]["speedup_vs_ar"]
    assert min(ratios) == pytest.approx(geo["min"]) and max(ratios) == pytest.approx(geo["max"])
    text = report.format_table(result | {"config": {"gamma": 3}})
    assert "draft" in text and "hf-lookup" in text


def test_mismatch_is_detected(ctx, suite):
    def broken(c, ids, params):
        run = run_ar(c, ids, params)
        return MethodRun([t ^ 1 for t in run.tokens], run.wall_seconds)

    METHODS["broken-test"] = broken
    try:
        result = harness.run_suite(ctx, suite[:2], ["ar", "broken-test"], SamplingParams(max_new_tokens=8))
    finally:
        del METHODS["broken-test"]
    assert result["methods"]["broken-test"]["mismatches"] == 2
    assert all(r["methods"]["broken-test"]["first_divergence"] == 0 for r in result["per_prompt"])


def test_sampling_runs_skip_token_identity(ctx, suite):
    result = harness.run_suite(ctx, suite[:2], ["ar", "draft"], SamplingParams(temperature=0.8, max_new_tokens=8, seed=1))
    assert result["methods"]["draft"]["mismatches"] is None


def test_cost_model_and_markdown(ctx, suite, tmp_path):
    result = harness.run_suite(ctx, suite[:2], ["ar", "draft"], SamplingParams(max_new_tokens=12))
    model = harness.attach_cost_model(result, ctx, suite[:2], gamma=3)
    assert set(model["target_seconds_by_k"]) == {str(k) for k in range(1, 17)}
    assert 0 <= model["alpha"] <= 1 and 1 <= model["best_gamma"] <= 15
    result["config"] = {"command": "x", "target": "t", "draft": "d", "gamma": 3, "device": "cpu", "dtype": "float64",
                        "suite": "file", "prompts": 2, "offset": 0, "max_new_tokens": 12, "temperature": 0.0,
                        "top_k": 0, "top_p": 1.0}
    assert "Cost model" in report.markdown(result)
    assert len(report.plots(result, tmp_path)) == 3


def test_paper_formulas():
    assert costmodel.expected_tokens_per_pass(0.0, 4) == 1.0
    assert costmodel.expected_tokens_per_pass(1.0, 4) == 5.0
    assert costmodel.expected_tokens_per_pass(0.5, 2) == pytest.approx(1.75)
    alpha = costmodel.alpha_from_mean_accepted(0.5 + 0.25 + 0.125, 3)
    assert alpha == pytest.approx(0.5, abs=1e-9)
    flat = {k: 1.0 for k in range(1, 17)}
    rows = costmodel.predict(0.8, flat, 0.0)
    assert rows[3]["predicted_speedup"] == pytest.approx((1 - 0.8**5) / 0.2)


def test_suite_errors(tmp_path):
    with pytest.raises(SpecDecodeError, match="unknown suite"):
        load_suite("nope")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 1}\n')
    with pytest.raises(SpecDecodeError, match="bad.jsonl line 1"):
        load_suite(f"file:{bad}")
    assert len(load_suite("humaneval", limit=3, offset=160)) == 3
    assert load_suite("humaneval-chat", limit=1)[0].chat


def test_batch_bench_schema_ratios_and_exactness(ctx, suite):
    from specdecode.bench.batch import batch_markdown, format_batch_table, run_batch_suite

    result = run_batch_suite(ctx, suite, ["ar", "draft", "ngram", "hybrid", "hf"], SamplingParams(max_new_tokens=16), [1, 3])
    assert result["batch_sizes"] == [1, 3] and set(result["batch"]) == {"1", "3"}
    assert result["mismatch_reference"] == "ar at batch size 1"
    for size, entry in result["batch"].items():
        assert set(entry) == {"ar", "draft", "ngram", "hybrid", "hf"}
        assert entry["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
        for name, n in entry.items():
            assert n["new_tokens"] > 0 and n["tokens_per_second"] > 0 and n["mismatches"] == 0, (size, name)
            assert n["speedup_vs_ar"] == pytest.approx(n["tokens_per_second"] / entry["ar"]["tokens_per_second"])
        assert entry["draft"]["acceptance_rate"] > 0 and len(entry["draft"]["per_row"]) == len(suite)
    assert result["batch"]["3"]["ar"]["rows_per_forward"] > 1
    assert "batch  method" in format_batch_table(result) and "| 3 | draft |" in batch_markdown(result, "cmd")


def test_ignore_eos_gives_every_method_the_same_length(ctx, suite):
    gens = [ctx.spec, ctx.plain, ctx.ngram, ctx.hybrid, ctx.auto]
    saved = [g.eos_ids for g in gens]
    ids = ctx.spec.encode(suite[0].text)
    end = ctx.plain.generate(ids, max_new_tokens=20).token_ids[5]  # an answer token becomes the end token
    try:
        for g in gens:
            g.eos_ids = [end]
        names = ["ar", "draft", "draft-auto", "ngram", "hybrid", "hf", "hf-assisted", "hf-lookup"]
        cut = harness.run_suite(ctx, suite[:2], names, SamplingParams(max_new_tokens=20))
        full = harness.run_suite(ctx, suite[:2], names, SamplingParams(max_new_tokens=20, ignore_eos=True))
    finally:
        for g, eos in zip(gens, saved):
            g.eos_ids = eos
    assert all(r["methods"][n]["new_tokens"] <= 6 for r in cut["per_prompt"][:1] for n in names)
    assert all(r["methods"][n]["new_tokens"] == 20 for r in full["per_prompt"] for n in names)
    assert all(m["mismatches"] == 0 for m in full["methods"].values())
