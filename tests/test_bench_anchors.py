"""Bench anchors: llama.cpp over a tiny GGUF, a llama-server process (a small stand-in binary),
an OpenAI-compatible endpoint (``specdecode serve`` live on 127.0.0.1), and their errors."""

import json
import os
import sys

import pytest
import torch

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.bench import harness, report
from specdecode.bench.anchors import Anchors
from specdecode.bench.endpoint import base_url
from specdecode.bench.llama_server import LlamaServer, free_port
from specdecode.bench.methods import METHODS, BenchContext
from specdecode.bench.suites import load_suite
from specdecode.cli import main
from specdecode.errors import SpecDecodeError
from specdecode.models import LoadedModel
from specdecode.runners.llamacpp import llamacpp_available

from helpers import char_tokenizer, serve_in_thread, tiny_model, write_gguf

PROMPTS = ["def f(x):", "hello", "abc abc ab", "x = [1, 2"]  # the third one's answer ends (token 2) at 10 tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("anchors")
    tok = char_tokenizer()
    model = tiny_model("qwen2", seed=7, vocab_size=len(tok.get_vocab()), dtype=torch.float32)
    write_gguf(model, tok, root / "tiny.gguf")
    (root / "draft.gguf").write_bytes((root / "tiny.gguf").read_bytes())
    plain = SpeculativeGenerator(LoadedModel("t", model, tok), None)
    suite = root / "prompts.jsonl"
    suite.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS))
    return {"root": root, "tok": tok, "model": model, "plain": plain, "suite": load_suite(f"file:{suite}"),
            "gguf": str(root / "tiny.gguf"), "draft": str(root / "draft.gguf")}


def _ctx(tiny, anchors) -> BenchContext:
    plain = tiny["plain"]
    return BenchContext(plain, plain, plain.variant("ngram"), anchors=anchors)


@pytest.mark.skipif(not llamacpp_available(), reason="llama-cpp-python is not installed")
def test_llamacpp_method_decodes_the_same_ids_and_stops_like_ar(tiny):
    anchors = Anchors(["ar", "llamacpp"], tiny["gguf"], None, None, None, threads=2)
    ctx = _ctx(tiny, anchors)
    try:
        cut = harness.run_suite(ctx, tiny["suite"], ["ar", "llamacpp"], SamplingParams(max_new_tokens=16))
        full = harness.run_suite(ctx, tiny["suite"], ["ar", "llamacpp"], SamplingParams(max_new_tokens=16, ignore_eos=True))
    finally:
        anchors.close()
    summary = cut["methods"]["llamacpp"]
    # float32 weights: llama.cpp's greedy answer is ours, token for token
    assert summary["same_text_as_ar"] == len(PROMPTS) and summary["mismatches"] is None and summary["prompts"] == 4
    lengths = [r["methods"]["llamacpp"]["new_tokens"] for r in cut["per_prompt"]]
    assert lengths == [r["methods"]["ar"]["new_tokens"] for r in cut["per_prompt"]] and lengths[2] == 10
    assert all(r["methods"]["llamacpp"]["first_divergence"] is None for r in cut["per_prompt"])
    assert summary["tokens_per_second"] > 0 and summary["speedup_vs_ar"]["geomean"] > 0
    assert all(r["methods"]["llamacpp"]["new_tokens"] == 16 for r in full["per_prompt"])
    assert full["methods"]["llamacpp"]["same_text_as_ar"] == len(PROMPTS)
    assert "4/4" in report.format_table(cut)
    assert anchors.n_ctx >= max(r["prompt_tokens"] for r in cut["per_prompt"]) + 16


