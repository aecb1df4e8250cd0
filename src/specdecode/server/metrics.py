"""Prometheus counters for the server.

Glossary: *accepted length* is the number of drafted tokens one target forward kept; its
histogram has one bucket per possible length.
"""

from __future__ import annotations

import threading
from collections import Counter


class Metrics:
    def __init__(self, max_accepted: int):
        self.lock = threading.Lock()
        self.requests: Counter = Counter()  # (endpoint, status) -> count
        self.prompt_tokens = self.generated_tokens = self.drafted = self.accepted = self.cancelled = 0
        self.max_accepted = max_accepted
        self.accepted_hist = [0] * (max_accepted + 1)

    def request(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[(endpoint, status)] += 1

    def record(self, result) -> None:
        s = result.stats
        with self.lock:
            self.prompt_tokens += result.prompt_tokens
            self.generated_tokens += len(result.token_ids)
            self.drafted += s.drafted_tokens
            self.accepted += s.accepted_tokens
            for n in s.accepted_per_step:
                self.accepted_hist[min(n, self.max_accepted)] += 1

    def render(self) -> str:
        with self.lock:
            lines = ["# HELP specdecode_requests_total HTTP requests by endpoint and status.",
                     "# TYPE specdecode_requests_total counter"]
            lines += [f'specdecode_requests_total{{endpoint="{e}",status="{s}"}} {n}' for (e, s), n in sorted(self.requests.items())]
            for name, value, help_ in (
                ("prompt_tokens", self.prompt_tokens, "Prompt tokens of completed requests."),
                ("generated_tokens", self.generated_tokens, "Tokens returned to clients."),
                ("drafted_tokens", self.drafted, "Tokens proposed by the drafter."),
                ("accepted_tokens", self.accepted, "Drafted tokens the target accepted."),
                ("cancelled_requests", self.cancelled, "Requests cancelled by a client disconnect."),
            ):
                lines += [f"# HELP specdecode_{name}_total {help_}", f"# TYPE specdecode_{name}_total counter",
                          f"specdecode_{name}_total {value}"]
            lines += ["# HELP specdecode_accepted_length Accepted drafted tokens per target forward.",
                      "# TYPE specdecode_accepted_length histogram"]
            cumulative = 0
            total = 0
            for n, count in enumerate(self.accepted_hist):
                cumulative += count
                total += n * count
                lines.append(f'specdecode_accepted_length_bucket{{le="{n}"}} {cumulative}')
            lines += [f'specdecode_accepted_length_bucket{{le="+Inf"}} {cumulative}',
                      f"specdecode_accepted_length_sum {total}", f"specdecode_accepted_length_count {cumulative}"]
        return "\n".join(lines) + "\n"
