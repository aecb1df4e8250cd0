"""The Python API and the CLI on tiny saved models with a character tokenizer."""

import json
import subprocess
import sys

import pytest
import torch

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.cli import main
from specdecode.models import LoadedModel

from helpers import char_tokenizer, perturbed, tiny_model


@pytest.fixture(scope="module")
def pair():
    tok = char_tokenizer()
    vocab = len(tok.get_vocab())
    target = tiny_model("llama", seed=21, vocab_size=vocab)
    draft = perturbed(target, 0.03, seed=22)
    for m in (target, draft):
        m.generation_config.eos_token_id = tok.eos_token_id
    return tok, target, draft


@pytest.fixture(scope="module")
def generators(pair):
    tok, target, draft = pair
    spec = SpeculativeGenerator(LoadedModel("t", target, tok), LoadedModel("d", draft, tok), gamma=4)
    plain = SpeculativeGenerator(LoadedModel("t", target, tok), None)
    return spec, plain


@pytest.fixture(scope="module")
def saved(pair, tmp_path_factory):
    tok, target, draft = pair
    root = tmp_path_factory.mktemp("models")
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root


def test_generate_returns_text_ids_reason_and_stats(generators):
    spec, plain = generators
    out = spec.generate("hello world", max_new_tokens=40)
    ref = plain.generate("hello world", max_new_tokens=40)
    assert out.token_ids == ref.token_ids and out.text == ref.text
    assert out.finish_reason in ("stop", "length") and out.stats.new_tokens == len(out.token_ids)
    assert out.stats.drafted_tokens > 0 and ref.stats.drafted_tokens == 0
    assert ref.stats.tokens_per_target_forward == 1.0


def test_stop_string_inside_a_block(generators):
    spec, plain = generators
    ref = plain.generate("abc", max_new_tokens=60)
    stop = ref.text[12:14]
    start = ref.text.find(stop)
    for gen in (spec, plain):
        out = gen.generate("abc", max_new_tokens=60, stop=[stop])
        assert out.finish_reason == "stop"
        assert out.text == ref.text[:start]
        assert out.token_ids == ref.token_ids[: start + len(stop)]
        assert out.stats.new_tokens == len(out.token_ids)


def test_streamed_chunks_add_up_to_the_result(generators):
    spec, _ = generators
    for stop in ([], ["e"]):
        stream = spec.stream("the quick", SamplingParams(temperature=0.9, max_new_tokens=50, seed=3, stop=tuple(stop)))
        chunks = list(stream)
        assert "".join(c.text for c in chunks) == stream.result.text
        assert [t for c in chunks for t in c.token_ids] == stream.result.token_ids
        assert chunks[-1].finish_reason == stream.result.finish_reason
        assert all(c.finish_reason is None for c in chunks[:-1])


def test_a_per_request_gamma_keeps_its_engine_and_confidence_stop(generators):
    spec, plain = generators
    ref = plain.generate("hello world", max_new_tokens=40)
    first = spec.generate("hello world", max_new_tokens=40, gamma="auto")
    engine = spec.engine_for("auto")
    assert engine is not spec.engine and engine.config.stop_confidence == 0.7
    assert engine.policy.answer_lengths and engine.policy.costs.passes  # the request's measurements stay
    again = spec.generate("hello world", max_new_tokens=40, gamma="auto")
    assert spec.engine_for("auto") is engine and len(engine.policy.answer_lengths) == 2
    assert first.token_ids == again.token_ids == ref.token_ids
    assert spec.engine_for(4) is spec.engine  # the generator's own setting


def test_chat_template_is_applied(generators):
    spec, _ = generators
    assert spec.encode("hi", chat=True) == spec.tokenizer.encode("<user>hi\n<assistant>", add_special_tokens=False)


