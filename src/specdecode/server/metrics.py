"""Prometheus metrics for the server, named as serving engines name theirs.

Glossary:
- *accepted length*: the drafted tokens one target forward kept for a request; its histogram
  has one bucket per possible length.
- *batch size*: the requests one decode step ran together; *draft length*: the tokens the
  policy chose to draft in that step (0: a plain step), counted per batch size, which shows the
  load-aware choice.
- *time to first token*: from a request's arrival to its first committed token; *inter-token
  latency*: the gap between a request's steps that commit tokens, per token committed (a step
  of n tokens counts n observations of gap / n).
- *acceptance by position*: per draft position, the tokens drafted there and those accepted,
  over finished requests.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from typing import Callable

from ..scheduler import Observer

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
ITL_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
LATENCY_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class Histogram:
    def __init__(self, name: str, help_: str, buckets):
        self.name, self.help, self.buckets = name, help_, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last: above every bucket
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{bound:g}"}} {cumulative}')
        cumulative += self.counts[-1]
        lines += [f'{self.name}_bucket{{le="+Inf"}} {cumulative}', f"{self.name}_sum {self.sum:g}",
                  f"{self.name}_count {cumulative}"]
        return lines


class Metrics(Observer):
    def __init__(self, max_accepted: int):
        self.lock = threading.Lock()
        self.requests: Counter = Counter()  # (endpoint, status) -> count
        self.ended_early: Counter = Counter()  # "cancelled" / "timeout" / "error" -> count
        self.prompt_tokens = self.generated_tokens = self.drafted = self.accepted = 0
        self.max_accepted = max_accepted
        self.accepted_lengths = Histogram("specdecode_accepted_length", "Accepted drafted tokens per target forward.",
                                          range(max_accepted + 1))
        self.drafted_by_position = [0] * max_accepted
        self.accepted_by_position = [0] * max_accepted
        self.draft_lengths: Counter = Counter()  # (batch size, draft length) -> steps
        self.batch_size = Histogram("specdecode_batch_size", "Requests decoded together per step.", BATCH_BUCKETS)
        self.ttft = Histogram("specdecode_time_to_first_token_seconds", "Seconds from arrival to the first token.",
                              TTFT_BUCKETS)
        self.itl = Histogram("specdecode_inter_token_latency_seconds", "Seconds between tokens of a request.",
                             ITL_BUCKETS)
        self.latency = Histogram("specdecode_e2e_request_latency_seconds", "Seconds from arrival to the last token.",
                                 LATENCY_BUCKETS)
        self.gauges: Callable[[], tuple[int, int]] = lambda: (0, 0)  # (running, waiting), set by the app

    def request(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[(endpoint, status)] += 1

    # -- the scheduler's observations (its thread) --

    def step(self, rows, draft_length) -> None:
        with self.lock:
            self.batch_size.observe(rows)
            self.draft_lengths[(rows, draft_length)] += 1

    def first_token(self, seconds: float) -> None:
        with self.lock:
            self.ttft.observe(seconds)

    def tokens(self, gap_seconds: float, count: int) -> None:
        with self.lock:
            self.itl.observe(gap_seconds / count, count)

    def finished(self, result, latency_seconds: float) -> None:
        s = result.stats
        with self.lock:
            self.latency.observe(latency_seconds)
            self.prompt_tokens += result.prompt_tokens
            self.generated_tokens += len(result.token_ids)
            self.drafted += s.drafted_tokens
            self.accepted += s.accepted_tokens
            for n in s.accepted_per_step:
                self.accepted_lengths.observe(min(n, self.max_accepted))
            for i, (drafted, accepted) in enumerate(zip(s.drafted_by_position, s.accepted_by_position)):
                if i < self.max_accepted:
                    self.drafted_by_position[i] += drafted
                    self.accepted_by_position[i] += accepted

    def ended(self, reason: str) -> None:
        with self.lock:
            self.ended_early[reason] += 1

    def render(self) -> str:
        running, waiting = self.gauges()
        with self.lock:
            lines = ["# HELP specdecode_requests_total HTTP requests by endpoint and status.",
                     "# TYPE specdecode_requests_total counter"]
            lines += [f'specdecode_requests_total{{endpoint="{e}",status="{s}"}} {n}' for (e, s), n in sorted(self.requests.items())]
            for name, value, help_ in (
                ("num_requests_running", running, "Requests in the running batch."),
                ("num_requests_waiting", waiting, "Requests queued for the batch."),
            ):
                lines += [f"# HELP specdecode_{name} {help_}", f"# TYPE specdecode_{name} gauge", f"specdecode_{name} {value}"]
            for name, value, help_ in (
                ("prompt_tokens", self.prompt_tokens, "Prompt tokens of completed requests."),
                ("generated_tokens", self.generated_tokens, "Tokens returned to clients."),
                ("drafted_tokens", self.drafted, "Tokens proposed by the drafter."),
                ("accepted_tokens", self.accepted, "Drafted tokens the target accepted."),
                ("cancelled_requests", self.ended_early["cancelled"], "Requests cancelled by a client disconnect."),
                ("timed_out_requests", self.ended_early["timeout"], "Requests ended by the request timeout."),
                ("failed_requests", self.ended_early["error"], "Requests ended by an error."),
            ):
                lines += [f"# HELP specdecode_{name}_total {help_}", f"# TYPE specdecode_{name}_total counter",
                          f"specdecode_{name}_total {value}"]
            for name, values, help_ in (
                ("spec_decode_num_draft_tokens_per_pos", self.drafted_by_position, "Tokens drafted at each draft position."),
                ("spec_decode_num_accepted_tokens_per_pos", self.accepted_by_position, "Tokens accepted at each draft position."),
            ):
                lines += [f"# HELP specdecode_{name}_total {help_}", f"# TYPE specdecode_{name}_total counter"]
                lines += [f'specdecode_{name}_total{{position="{i}"}} {n}' for i, n in enumerate(values)]
            lines += ["# HELP specdecode_draft_length_steps_total Decode steps by batch size and chosen draft length.",
                      "# TYPE specdecode_draft_length_steps_total counter"]
            lines += [f'specdecode_draft_length_steps_total{{batch_size="{b}",draft_length="{k}"}} {n}'
                      for (b, k), n in sorted(self.draft_lengths.items())]
            for histogram in (self.accepted_lengths, self.batch_size, self.ttft, self.itl, self.latency):
                lines += histogram.render()
        return "\n".join(lines) + "\n"
