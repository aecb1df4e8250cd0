"""Continuous batching: many requests decoded together, joining and leaving at step boundaries.

Glossary:
- *ticket*: one submitted request: its prompt ids, sampling settings, text stream, deadline and
  where its events go.
- *waiting*: submitted but not yet in the running batch (a bounded first-in first-out queue);
  *running*: a row of the batch. One waiting ticket joins per step (its prompt prefilled just
  before the step), so requests that arrive together get their first tokens one step apart
  instead of all after every prompt's prefill. A ticket that joins a busy batch gets its first
  token as it joins, and draft prefills are kept out of the way of tickets about to join (the
  engine's *admission first*, with gamma ``auto``).
- *lane*: the engine a ticket runs on: the generator's own, or a variant's for a per-request
  drafter or gamma. One lane's batch runs at a time (they share the runners); when the oldest
  waiting ticket is of another lane, admission pauses until the running batch has emptied, and
  the batch then moves to that lane, so no ticket waits behind later ones.
- *events*: what a ticket's ``on_event`` receives, on the scheduler's thread: StreamChunks as
  steps commit tokens, then the GenerationResult, or a single SpecDecodeError instead.
- *load-aware speculation*: each step's draft length is the engine policy's, chosen from the
  costs measured for the number of rows in the batch (``policy``); with ``gamma="auto"`` that
  includes not drafting at all where drafting does not pay at this load.

Greedy requests get exactly the tokens they get alone, and so do seeded ones with a fixed gamma:
rows never share random streams, and the runners give a row the same logits in any batch
(batch-invariant runners). With gamma "auto" a seeded request's tokens follow the target's
distribution exactly, but which sample its seed gives depends on the draft lengths chosen.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .api import SpeculativeGenerator
from .config import SamplingParams
from .engine import Batch, Request, SpecEngine
from .errors import SpecDecodeError
from .results import GenerationResult, chunk_of_step
from .sampling import seeded_generator
from .text import TextStream

log = logging.getLogger("specdecode.scheduler")
SERVER_DRAFTER = "server"  # a ticket's drafter when it asks for none of its own


class QueueFull(SpecDecodeError):
    """The waiting queue is full; ``retry_after`` is a guess in seconds at when to come back."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class RequestTimeout(SpecDecodeError):
    pass


class Unavailable(SpecDecodeError):
    """The scheduler is closed or shutting down."""


class InternalError(SpecDecodeError):
    """A bug met while serving a request (logged with its traceback)."""

    def __init__(self):
        super().__init__("internal error")


class Observer:
    """What the scheduler reports as it runs (the server's metrics implement it); no-ops here."""

    def step(self, rows: int, draft_length: int) -> None:
        pass

    def first_token(self, seconds: float) -> None:
        pass

    def tokens(self, gap_seconds: float, count: int) -> None:
        pass

    def finished(self, result: GenerationResult, latency_seconds: float) -> None:
        pass

    def ended(self, reason: str) -> None:  # "cancelled", "timeout" or "error"
        pass


@dataclass
class Ticket:
    engine: SpecEngine
    lane: tuple
    request: Request
    text: TextStream
    on_event: Callable[[object], None]
    submitted: float
    deadline: float | None
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    cancelled: threading.Event = field(default_factory=threading.Event)
    last_emit: float | None = None
    index: int = -1  # its id in the running batch

    def cancel(self) -> None:
        """End the request at the next step (its client went away)."""
        self.cancelled.set()


