"""Continuous batching: requests join and leave a running batch, each exactly as it runs alone.

The scheduler is driven directly and through the server on real sockets with tiny models:
staggered arrivals, mixed budgets, sampling settings and drafters in one batch, a bounded
queue, timeouts, a failing request, and a storm of cancelled streams.
"""

import concurrent.futures
import threading
import time

import httpx
import openai
import pytest

from specdecode import SpeculativeGenerator
from specdecode.config import SamplingParams
from specdecode.errors import SpecDecodeError
from specdecode.results import GenerationResult, StreamChunk
from specdecode.scheduler import Observer, QueueFull, RequestTimeout, Scheduler
from specdecode.server.app import create_app

from helpers import serve_in_thread
from test_server import metric, models, rss_kib  # noqa: F401  (the tiny pair fixture)

PROMPTS = ["def add(a, b):", "x", "class Stack:\n", "for i in range(10):", "# sum a list", "import os\n",
           "while True:", "return [x * 2 for x in"]


class Collect:
    """One ticket's events: chunks, then the result or an error."""

    def __init__(self, fail_on_chunk: bool = False):
        self.chunks, self.result, self.error = [], None, None
        self.done = threading.Event()
        self.fail_on_chunk = fail_on_chunk

    def __call__(self, item):
        if isinstance(item, StreamChunk):
            if self.fail_on_chunk:
                raise RuntimeError("a consumer that breaks")
            self.chunks.append(item)
        else:
            self.result, self.error = (item, None) if isinstance(item, GenerationResult) else (None, item)
            self.done.set()

    def wait(self, seconds: float = 120):
        assert self.done.wait(seconds), "the request never ended"
        return self


class Rows(Observer):
    def __init__(self):
        self.rows, self.ended_reasons = [], []

    def step(self, rows, draft_length):
        self.rows.append(rows)

    def ended(self, reason):
        self.ended_reasons.append(reason)


@pytest.fixture(scope="module")
def alone(models):
    plain = SpeculativeGenerator(models[0], None)  # plain decoding on a runner of its own
    return lambda prompt, **kw: plain.generate(prompt, **kw)


def test_staggered_greedy_requests_get_exactly_their_tokens_alone(models, alone):
    rows = Rows()
    scheduler = Scheduler(SpeculativeGenerator(*models, gamma=3), max_batch=4, observer=rows)
    try:
        budgets = [12 + 5 * i for i in range(len(PROMPTS))]
        events = [Collect() for _ in PROMPTS]
        for i in range(3):
            scheduler.submit(PROMPTS[i], SamplingParams(max_new_tokens=budgets[i]), events[i])
        while not events[0].chunks:  # the others join a batch that is already decoding
            time.sleep(0.001)
        for i in range(3, len(PROMPTS)):
            scheduler.submit(PROMPTS[i], SamplingParams(max_new_tokens=budgets[i]), events[i])
        for prompt, budget, ev in zip(PROMPTS, budgets, events):
            ref = alone(prompt, max_new_tokens=budget)
            ev.wait()
            assert ev.result.token_ids == ref.token_ids and ev.result.text == ref.text
            assert "".join(c.text for c in ev.chunks) == ref.text
            assert ev.result.stats.drafted_tokens > 0
        assert max(rows.rows) == 4 and min(rows.rows) >= 1
    finally:
        scheduler.close()


def test_mixed_sampling_settings_and_drafters_in_one_batch(models):
    """Seeded requests at a fixed draft length give the same tokens batched as alone, whatever
    else shares the batch; a per-request drafter runs in its own lane."""
    gen = SpeculativeGenerator(*models, gamma=3)
    settings = [dict(temperature=0.8, seed=1), dict(temperature=0.0), dict(temperature=1.1, top_k=20, seed=2),
                dict(temperature=0.6, top_p=0.9, seed=3), dict(temperature=0.8, seed=1, stop=("e",))]
    drafters = [None, "none", None, "ngram", None]
    reference = SpeculativeGenerator(*models, gamma=3)  # its own runners
    expected = [(reference.variant(None if d == "none" else d) if d else reference).generate(
        p, SamplingParams(max_new_tokens=30, **s)) for p, s, d in zip(PROMPTS, settings, drafters)]
    scheduler = Scheduler(gen, max_batch=8)
    try:
        events = [Collect() for _ in settings]
        for p, s, d, ev in zip(PROMPTS, settings, drafters, events):
            scheduler.submit(p, SamplingParams(max_new_tokens=30, **s), ev, drafter=d)
        for ev, ref in zip(events, expected):
            ev.wait()
            assert ev.result.token_ids == ref.token_ids and ev.result.finish_reason == ref.finish_reason
    finally:
        scheduler.close()


