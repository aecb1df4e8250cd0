"""The FastAPI app: OpenAI-style completions and chat, streaming, health, models and metrics.

Glossary:
- *scheduler*: the one thread that decodes every admitted request in a continuous batch
  (``specdecode.scheduler``); handlers submit tickets to it and read their events back from an
  asyncio queue. The HTTP layer never touches runners or engines.
- *back-pressure*: past ``max_waiting`` queued requests a new one gets 429 with Retry-After.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..api import GenerationResult, SpeculativeGenerator
from ..errors import SpecDecodeError
from ..scheduler import InternalError, QueueFull, RequestTimeout, Scheduler, Ticket, Unavailable
from .metrics import Metrics
from .validate import RequestError, parse

log = logging.getLogger("specdecode.server")
DISCONNECT_POLL_SECONDS = 0.25  # how often a handler waiting for its request checks its client


def _request_error(exc: SpecDecodeError) -> RequestError:
    if isinstance(exc, QueueFull):
        error = RequestError(str(exc), None, 429, "queue_full")
        error.headers = {"Retry-After": str(exc.retry_after)}
        return error
    if isinstance(exc, RequestTimeout):
        return RequestError(str(exc), None, 504, "timeout")
    if isinstance(exc, Unavailable):
        return RequestError(str(exc), None, 503, "unavailable")
    if isinstance(exc, InternalError):
        return RequestError(str(exc), None, 500, "internal_error")
    field = "max_tokens" if exc.field == "max_new_tokens" else exc.field
    return RequestError(str(exc).replace("max_new_tokens", "max_tokens"), field)


def create_app(generator: SpeculativeGenerator, model_name: str, max_batch: int = 8, max_waiting: int = 64,
               timeout: float | None = None, start_scheduler: bool = True) -> FastAPI:
    """max_batch: requests decoded together; max_waiting: queued requests past which new ones
    get 429; timeout: seconds a request may take from its arrival (None: no limit);
    start_scheduler: False leaves ``app.state.scheduler.run()`` to the caller's thread."""
    metrics = Metrics(max_accepted=generator.spec_config.longest_draft)
    scheduler = Scheduler(generator, max_batch=max_batch, max_waiting=max_waiting, timeout=timeout, observer=metrics,
                          start=start_scheduler)
    metrics.gauges = lambda: (scheduler.running, scheduler.waiting)
    app = FastAPI(title="specdecode", version="0.1.0")
    app.state.scheduler, app.state.metrics = scheduler, metrics
    app.router.on_shutdown.append(scheduler.close)

    @app.exception_handler(RequestError)
    async def _request_error_handler(_, exc: RequestError):
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

    def submit(req, chat: bool, out: asyncio.Queue) -> Ticket:
        loop = asyncio.get_running_loop()
        return scheduler.submit(req.messages if chat else req.prompt, req.params,
                                lambda item: loop.call_soon_threadsafe(out.put_nowait, item),
                                chat=chat, drafter=req.drafter, gamma=req.gamma)

    async def handle(http: HTTPRequest, chat: bool):
        endpoint = "chat" if chat else "completions"
        out: asyncio.Queue = asyncio.Queue()
        try:
            try:
                body = json.loads(await http.body())
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise RequestError("request body is not valid JSON") from None
            req = parse(body, chat, model_name)
            try:
                ticket = submit(req, chat, out)
            except SpecDecodeError as exc:
                raise _request_error(exc) from None
            except Exception:  # a bug (the prompt's own errors are SpecDecodeErrors): a JSON 500
                log.exception("a request could not be queued")
                raise _request_error(InternalError()) from None
        except RequestError as exc:
            metrics.request(endpoint, exc.status)
            return JSONResponse(exc.body(), status_code=exc.status, headers=getattr(exc, "headers", None))
        if req.stream:
            first = await _Events(out, http, ticket).next()
            if first is None:
                return None
            if isinstance(first, SpecDecodeError):
                return _error_response(_request_error(first), metrics, endpoint)
            metrics.request(endpoint, 200)
            return StreamingResponse(_sse(ticket, out, first, chat, model_name), media_type="text/event-stream")
        events = _Events(out, http, ticket)
        while not isinstance(item := await events.next(), GenerationResult):
            if item is None:
                return None
            if isinstance(item, SpecDecodeError):
                return _error_response(_request_error(item), metrics, endpoint)
        metrics.request(endpoint, 200)
        return _full_response(item, chat, model_name, ticket.id)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await handle(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        return await handle(http, chat=True)

    return app


def _error_response(exc: RequestError, metrics: Metrics, endpoint: str):
    metrics.request(endpoint, exc.status)
    body = exc.body()
    if exc.status >= 500:
        body["error"]["type"] = "server_error"
    return JSONResponse(body, status_code=exc.status)


class _Events:
    """A ticket's events as its handler reads them; a client found gone (checked every
    DISCONNECT_POLL_SECONDS) cancels the ticket, and the next read is None."""

    def __init__(self, out: asyncio.Queue, http: HTTPRequest, ticket: Ticket):
        self.out, self.http, self.ticket = out, http, ticket
        self.checked = time.monotonic()

    async def next(self):
        while True:
            if time.monotonic() - self.checked >= DISCONNECT_POLL_SECONDS:
                self.checked = time.monotonic()
                if await self.http.is_disconnected():
                    self.ticket.cancel()
                    return None
            try:
                return await asyncio.wait_for(self.out.get(), DISCONNECT_POLL_SECONDS)
            except asyncio.TimeoutError:
                pass


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


async def _sse(ticket: Ticket, out: asyncio.Queue, first, chat: bool, model: str):
    base = {"id": ("chatcmpl-" if chat else "cmpl-") + ticket.id, "created": int(time.time()), "model": model,
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
        while True:
            if isinstance(item, SpecDecodeError):
                yield "data: " + json.dumps({"error": {"message": str(item), "type": "server_error"}}) + "\n\n"
                break
            if isinstance(item, GenerationResult):
                yield chunk(None, item.finish_reason, {"usage": _usage(item), "speculative": _speculative(item)})
                break
            if item.text:
                yield chunk(item.text, None)
            item = await out.get()
        yield "data: [DONE]\n\n"
    finally:
        ticket.cancel()  # client gone (or finished): the scheduler lets the row go at its next step