def run_cli(*args):
    proc = subprocess.run([sys.executable, "-m", "specdecode.cli", *args], capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def test_cli_json_output_schema_and_exactness(saved):
    common = ["generate", "def f(x):", "--target", str(saved / "target"), "--dtype", "float64", "--max-new-tokens", "30", "--json"]
    code, out, err = run_cli(*common, "--draft", str(saved / "draft"), "--gamma", "3")
    assert code == 0, err
    spec = json.loads(out)
    assert set(spec) >= {"text", "token_ids", "finish_reason", "stats"}
    assert set(spec["stats"]) >= {"new_tokens", "target_forwards", "drafted_tokens", "accepted_tokens", "acceptance_rate",
                                  "tokens_per_target_forward", "wall_seconds", "tokens_per_second"}
    code, out, err = run_cli(*common, "--draft", "none")
    plain = json.loads(out)
    assert code == 0 and plain["token_ids"] == spec["token_ids"] and plain["text"] == spec["text"]
    assert spec["stats"]["new_tokens"] == len(spec["token_ids"])


def test_cli_streams_text_then_a_stats_line(saved):
    code, out, err = run_cli("generate", "ab", "--target", str(saved / "target"), "--draft", str(saved / "draft"),
                             "--max-new-tokens", "12")
    assert code == 0, err
    assert "tokens/forward" in err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--gamma", "0"], "gamma must be"),
        (["--temperature", "-1"], "temperature must be"),
        (["--top-p", "1.5"], "top_p must be"),
        (["--top-p", "0"], "top_p must be"),
        (["--top-k", "-2"], "top_k must be"),
        (["--max-new-tokens", "0"], "max_new_tokens must be"),
        (["--gamma", "x"], "gamma must be an integer >= 1 or 'auto'"),
        (["--max-new-tokens", "x"], "invalid int value"),
        (["--device", "tpu"], "unknown device"),
        (["--dtype", "int3"], "unknown dtype"),
        (["--target", "/no/such/model"], "unknown model"),
        (["--draft", "./missing.gguf"], "unknown model"),
        (["--max-new-tokens", "1000"], "exceeds the target's context"),
        (["--draft-vocab", "0"], "--draft-vocab must be a positive number"),
        (["--draft-vocab", "half"], "--draft-vocab must be a positive number"),
        (["--draft-quant", "q2_k"], "argument --draft-quant: invalid choice"),
        (["--draft-confidence", "1.5"], "draft_confidence must be in [0, 1)"),
    ],
)
def test_cli_bad_input_is_one_line_and_nonzero(saved, flags, message, capsys):
    args = ["generate", "hello", "--target", str(saved / "target"), "--draft", str(saved / "draft"), *flags]
    code = main(args)  # in-process: an uncaught exception would fail the test with its traceback
    err = capsys.readouterr().err
    assert code == 2
    lines = [l for l in err.strip().splitlines() if l.startswith("specdecode")]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err


def test_cli_mismatched_vocabularies(saved, tmp_path, capsys):
    other = tiny_model("llama", seed=1, vocab_size=40)
    other.save_pretrained(tmp_path / "other")
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models as tmodels

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tmodels.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")))
    tok.save_pretrained(tmp_path / "other")
    code = main(["generate", "hi", "--target", str(saved / "target"), "--draft", str(tmp_path / "other")])
    err = capsys.readouterr().err
    assert code == 2 and "different vocabularies" in err and "Traceback" not in err


def test_prompt_longer_than_context_via_api(generators):
    from specdecode.errors import SpecDecodeError

    spec, _ = generators
    with pytest.raises(SpecDecodeError, match="context"):
        spec.generate("a" * 300, max_new_tokens=4)


def test_bad_draft_settings_via_api_fail_before_loading(saved):
    from specdecode.api import SpeculativeGenerator
    from specdecode.errors import SpecDecodeError

    for settings, message in (({"draft_quant": "q2_k"}, "draft_quant must be one of source, q4_0, q8_0"),
                              ({"draft_vocab": 0}, "draft_vocab must be a positive number"),
                              ({"draft_prefill": "gpu"}, "draft_prefill must be one of int8, llamacpp")):
        with pytest.raises(SpecDecodeError, match=message):
            SpeculativeGenerator.from_pretrained(str(saved / "target"), str(saved / "draft"), **settings)


def test_models_list_runs():
    code, out, err = run_cli("models", "list")
    assert code == 0 and "qwen2.5-coder-1.5b-instruct" in out and "qwen2.5-coder-0.5b-instruct" in out