def test_bounded_queue_timeout_and_a_failing_consumer(models, alone):
    rows = Rows()
    scheduler = Scheduler(SpeculativeGenerator(*models, gamma=3), max_batch=1, max_waiting=2, timeout=1.0, observer=rows)
    try:
        long = [Collect() for _ in range(3)]
        for ev in long:
            scheduler.submit("long", SamplingParams(max_new_tokens=3500), ev)
            while not long[0].chunks:  # the first is running, the others wait
                time.sleep(0.001)
        with pytest.raises(QueueFull) as full:
            scheduler.submit("one too many", SamplingParams(max_new_tokens=3), Collect())
        assert full.value.retry_after >= 1
        for ev in long:  # each times out, running or waiting
            assert isinstance(ev.wait().error, RequestTimeout)
        broken, fine = Collect(fail_on_chunk=True), Collect()
        scheduler.submit("def add(a, b):", SamplingParams(max_new_tokens=10), broken)
        scheduler.submit("def add(a, b):", SamplingParams(max_new_tokens=10), fine)
        assert isinstance(broken.wait().error, SpecDecodeError)
        assert fine.wait().result.token_ids == alone("def add(a, b):", max_new_tokens=10).token_ids
        assert rows.ended_reasons.count("timeout") == 3 and rows.ended_reasons.count("error") == 1
    finally:
        scheduler.close()


def test_bad_requests_are_refused_before_admission(models):
    scheduler = Scheduler(SpeculativeGenerator(*models, gamma=3), max_batch=2)
    try:
        with pytest.raises(SpecDecodeError, match="exceeds"):
            scheduler.submit("a" * 4000, SamplingParams(max_new_tokens=200), Collect())
        with pytest.raises(SpecDecodeError, match="empty"):
            scheduler.submit("", SamplingParams(max_new_tokens=2), Collect())
        ev = Collect()
        scheduler.submit("ok", SamplingParams(max_new_tokens=4), ev)
        assert len(ev.wait().result.token_ids) == 4
    finally:
        scheduler.close()


@pytest.fixture(scope="module")
def server(models):
    app = create_app(SpeculativeGenerator(*models, gamma="auto"), "tiny", max_batch=8, max_waiting=64)
    with serve_in_thread(app) as port:
        yield f"http://127.0.0.1:{port}"


def client_for(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_eight_concurrent_clients_get_their_tokens_alone(server, alone):
    client = client_for(server)
    steps_before = metric(server, "specdecode_batch_size_count")
    single_before = metric_bucket(server, "specdecode_batch_size", "1")

    def ask(i):
        return client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=24 + 3 * i, stream=i % 2 == 0)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    for i, answer in enumerate(answers):
        text = "".join(c.choices[0].text for c in answer) if i % 2 == 0 else answer.choices[0].text
        assert text == alone(PROMPTS[i], max_new_tokens=24 + 3 * i).text
    steps = metric(server, "specdecode_batch_size_count") - steps_before
    assert steps - (metric_bucket(server, "specdecode_batch_size", "1") - single_before) > 0  # steps of 2+ rows
    text = httpx.get(server + "/metrics").text
    for name in ("specdecode_num_requests_running", "specdecode_num_requests_waiting",
                 "specdecode_time_to_first_token_seconds_count", "specdecode_inter_token_latency_seconds_count",
                 "specdecode_e2e_request_latency_seconds_count", 'specdecode_spec_decode_num_accepted_tokens_per_pos_total{position="0"}',
                 "specdecode_draft_length_steps_total{batch_size="):
        assert name in text, name


def metric_bucket(server, name, le):
    text = httpx.get(server + "/metrics").text
    line = next(l for l in text.splitlines() if l.startswith(f'{name}_bucket{{le="{le}"}}'))
    return float(line.split()[-1])


def wait_idle(server, seconds=60):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if metric(server, "specdecode_num_requests_running") == 0 and metric(server, "specdecode_num_requests_waiting") == 0:
            return
        time.sleep(0.05)
    raise AssertionError("the server never went idle")


def test_cancelled_storm_then_a_normal_request(server, alone):
    before = metric(server, "specdecode_cancelled_requests_total")

    def open_and_drop(i):
        with httpx.stream("POST", server + "/v1/completions", json={"prompt": f"storm {i}", "max_tokens": 3000, "stream": True},
                          timeout=60) as r:
            assert next(r.iter_lines()).startswith("data: ")

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        list(pool.map(open_and_drop, range(32)))
    wait_idle(server)
    assert metric(server, "specdecode_cancelled_requests_total") - before == 32
    out = client_for(server).completions.create(model="tiny", prompt="def add(a, b):", max_tokens=20)
    assert out.choices[0].text == alone("def add(a, b):", max_new_tokens=20).text


def test_memory_is_flat_over_hundreds_of_concurrent_requests(server):
    client = client_for(server)

    def ask(i):
        return client.completions.create(model="tiny", prompt=f"m{i % 7}", max_tokens=3 + i % 5).usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(ask, range(30)))
        after_30 = rss_kib()
        list(pool.map(ask, range(270)))
    after_300 = rss_kib()
    assert after_300 <= after_30 * 1.05, (after_30, after_300)


