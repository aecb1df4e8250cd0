"""The FastAPI app: OpenAI-style completions and chat, streaming, health, models and metrics.

Glossary:
- *worker*: one thread that runs requests one after another (the runners hold KV caches, so
  one request decodes at a time); HTTP handlers queue jobs for it and wait on their results.
- *job*: one request's parameters, a queue of chunks back to the handler, and a cancel flag the
  handler sets when its client disconnects; the worker checks it after every decode step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..api import GenerationResult, SpeculativeGenerator
from ..errors import SpecDecodeError
from .metrics import Metrics
from .validate import Request, RequestError, parse

log = logging.getLogger("specdecode.server")
DONE = object()


@dataclass
class Job:
    request: Request
    chat: bool
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    cancelled: threading.Event = field(default_factory=threading.Event)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])


class Worker:
    def __init__(self, generator: SpeculativeGenerator, metrics: Metrics):
        self.generator = generator
        self.metrics = metrics
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.variants: dict = {}
        self.thread = threading.Thread(target=self._run, name="specdecode-worker", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def stop(self) -> None:
        self.jobs.put(None)

    def _generator_for(self, req: Request) -> SpeculativeGenerator:
        base = self.generator
        if req.drafter is None:
            return base
        kind = None if req.drafter == "none" else req.drafter
        if kind in ("model", "hybrid") and base.draft is None:
            raise RequestError(f"drafter '{kind}' needs a draft model and this server has none", "drafter")
        if kind not in self.variants:
            self.variants[kind] = base.variant(kind)
        return self.variants[kind]

    def _emit(self, job: Job, item) -> None:
        job.loop.call_soon_threadsafe(job.out.put_nowait, item)

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            if job.cancelled.is_set():
                self._emit(job, DONE)
                continue
            try:
                self._serve(job)
            except RequestError as exc:
                self._emit(job, exc)
            except SpecDecodeError as exc:
                self._emit(job, RequestError(str(exc), "max_tokens" if exc.field == "max_new_tokens" else exc.field))
            except Exception as exc:  # a bug: report it, keep serving
                log.exception("request %s failed", job.id)
                self._emit(job, exc)
            finally:
                self._emit(job, DONE)

    def _serve(self, job: Job) -> None:
        req = job.request
        gen = self._generator_for(req)
        stream = gen.stream(req.messages if job.chat else req.prompt, req.params, chat=job.chat, gamma=req.gamma)
        for chunk in stream:
            self._emit(job, chunk)
            if job.cancelled.is_set():
                stream.close()
                log.warning("request %s cancelled by the client; stopped after %d tokens", job.id, stream.result.stats.new_tokens if stream.result else 0)
                self.metrics.cancelled += 1
                return
        self.metrics.record(stream.result)
        self._emit(job, stream.result)


def create_app(generator: SpeculativeGenerator, model_name: str) -> FastAPI:
    metrics = Metrics(max_accepted=generator.spec_config.longest_draft)
    worker = Worker(generator, metrics)
    app = FastAPI(title="specdecode", version="0.1.0")
    app.state.worker, app.state.metrics = worker, metrics

    @app.exception_handler(RequestError)
    async def _request_error(_, exc: RequestError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "specdecode"}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    async def handle(http: HTTPRequest, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            try:
                body = json.loads(await http.body())
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise RequestError("request body is not valid JSON") from None
            req = parse(body, chat, model_name)
            generator.check_fits(1, req.params.max_new_tokens)
        except RequestError as exc:
            metrics.request(endpoint, exc.status)
            return JSONResponse(exc.body(), status_code=exc.status)
        except SpecDecodeError as exc:
            metrics.request(endpoint, 400)
            return JSONResponse(RequestError(str(exc).replace("max_new_tokens", "max_tokens"), "max_tokens").body(), status_code=400)
        job = Job(req, chat, asyncio.get_running_loop(), asyncio.Queue())
        worker.submit(job)
        if req.stream:
            first = await job.out.get()
            if isinstance(first, Exception):
                return _error_response(first, metrics, endpoint)
            metrics.request(endpoint, 200)
            return StreamingResponse(_sse(job, first, chat, model_name), media_type="text/event-stream")
        result = None
        while (item := await job.out.get()) is not DONE:
            if isinstance(item, Exception):
                while await job.out.get() is not DONE:
                    pass
                return _error_response(item, metrics, endpoint)
            if isinstance(item, GenerationResult):
                result = item
        metrics.request(endpoint, 200)
        return _full_response(result, chat, model_name, job.id)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await handle(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        return await handle(http, chat=True)

    return app


def _error_response(exc: Exception, metrics: Metrics, endpoint: str):
    if isinstance(exc, RequestError):
        metrics.request(endpoint, exc.status)
        return JSONResponse(exc.body(), status_code=exc.status)
    metrics.request(endpoint, 500)
    return JSONResponse({"error": {"message": "internal error", "type": "server_error", "param": None, "code": None}}, status_code=500)


def _speculative(result) -> dict:
    s = result.stats
    return {"acceptance_rate": s.acceptance_rate, "tokens_per_target_forward": s.tokens_per_target_forward,
            "drafted_tokens": s.drafted_tokens, "accepted_tokens": s.accepted_tokens, "target_forwards": s.target_forwards}


def _usage(result) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": len(result.token_ids),
            "total_tokens": result.prompt_tokens + len(result.token_ids)}


def _full_response(result, chat: bool, model: str, job_id: str) -> dict:
    base = {"id": ("chatcmpl-" if chat else "cmpl-") + job_id, "created": int(time.time()), "model": model}
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": result.text}, "finish_reason": result.finish_reason}
        return {**base, "object": "chat.completion", "choices": [choice], "usage": _usage(result), "speculative": _speculative(result)}
    choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}
    return {**base, "object": "text_completion", "choices": [choice], "usage": _usage(result), "speculative": _speculative(result)}


async def _sse(job: Job, first, chat: bool, model: str):
    base = {"id": ("chatcmpl-" if chat else "cmpl-") + job.id, "created": int(time.time()), "model": model,
            "object": "chat.completion.chunk" if chat else "text_completion"}

    def chunk(text: str | None, finish: str | None, extra: dict | None = None) -> str:
        if chat:
            delta = {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return "data: " + json.dumps({**base, "choices": [choice], **(extra or {})}) + "\n\n"

    try:
        if chat:
            yield "data: " + json.dumps({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}) + "\n\n"
        item = first
        while item is not DONE:
            if isinstance(item, Exception):
                yield "data: " + json.dumps({"error": {"message": str(item), "type": "server_error"}}) + "\n\n"
            elif isinstance(item, GenerationResult):
                yield chunk(None, item.finish_reason, {"usage": _usage(item), "speculative": _speculative(item)})
            elif item.text:
                yield chunk(item.text, None)
            item = await job.out.get()
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()  # client gone (or finished): the worker stops after its current step