def test_bench_and_tune_commands_end_to_end(saved, tmp_path, capsys):
    suite = tmp_path / "s.jsonl"
    suite.write_text('{"prompt": "def f(x):"}\n{"prompt": "abc abc"}\n')
    common = ["--target", str(saved / "target"), "--draft", str(saved / "draft"), "--suite", f"file:{suite}",
              "--max-new-tokens", "8", "--gamma", "3"]
    out = tmp_path / "b" / "bench.json"
    assert main(["bench", *common, "--methods", "ar,draft,ngram,hf-assisted", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result) == {"config", "methods", "per_prompt", "cost_model"}
    from specdecode.runners.int4 import kernel_problem

    assert result["methods"]["draft"]["mismatches"] == 0
    assert result["config"]["runner"] == ("int4" if kernel_problem() is None else "int8")  # auto on CPU in float32
    assert out.with_suffix(".md").is_file() and (out.parent / "speedup.png").is_file()
    assert main(["tune", *common, "--limit", "1"]) == 0
    assert "recommended: --gamma" in capsys.readouterr().out
    assert main(["bench", *common, "--methods", "ar,warp"]) == 2
    assert "unknown method" in capsys.readouterr().err


def test_generate_batch_api_rows_equal_single_requests(generators):
    spec, plain = generators
    prompts = ["hello world", "ab", {"prompt": "def f(x):", "max_new_tokens": 9}, "xyz " * 5]
    batch = spec.generate_batch(prompts, max_new_tokens=30, batch_size=3)
    for item, result in zip(prompts, batch.results):
        text = item["prompt"] if isinstance(item, dict) else item
        ref = plain.generate(text, max_new_tokens=item.get("max_new_tokens", 30) if isinstance(item, dict) else 30)
        assert result.token_ids == ref.token_ids and result.text == ref.text and result.finish_reason == ref.finish_reason
    assert batch.stats.batch_size == 3 and batch.stats.new_tokens == sum(len(r.token_ids) for r in batch.results)
    stop = plain.generate("ab", max_new_tokens=40).text[10:12]
    stopped = spec.generate_batch(["ab", "hello world"], max_new_tokens=40, stop=[stop], batch_size=2).results
    assert stopped[0].finish_reason == "stop" and stop not in stopped[0].text
    assert stopped[0].text == plain.generate("ab", max_new_tokens=40, stop=[stop]).text


def test_cli_prompts_file_jsonl_in_and_out(saved, tmp_path):
    lines = [{"prompt": "def f(x):", "id": "a"}, {"prompt": "ab", "max_new_tokens": 5}, {"prompt": "hello", "seed": 3}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(l) for l in lines) + "\n")
    common = ["generate", "--prompts-file", str(path), "--target", str(saved / "target"), "--dtype", "float64",
              "--max-new-tokens", "20"]
    code, out, err = run_cli(*common, "--draft", str(saved / "draft"), "--gamma", "3", "--batch-size", "2")
    assert code == 0, err
    rows = [json.loads(l) for l in out.strip().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2] and rows[0]["id"] == "a" and len(rows[1]["token_ids"]) <= 5
    assert all(r["batch_size"] == 2 and r["stats"]["new_tokens"] == len(r["token_ids"]) for r in rows)
    assert "batch size 2" in err.strip().splitlines()[-1] and "tok/s aggregate" in err
    for row, line in zip(rows, lines):
        code, single, _ = run_cli("generate", line["prompt"], "--target", str(saved / "target"), "--dtype", "float64",
                                  "--max-new-tokens", str(line.get("max_new_tokens", 20)), "--draft", "none", "--json")
        assert json.loads(single)["token_ids"] == row["token_ids"]