def test_http_back_pressure_and_timeout(models):
    app = create_app(SpeculativeGenerator(*models, gamma=3), "tiny", max_batch=1, max_waiting=1, timeout=1.0)
    with serve_in_thread(app) as port:
        base = f"http://127.0.0.1:{port}"
        body = {"prompt": "long", "max_tokens": 4000}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, base + "/v1/completions", json=body, timeout=60)
            while metric(base, "specdecode_num_requests_running") < 1:
                time.sleep(0.01)
            second = pool.submit(httpx.post, base + "/v1/completions", json=body, timeout=60)
            while metric(base, "specdecode_num_requests_waiting") < 1:
                time.sleep(0.01)
            refused = httpx.post(base + "/v1/completions", json=body, timeout=60)
            assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
            assert refused.json()["error"]["code"] == "queue_full"
            for answer in (first.result(), second.result()):
                assert answer.status_code == 504 and answer.json()["error"]["code"] == "timeout"
        ok = httpx.post(base + "/v1/completions", json={"prompt": "ok", "max_tokens": 3}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_hybrid_drafts_for_two_sampling_groups_as_for_each_alone(models):
    """The hybrid drafter proposes once per sampling group in a step; each row's draft cache
    still rolls back to its own accepted tokens, so its drafts (and acceptance) are as alone."""
    settings = [dict(temperature=0.0), dict(temperature=0.9, seed=5)]
    prompts = ["def add(a, b):", "class Stack:\n"]
    reference = SpeculativeGenerator(*models, gamma=3, drafter="hybrid")
    expected = [reference.generate(p, SamplingParams(max_new_tokens=60, **s)) for p, s in zip(prompts, settings)]
    scheduler = Scheduler(SpeculativeGenerator(*models, gamma=3, drafter="hybrid"), max_batch=2)
    try:
        events = [Collect(), Collect()]
        for p, s, ev in zip(prompts, settings, events):
            scheduler.submit(p, SamplingParams(max_new_tokens=60, **s), ev)
        for ev, ref in zip(events, expected):
            got = ev.wait().result
            assert got.token_ids == ref.token_ids
            assert (got.stats.drafted_tokens, got.stats.accepted_tokens) == (ref.stats.drafted_tokens, ref.stats.accepted_tokens)
    finally:
        scheduler.close()


def test_max_waiting_zero_admits_into_free_rows_only(models):
    scheduler = Scheduler(SpeculativeGenerator(*models, gamma=3), max_batch=1, max_waiting=0)
    try:
        ev = Collect()
        scheduler.submit("ok", SamplingParams(max_new_tokens=4), ev)  # a free row: taken
        assert len(ev.wait().result.token_ids) == 4
    finally:
        scheduler.close()
    with pytest.raises(SpecDecodeError, match="shutting down"):
        scheduler.submit("late", SamplingParams(max_new_tokens=4), Collect())


def test_a_non_streamed_request_whose_client_leaves_is_cancelled(server):
    before = metric(server, "specdecode_cancelled_requests_total")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server + "/v1/completions", json={"prompt": "gone", "max_tokens": 3500, "ignore_eos": True}, timeout=0.2)
    deadline = time.time() + 30
    while metric(server, "specdecode_cancelled_requests_total") == before and time.time() < deadline:
        time.sleep(0.1)
    assert metric(server, "specdecode_cancelled_requests_total") == before + 1
    wait_idle(server)


def test_requests_arriving_together_join_before_any_draft_prefill(models, alone, monkeypatch):
    generator = SpeculativeGenerator(*models, gamma="auto")
    engine = generator.engine
    starts, start = [], engine._start_drafter

    def recording(row):
        starts.append((row.index, row.request.stats.new_tokens))
        start(row)

    monkeypatch.setattr(engine, "_start_drafter", recording)
    rows = Rows()
    scheduler = Scheduler(generator, max_batch=4, observer=rows, start=False)
    events = [Collect() for _ in PROMPTS[:3]]
    for prompt, event in zip(PROMPTS, events):
        scheduler.submit(prompt, SamplingParams(max_new_tokens=20), event)
    scheduler.run(keep_going=lambda: not all(e.done.is_set() for e in events))
    for prompt, event in zip(PROMPTS, events):
        assert event.result.token_ids == alone(prompt, max_new_tokens=20).token_ids
    assert rows.rows[:3] == [1, 2, 3]  # one joins per step
    assert sorted(index for index, _ in starts) == [0, 1, 2]  # each drafter started once
    assert all(tokens >= 1 for _, tokens in starts)  # each after its request's first token
    for event in events:  # which came with its join, alone: before the batch's first step
        assert event.chunks[0].token_ids and len(event.chunks[0].token_ids) == 1
