"""The OpenAI-compatible server, live on 127.0.0.1 with tiny models, driven by the openai client."""

import concurrent.futures
import json
import logging
import re
import time

import httpx
import openai
import pytest

from specdecode import SpeculativeGenerator
from specdecode.models import LoadedModel
from specdecode.server.app import create_app

from helpers import char_tokenizer, perturbed, serve_in_thread, tiny_model


@pytest.fixture(scope="module")
def models():
    tok = char_tokenizer()
    target = tiny_model("llama", seed=61, vocab_size=len(tok.get_vocab()), max_positions=4096)
    draft = perturbed(target, 0.03, seed=62)
    for m in (target, draft):
        m.generation_config.eos_token_id = tok.eos_token_id
    return LoadedModel("t", target, tok), LoadedModel("d", draft, tok)


@pytest.fixture(scope="module")
def server(models):
    app = create_app(SpeculativeGenerator(*models, gamma=3), "tiny")
    with serve_in_thread(app) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def reference(models):
    return SpeculativeGenerator(models[0], None)  # plain decoding, its own runner


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_completion_stream_equals_non_stream_equals_generate(client, reference):
    full = client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=40)
    chunks = list(client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=40, stream=True))
    streamed = "".join(c.choices[0].text for c in chunks)
    ref = reference.generate("def add(a, b):", max_new_tokens=40)
    assert full.choices[0].text == streamed == ref.text
    assert full.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == ref.finish_reason
    assert full.usage.completion_tokens == len(ref.token_ids) and full.usage.prompt_tokens == ref.prompt_tokens
    assert full.model_extra["speculative"]["drafted_tokens"] > 0


def test_chat_stream_and_non_stream(client, reference):
    messages = [{"role": "user", "content": "hello"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=30)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=30, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    ref = reference.generate("hello", max_new_tokens=30, chat=True)
    assert full.choices[0].message.content == streamed == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_stop_inside_a_block_and_sampling_params(client, reference):
    ref = reference.generate("abc", max_new_tokens=50)
    stop = ref.text[10:12]
    out = client.completions.create(model="tiny", prompt="abc", max_tokens=50, stop=[stop])
    assert out.choices[0].text == ref.text[: ref.text.find(stop)] and out.choices[0].finish_reason == "stop"
    a = client.completions.create(model="tiny", prompt="abc", max_tokens=30, temperature=0.9, top_p=0.9, seed=7,
                                  extra_body={"top_k": 5})
    b = client.completions.create(model="tiny", prompt="abc", max_tokens=30, temperature=0.9, top_p=0.9, seed=7,
                                  extra_body={"top_k": 5})
    assert a.choices[0].text == b.choices[0].text
    full = client.completions.create(model="tiny", prompt="abc", max_tokens=30, extra_body={"ignore_eos": True})
    assert full.usage.completion_tokens == 30 and full.choices[0].finish_reason == "length"


def test_sixteen_concurrent_requests_match_sequential(client):
    prompts = [f"x{i} = " for i in range(16)]
    sequential = [client.completions.create(model="tiny", prompt=p, max_tokens=24).choices[0].text for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        concurrent_out = list(pool.map(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=24).choices[0].text, prompts))
    assert concurrent_out == sequential


BAD = [
    ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "a", "max_tokens": -3}, 400, "max_tokens"),
    ({"prompt": "a", "temperature": -1}, 400, "temperature"),
    ({"prompt": "a", "top_p": 0}, 400, "top_p"),
    ({"prompt": "a", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "a", "top_k": -1}, 400, "top_k"),
    ({"prompt": "a", "model": "gpt-9"}, 404, "model"),
    ({"prompt": "a", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": "a", "n": 2}, 400, "n"),
    ({"prompt": "a", "stream": "yes"}, 400, "stream"),
    ({"prompt": "a", "ignore_eos": 1}, 400, "ignore_eos"),
    ({"prompt": "a", "stop": [1]}, 400, "stop"),
    ({"prompt": "a", "gamma": 0}, 400, "gamma"),
    ({"prompt": "a", "max_tokens": 5000}, 400, "max_tokens"),
    ({"prompt": "a" * 4000, "max_tokens": 200}, 400, "max_tokens"),
]


@pytest.mark.parametrize("body, status, param", BAD)
def test_invalid_input_gets_4xx_naming_the_field(server, body, status, param):
    r = httpx.post(server + "/v1/completions", json={"model": "tiny", **body} if "model" not in body else body, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    ok = httpx.post(server + "/v1/completions", json={"prompt": "ok", "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'"a string"', b"\xff\xfe"])
def test_malformed_bodies(server, raw):
    r = httpx.post(server + "/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(server + "/v1/chat/completions", json={"messages": "hi"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_models_and_health(server):
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    assert [m["id"] for m in httpx.get(server + "/v1/models").json()["data"]] == ["tiny"]


def metric(server, name):
    text = httpx.get(server + "/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_cancel_mid_stream_stops_the_request(server, client, caplog):
    caplog.set_level(logging.WARNING, logger="specdecode.server")
    before = metric(server, "specdecode_cancelled_requests_total")
    with httpx.stream("POST", server + "/v1/completions", json={"prompt": "long", "max_tokens": 3500, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.time() + 30
    while metric(server, "specdecode_cancelled_requests_total") == before and time.time() < deadline:
        time.sleep(0.1)
    assert metric(server, "specdecode_cancelled_requests_total") == before + 1
    assert "cancelled" in caplog.text
    out = client.completions.create(model="tiny", prompt="after", max_tokens=5)
    assert out.usage.completion_tokens >= 1


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith("VmRSS")).split()[1])


def test_metrics_match_tokens_and_memory_is_flat(server, client):
    for _ in range(20):  # warm up allocator pools
        client.completions.create(model="tiny", prompt="m", max_tokens=2)
    generated = metric(server, "specdecode_generated_tokens_total")
    returned = 0
    start = rss_kib()
    for i in range(200):
        returned += client.completions.create(model="tiny", prompt=f"m{i % 7}", max_tokens=3).usage.completion_tokens
    growth_mib = (rss_kib() - start) / 1024
    assert metric(server, "specdecode_generated_tokens_total") - generated == returned
    assert growth_mib < 40, growth_mib
    hist_count = metric(server, "specdecode_accepted_length_count")
    assert hist_count > 0