@pytest.mark.parametrize(
    "content, flags, message",
    [
        ("not json\n", [], "line 1: not valid JSON"),
        ('{"text": "x"}\n', [], 'string "prompt"'),
        ('{"prompt": "x", "max_new_tokens": 0}\n', [], "must be a positive integer"),
        ("\n", [], "holds no prompts"),
        ('{"prompt": "x"}\n', ["--batch-size", "0"], "--batch-size must be at least 1"),
        ('{"prompt": "x"}\n', ["extra prompt"], "not both"),
    ],
)
def test_cli_bad_prompts_file_is_one_line(saved, tmp_path, capsys, content, flags, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    code = main(["generate", *flags, "--prompts-file", str(path), "--target", str(saved / "target"), "--draft", "none"])
    err = capsys.readouterr().err
    lines = [l for l in err.strip().splitlines() if l.startswith("specdecode")]
    assert code == 2 and len(lines) == 1 and message in lines[0], err


def test_bench_batch_mode_end_to_end(saved, tmp_path, capsys):
    suite = tmp_path / "s.jsonl"
    suite.write_text('{"prompt": "def f(x):"}\n{"prompt": "abc abc"}\n{"prompt": "hello"}\n')
    common = ["--target", str(saved / "target"), "--draft", str(saved / "draft"), "--suite", f"file:{suite}",
              "--max-new-tokens", "8", "--gamma", "3"]
    out = tmp_path / "b" / "batch.json"
    assert main(["bench", *common, "--batch-size", "1,2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["batch"]) == {"1", "2"} and set(result["batch"]["2"]) == {"ar", "draft", "hf"}
    assert result["config"]["draft_runner"] == "int8" and result["batch"]["2"]["draft"]["mismatches"] == 0
    assert main(["bench", *common, "--batch-size", "0"]) == 2
    assert "--batch-size takes positive integers" in capsys.readouterr().err
    assert main(["bench", *common, "--batch-size", "2", "--methods", "ar,hf-assisted"]) == 2
    assert "with --batch-size, methods are" in capsys.readouterr().err


def test_ignore_eos_runs_past_the_end_token_to_max_new_tokens(pair):
    tok, target, draft = pair
    spec = SpeculativeGenerator(LoadedModel("t", target, tok), LoadedModel("d", draft, tok), gamma=4)
    plain = SpeculativeGenerator(LoadedModel("t", target, tok), None)
    free = plain.generate("hello world", max_new_tokens=40, ignore_eos=True).token_ids
    end = free[8]  # make a token the answer holds its end-of-sequence token
    spec.eos_ids = plain.eos_ids = [end]
    cut = free.index(end) + 1
    for gen in (spec, plain):
        stopped = gen.generate("hello world", max_new_tokens=40)
        assert stopped.token_ids == free[:cut] and stopped.finish_reason == "stop"
        for params in (SamplingParams(max_new_tokens=40, ignore_eos=True), SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=0.8, seed=5)):
            out = gen.generate("hello world", params)
            assert len(out.token_ids) == 40 and out.finish_reason == "length" and out.stats.new_tokens == 40
            if params.greedy:
                assert out.token_ids == free
        rows = gen.generate_batch(["hello world", "abc"], SamplingParams(max_new_tokens=40, ignore_eos=True), batch_size=2 if gen is plain else 1)
        assert rows.results[0].token_ids == free and len(rows.results[1].token_ids) == 40
    with pytest.raises(Exception, match="ignore_eos"):
        SamplingParams(ignore_eos="yes")


def test_cli_serve_decodes_on_its_main_thread_and_stops_on_interrupt(saved, generators):
    """`specdecode serve` runs the scheduler on the process's main thread, HTTP beside it."""
    import signal
    import time

    import httpx

    from specdecode.bench.llama_server import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specdecode.cli", "serve", "--target", str(saved / "target"),
                             "--draft", str(saved / "draft"), "--dtype", "float64", "--port", str(port), "--max-batch", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read()
                time.sleep(0.2)
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hello world", "max_tokens": 20},
                            timeout=120).json()
        assert answer["choices"][0]["text"] == generators[1].generate("hello world", max_new_tokens=20).text
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
    assert code == 0


def test_cli_serve_port_taken_is_an_error(saved):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, _, err = run_cli("serve", "--target", str(saved / "target"), "--draft", "none",
                               "--port", str(taken.getsockname()[1]))
    assert code != 0 and "Traceback" not in err
