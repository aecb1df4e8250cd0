"""specdecode loadtest against a live server on 127.0.0.1 with tiny models, and against a stand-in that answers 429."""

import json

import pytest

from specdecode import SpeculativeGenerator
from specdecode.bench.llama_server import free_port
from specdecode.bench.loadtest import LoadTestConfig, run_loadtest
from specdecode.bench.suites import load_suite
from specdecode.cli import main
from specdecode.models import LoadedModel
from specdecode.server.app import create_app

from helpers import char_tokenizer, perturbed, serve_in_thread, tiny_model

PROMPTS = ["def add(a, b):", "x = [", "class stack:", "print("]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def models():
    tok = char_tokenizer()
    target = tiny_model("llama", seed=71, vocab_size=len(tok.get_vocab()))  # no end token: every answer max_tokens long
    return LoadedModel("t", target, tok), LoadedModel("d", perturbed(target, 0.03, seed=72), tok)


@pytest.fixture(scope="module")
def server(models):
    with serve_in_thread(create_app(SpeculativeGenerator(*models, gamma=3), "tiny")) as port:
        yield f"http://127.0.0.1:{port}"


def write_suite(folder, prompts) -> str:
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "id": f"p{i}"}) + "\n" for i, p in enumerate(prompts)))
    return f"file:{path}"


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return write_suite(tmp_path_factory.mktemp("suite"), PROMPTS)


@pytest.fixture(scope="module")
def result(server, suite):
    config = LoadTestConfig(server, "tiny", (1, 2), ("default", "none"), max_tokens=MAX_TOKENS)
    return run_loadtest(config, load_suite(suite))


def test_every_request_gets_the_tokens_generate_gives(result, models):
    reference = SpeculativeGenerator(models[0], None)  # plain decoding, its own runner
    expected = [reference.generate(p, max_new_tokens=MAX_TOKENS) for p in PROMPTS]
    assert len(result["requests"]) == 2 * 2 * len(PROMPTS)
    for record in result["requests"]:
        ref = expected[record["index"]]
        assert record["status"] == "ok", record
        assert record["tokens_from"] == "usage"
        assert (record["completion_tokens"], record["text"]) == (len(ref.token_ids), ref.text)
    for row in result["summary"]:
        assert row["succeeded"] == row["requests"] == len(PROMPTS)
        assert row["rate_limited"] == 0 and row["errors"] == {}
        assert row["completion_tokens"] == sum(len(r.token_ids) for r in expected)


def test_greedy_texts_are_the_same_across_levels_and_variants(result):
    rows = {(r["concurrency"], r["variant"]): r for r in result["summary"]}
    assert sorted(rows) == [(1, "default"), (1, "none"), (2, "default"), (2, "none")]
    for row in rows.values():
        assert row["same_text_vs_base_level"] == {"same": len(PROMPTS), "compared": len(PROMPTS)}
        assert row["same_text_vs_first_variant"] == {"same": len(PROMPTS), "compared": len(PROMPTS)}
        assert row["tokens_per_second"] > 0 and row["tokens_per_second_vs_base_level"] > 0


def test_percentiles_are_ordered(result):
    for row in result["summary"]:
        for key in ("ttft_seconds", "itl_seconds"):
            p = row[key]
            assert 0 <= p["p50"] <= p["p90"] <= p["p99"], (key, p)
        assert 0 < row["latency_seconds"]["p50"] <= row["latency_seconds"]["p90"]


def run_cli(capsys, *args):
    code = main(["loadtest", *args])
    return code, capsys.readouterr()