FAKE_SERVER = r'''
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

args = sys.argv[1:]
log = open(os.environ["FAKE_LLAMA_LOG"], "a")
log.write(json.dumps({"argv": args, "pid": os.getpid()}) + "\n"); log.flush()
if os.environ.get("FAKE_LLAMA_FAIL"):
    print("error: unable to load model " + args[args.index("-m") + 1]); sys.exit(3)
answers = json.load(open(os.environ["FAKE_LLAMA_ANSWERS"]))
started = time.monotonic()

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def reply(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code); self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        self.reply(200 if time.monotonic() - started > 0.3 else 503, {"status": "ok"})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        log.write(json.dumps({"pid": os.getpid(), "path": self.path, "body": body}) + "\n"); log.flush()
        answer = answers[",".join(map(str, body["prompt"]))]
        tokens = answer["tokens"][: body["n_predict"]]
        out = {"content": answer["text"], "tokens_predicted": len(tokens), "timings": {"draft_n": 3 if "-md" in args else 0}}
        if answers.get("return_tokens", True):
            out["tokens"] = tokens
        self.reply(200, out)

HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Handler).serve_forever()
'''


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    binary.chmod(0o755)
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(tmp_path / "log.jsonl"))
    monkeypatch.setenv("FAKE_LLAMA_ANSWERS", str(tmp_path / "answers.json"))

    def log():
        return [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]

    return str(binary), tmp_path / "answers.json", log


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # a stopped child the bench waited for is gone
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("return_tokens", [True, False])
def test_llama_server_methods_start_ask_compare_and_stop(tiny, fake_server, return_tokens):
    binary, answers_path, log = fake_server
    plain, params = tiny["plain"], SamplingParams(max_new_tokens=12)
    answers = {"return_tokens": return_tokens}
    for i, prompt in enumerate(tiny["suite"]):
        ids = plain.encode(prompt.text)
        ar = METHODS["ar"](_ctx(tiny, None), ids, params)
        tokens = ar.tokens if i != 1 else [5] * len(ar.tokens)  # the second answer differs from ar's
        answers[",".join(map(str, ids))] = {"tokens": tokens, "text": plain.tokenizer.decode(tokens, skip_special_tokens=True)}
    answers_path.write_text(json.dumps(answers))
    methods = ["ar", "llamacpp-server", "llamacpp-server-spec"]
    anchors = Anchors(methods, tiny["gguf"], tiny["draft"], binary, None, threads=2)
    try:
        result = harness.run_suite(_ctx(tiny, anchors), tiny["suite"], methods, params)
    finally:
        anchors.close()
    for name in methods[1:]:
        summary = result["methods"][name]
        assert summary["same_text_as_ar"] == 3 and summary["prompts"] == 4 and summary["mismatches"] is None
        rows = [r["methods"][name] for r in result["per_prompt"]]
        assert [r["new_tokens"] for r in rows] == [r["methods"]["ar"]["new_tokens"] for r in result["per_prompt"]]
        assert [r["same_text"] for r in rows] == [True, False, True, True]
        assert ("first_divergence" in rows[1]) == return_tokens
    starts = [e for e in log() if "argv" in e]
    assert len(starts) == 2 and ["-md", tiny["draft"]] == starts[1]["argv"][-2:] and "-md" not in starts[0]["argv"]
    assert all(s["argv"][:2] == ["-m", tiny["gguf"]] and s["argv"][s["argv"].index("-t") + 1] == "2" for s in starts)
    bodies = [e["body"] for e in log() if "body" in e]
    assert len(bodies) == 2 * (1 + len(PROMPTS))  # a warm-up, then every prompt, on each server
    assert all(b["cache_prompt"] is False and b["temperature"] == 0 and b["top_k"] == 1 for b in bodies)
    assert {b["n_predict"] for b in bodies} == {8, 12}
    assert result["per_prompt"][0]["methods"]["llamacpp-server-spec"]["extra"]["timings"]["draft_n"] == 3
    assert set(anchors.describe()["llama_server"]) == {"plain", "spec"}
    assert not any(_alive(s["pid"]) for s in starts)  # both processes were stopped


def test_llama_server_that_fails_to_start_is_one_line(tiny, fake_server, monkeypatch):
    binary, _, _ = fake_server
    monkeypatch.setenv("FAKE_LLAMA_FAIL", "1")
    with pytest.raises(SpecDecodeError, match=r"exited with code 3 before it was ready: error: unable to load model .*tiny.gguf"):
        LlamaServer(binary, tiny["gguf"], None, 512, 2)