class Scheduler:
    """One thread that owns the runners and decodes every admitted ticket in one batch.

    start: run on a thread of its own; with False the caller runs ``run`` on a thread of its
    choice. The thread that loaded the models decodes fastest (about twice as fast as another
    one on a 2-core CPU here, the cost of the int8 kernels' thread teams), so ``specdecode serve``
    runs the scheduler on its main thread and the HTTP server beside it."""

    def __init__(self, generator: SpeculativeGenerator, max_batch: int = 8, max_waiting: int = 64,
                 timeout: float | None = None, observer: Observer | None = None, start: bool = True):
        if max_batch < 1:
            raise SpecDecodeError(f"max_batch must be at least 1, got {max_batch}", field="max_batch")
        if max_waiting < 0:  # (0: no queue beyond the free rows of the batch)
            raise SpecDecodeError(f"max_waiting must be at least 0, got {max_waiting}", field="max_waiting")
        if timeout is not None and timeout <= 0:
            raise SpecDecodeError(f"timeout must be positive, got {timeout}", field="timeout")
        self.generator = generator
        self.max_batch = min(max_batch, generator.engine.max_batch)
        self.max_waiting, self.timeout = max_waiting, timeout
        self.observer = observer or Observer()
        self._variants: dict[str, SpeculativeGenerator] = {SERVER_DRAFTER: generator}
        self._waiting: deque[Ticket] = deque()
        self._running: dict[int, Ticket] = {}  # by the id the batch's RowSteps carry
        self._batch: Batch | None = None
        self._lane: tuple | None = None
        self._next_index = 0
        self._step_seconds = 0.1  # decayed wall time of a step, for Retry-After
        self._lock = threading.Condition()
        self._closed = False
        self._thread = None
        if start:
            self._thread = threading.Thread(target=self.run, name="specdecode-scheduler", daemon=True)
            self._thread.start()

    # -- the caller's side (any thread) --

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def variant(self, drafter: str | None) -> SpeculativeGenerator:
        """The generator of a per-request drafter (None: the server's own; "none": plain)."""
        key = SERVER_DRAFTER if drafter is None else drafter
        if key not in self._variants:
            base = self.generator
            kind = None if key == "none" else key
            if kind in ("model", "hybrid") and base.draft is None:
                raise SpecDecodeError(f"drafter '{kind}' needs a draft model and this server has none", field="drafter")
            self._variants[key] = base.variant(kind)
        return self._variants[key]

    def submit(self, prompt, params: SamplingParams, on_event: Callable[[object], None], *, chat: bool = False,
               drafter: str | None = None, gamma: int | str | None = None) -> Ticket:
        """Queue a request; a bad one raises SpecDecodeError here, a full queue QueueFull."""
        gen = self.variant(drafter)
        engine = gen.engine_for(gamma)
        ids = gen.encode(prompt, chat)
        engine.check_fits(len(ids), params.max_new_tokens)
        request = Request(ids, params.max_new_tokens, seeded_generator(params.seed, gen.target_runner.device),
                          params=params, eos_ids=params.stopping_ids(gen.eos_ids))
        now = time.perf_counter()
        ticket = Ticket(engine, (drafter, engine.config), request, TextStream(gen.tokenizer, ids, params.stop), on_event,
                        now, None if self.timeout is None else now + self.timeout)
        with self._lock:
            if self._closed:
                raise Unavailable("the server is shutting down")
            if len(self._waiting) >= self.max_waiting + self.max_batch - len(self._running):
                raise QueueFull(f"{len(self._waiting)} requests are waiting already; retry later", self._retry_after())
            self._waiting.append(ticket)
            self._lock.notify()
        return ticket

    def close(self) -> None:
        """Stop: the requests still running or waiting end with an error."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(30)

    def _retry_after(self) -> int:
        """Seconds until a slot is likely free: the queue ahead, a request's typical steps apart."""
        return max(1, round(self._step_seconds * 32 * (1 + len(self._waiting)) / self.max_batch))

    # -- the scheduler's thread --

    def run(self, keep_going: Callable[[], bool] = lambda: True) -> None:
        """The scheduling loop, until ``close`` (or, checked every second while idle, until
        ``keep_going`` says no); the requests left then end with Unavailable."""
        try:
            while True:
                with self._lock:
                    while not self._closed and not self._waiting and not self._running and keep_going():
                        self._lock.wait(1.0)
                    if self._closed or not keep_going():
                        break
                try:
                    self._expire()
                    self._admit()
                    if self._running:
                        self._step()
                except Exception:  # a bug outside one request: end the batch's, serve on afresh
                    log.exception("the scheduler failed; ending the %d requests in the batch", len(self._running))
                    for ticket in list(self._running.values()):
                        self._end(ticket, InternalError(), "error")
                    self._lane = self._batch = None
        finally:
            with self._lock:
                self._closed = True
                left = list(self._running.values()) + list(self._waiting)
                self._waiting.clear()
            for ticket in left:
                self._end(ticket, Unavailable("the server is shutting down"), "error")

    def _expire(self) -> None:
        """Tickets past their deadline or cancelled by their client end now."""
        now = time.perf_counter()
        with self._lock:
            gone = [t for t in self._waiting if t.cancelled.is_set() or (t.deadline is not None and now > t.deadline)]
            for ticket in gone:
                self._waiting.remove(ticket)
        for ticket in gone + list(self._running.values()):
            if ticket.cancelled.is_set():
                log.warning("request %s cancelled by the client; stopped after %d tokens", ticket.id,
                            ticket.request.stats.new_tokens)
                self._end(ticket, None, "cancelled")
            elif ticket.deadline is not None and now > ticket.deadline:
                self._end(ticket, RequestTimeout(f"request timed out after {self.timeout:g} s"), "timeout")

    def _admit(self) -> None:
        """Move the oldest waiting ticket into a free slot of the running batch: one a step, so
        the running rows wait at most one prefill between steps and arrivals get their first
        tokens in turn (glossary: waiting)."""
        while True:
            with self._lock:
                if not self._waiting:
                    return
                ticket = self._waiting[0]
                if ticket.lane != self._lane:
                    if self._running:
                        return  # the batch moves to the oldest ticket's lane once it has emptied
                    self._lane = ticket.lane
                    self._batch = ticket.engine.batch(min(self.max_batch, ticket.engine.max_batch), ticket.request.params)
                if not self._batch.free_slots():
                    return
                self._waiting.popleft()
                defer_draft = bool(self._running) or self._joinable()
            index, self._next_index = self._next_index, self._next_index + 1
            try:
                first = self._batch.add(index, ticket.request, defer_draft)
            except SpecDecodeError as exc:
                self._end(ticket, exc, "error")
                continue
            except Exception:  # a bug: this request fails, the others go on
                log.exception("request %s failed while joining the batch", ticket.id)
                self._end(ticket, InternalError(), "error")
                continue
            ticket.index = index
            self._running[index] = ticket
            if first:  # its first token came with the join (the engine's admission first)
                self._deliver_steps(first, time.perf_counter())
            return

    def _joinable(self) -> bool:
        """Whether the oldest waiting ticket can join the running batch after the next step
        (with the lock held)."""
        return bool(self._waiting) and self._waiting[0].lane == self._lane and bool(self._batch.free_slots())

    def _step(self) -> None:
        t0 = time.perf_counter()
        with self._lock:
            hold = self._joinable()
        steps = self._batch.step(hold_drafters=hold)  # (a failure here ends the batch's requests, see run)
        now = time.perf_counter()
        self._step_seconds = 0.9 * self._step_seconds + 0.1 * (now - t0)
        self.observer.step(len(steps), self._batch.draft_length)
        self._deliver_steps(steps, now)

    def _deliver_steps(self, steps, now: float) -> None:
        for step in steps:
            ticket = self._running[step.index]
            try:
                self._deliver(ticket, step, now)
            except Exception:
                log.exception("request %s failed", ticket.id)
                self._end(ticket, InternalError(), "error")

    def _deliver(self, ticket: Ticket, step, now: float) -> None:
        request = ticket.request
        chunk = chunk_of_step(ticket.text, request.stats, step)
        if chunk.token_ids:
            if ticket.last_emit is None:
                self.observer.first_token(now - ticket.submitted)
            else:
                self.observer.tokens(now - ticket.last_emit, len(chunk.token_ids))
            ticket.last_emit = now
        if chunk.text or chunk.token_ids or chunk.finish_reason:
            ticket.on_event(chunk)
        if chunk.finish_reason is not None:
            request.cancelled = True  # a stop string: the batch lets it go before the next step
            request.stats.wall_seconds = now - ticket.submitted
            result = GenerationResult(ticket.text.text, list(ticket.text.token_ids), chunk.finish_reason,
                                      len(request.prompt_ids), request.stats)
            del self._running[ticket.index]
            ticket.on_event(result)
            self.observer.finished(result, now - ticket.submitted)

    def _end(self, ticket: Ticket, error: SpecDecodeError | None, reason: str) -> None:
        """End a ticket early: its row leaves at the next step, its caller gets ``error`` (or
        nothing more, when its client has gone)."""
        ticket.request.cancelled = True
        self._running.pop(ticket.index, None)
        self.observer.ended(reason)
        if error is not None:
            try:
                ticket.on_event(error)
            except Exception:
                log.exception("request %s: its error could not be delivered", ticket.id)