def test_cli_prints_the_table_and_writes_json_and_plots(server, suite, tmp_path, capsys):
    code, out = run_cli(capsys, "--url", server + "/v1", "--concurrency", "2,1", "--variants", "default,none",
                        "--suite", suite, "--max-tokens", "6", "--ignore-eos", "--seed", "3", "--out", str(tmp_path))
    assert code == 0, out.err
    lines = out.out.strip().splitlines()
    assert "TTFT ms p50/90/99" in lines[0] and len(lines) == 2 + 4
    assert all(line.split()[-2:] == [f"{len(PROMPTS)}/{len(PROMPTS)}"] * 2 for line in lines[2:])
    saved = json.loads((tmp_path / "loadtest.json").read_text())
    assert saved["config"]["model"] == "tiny" and saved["config"]["concurrency"] == [1, 2]
    assert len(saved["requests"]) == 2 * 2 * len(PROMPTS)
    assert all(r["completion_tokens"] == 6 for r in saved["requests"])
    for name in ("throughput.png", "ttft.png", "itl.png"):
        assert (tmp_path / name).stat().st_size > 0


@pytest.mark.parametrize("flags, message", [
    (["--concurrency", "0,2"], "--concurrency takes positive integers"),
    (["--concurrency", "one"], "--concurrency takes positive integers"),
    (["--variants", "none,none"], "--variants takes distinct names"),
    (["--suite", "nope"], "unknown suite 'nope'"),
    (["--url", "127.0.0.1:8000"], "--url takes an http(s) URL"),
    (["--url", "http://127.0.0.1:PORT"], "cannot reach http://127.0.0.1:PORT"),
])
def test_bad_input_is_one_line(flags, message, suite, capsys):
    port = str(free_port())  # nothing listens there
    flags = [f.replace("PORT", port) for f in flags]
    url = [] if "--url" in flags else ["--url", f"http://127.0.0.1:{port}"]
    code, out = run_cli(capsys, *url, "--suite", suite, *flags)
    assert code == 2
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specdecode: error: ") and message.replace("PORT", port) in lines[0], out.err


def test_a_variant_the_server_rejects_is_one_line(server, suite, tmp_path, capsys):
    code, out = run_cli(capsys, "--url", server, "--variants", "default,bogus", "--suite", suite, "--out", str(tmp_path))
    assert code == 2
    assert out.err.strip().splitlines() == [out.err.strip()] and "variant 'bogus'" in out.err and "HTTP 400" in out.err


def stand_in_app():
    """Answers /v1/completions in turn: a three-token stream, a 429, a 503."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    app.state.calls = 0

    def event(choices, **extra) -> str:
        return "data: " + json.dumps({"id": "c", "object": "text_completion", "created": 0, "model": "stand-in",
                                      "choices": choices, **extra}) + "\n\n"

    async def answer():
        for text in ("ab", "c"):
            yield event([{"index": 0, "text": text, "logprobs": None, "finish_reason": None}])
        yield event([], usage={"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4})
        yield "data: [DONE]\n\n"

    @app.get("/v1/models")
    async def listed():
        return {"object": "list", "data": [{"id": "stand-in", "object": "model", "created": 0, "owned_by": "test"}]}

    @app.post("/v1/completions")
    async def completions():
        app.state.calls += 1
        status = (200, 429, 503)[(app.state.calls - 1) % 3]
        if status != 200:
            return JSONResponse({"error": {"message": "busy", "type": "busy", "param": None, "code": None}}, status_code=status)
        return StreamingResponse(answer(), media_type="text/event-stream")

    return app


def test_429_and_other_statuses_are_counted_not_retried(tmp_path):
    app = stand_in_app()
    with serve_in_thread(app) as port:
        config = LoadTestConfig(f"http://127.0.0.1:{port}", "stand-in", (1,), max_tokens=3)
        result = run_loadtest(config, load_suite(write_suite(tmp_path, [f"p{i}" for i in range(6)])))
    row, = result["summary"]
    assert app.state.calls == 1 + 6  # the warm-up, then each prompt once
    assert (row["succeeded"], row["rate_limited"], row["errors"]) == (2, 2, {"503": 2})
    assert row["completion_tokens"] == 6 and row["itl_seconds"]["p50"] is not None
    ok = [r for r in result["requests"] if r["status"] == "ok"]
    assert [r["text"] for r in ok] == ["abc", "abc"] and all(len(r["itl_seconds"]) == 1 for r in ok)