@pytest.fixture(scope="module")
def serve(tiny):
    """``specdecode serve``'s app over the same weights, in float64, live on 127.0.0.1."""
    from specdecode.server.app import create_app

    model = tiny_model("qwen2", seed=7, vocab_size=len(tiny["tok"].get_vocab()))  # float64 copy of the same init
    model.save_pretrained(tiny["root"] / "model")
    tiny["tok"].save_pretrained(tiny["root"] / "model")
    app = create_app(SpeculativeGenerator(LoadedModel("t", model, tiny["tok"]), None), "tiny")
    with serve_in_thread(app) as port:
        yield f"http://127.0.0.1:{port}/v1/"


def test_endpoint_method_end_to_end_against_specdecode_serve(tiny, serve, tmp_path, capsys):
    out = tmp_path / "b" / "bench.json"
    suite = tiny["root"] / "prompts.jsonl"
    code = main(["bench", "--target", str(tiny["root"] / "model"), "--draft", "none", "--dtype", "float64",
                 "--suite", f"file:{suite}", "--max-new-tokens", "12", "--methods", "ar,endpoint",
                 "--endpoint", serve, "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(out.read_text())
    endpoint = result["methods"]["endpoint"]
    assert endpoint["same_text_as_ar"] == len(PROMPTS) and endpoint["mismatches"] is None  # our server is exact
    rows = result["per_prompt"]
    assert [r["methods"]["endpoint"]["new_tokens"] for r in rows] == [r["methods"]["ar"]["new_tokens"] for r in rows]
    assert rows[0]["methods"]["endpoint"]["extra"]["usage"]["completion_tokens"] == rows[0]["methods"]["ar"]["new_tokens"]
    assert result["config"]["anchors"]["endpoint"] == {"url": serve.rstrip("/")[: -len("/v1")], "model": "tiny"}
    assert "endpoint" in captured.out and "4/4" in captured.out
    assert "specdecode: wrote " in captured.err and str(out) in captured.err


def test_base_url_takes_the_server_with_or_without_v1():
    assert base_url("http://127.0.0.1:8000/v1/") == base_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert base_url("https://host/prefix/v1") == "https://host/prefix"
    with pytest.raises(SpecDecodeError, match="http"):
        base_url("127.0.0.1:8000")


@pytest.mark.parametrize("flags, message", [
    (["--methods", "ar,llamacpp-server"], "need --llama-server PATH"),
    (["--methods", "ar,endpoint"], "method endpoint needs --endpoint URL"),
    (["--llama-server", "/no/such/llama-server"], "--llama-server: no executable llama-server at '/no/such/llama-server'"),
    (["--endpoint", "ftp://x"], "--endpoint takes an http(s) URL"),
    (["--endpoint", "http://127.0.0.1:PORT"], "--endpoint: cannot reach http://127.0.0.1:PORT/v1/models"),
    (["--endpoint", "http://127.0.0.1:PORT", "--batch-size", "2"], "leave out --batch-size"),
    (["--target", "DIR", "--methods", "ar,llamacpp"], "--target must be a model pack or a .gguf file, not"),
    (["--target", "DIR", "--draft", "none", "--methods", "ar,llamacpp-server-spec", "--llama-server", "BIN"], "need a --draft model"),
    (["--target", "GGUF", "--draft", "DIR", "--methods", "ar,llamacpp-server-spec", "--llama-server", "BIN"],
     "--draft must be a model pack or a .gguf file"),
])
def test_bad_anchor_input_is_one_line_and_nonzero(tiny, fake_server, flags, message, capsys):
    port = str(free_port())  # nothing listens there
    swap = {"DIR": str(tiny["root"]), "BIN": fake_server[0], "GGUF": tiny["gguf"]}
    argv = ["bench", "--limit", "1", *[swap.get(f, f.replace("PORT", port)) for f in flags]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.startswith("specdecode")]
    assert len(lines) == 1 and message.replace("PORT", port) in lines[0], err
    assert "Traceback" not in err
