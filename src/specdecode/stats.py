"""What a request and a batch report: tokens, passes, drafts, acceptance and where the time went.

Glossary:
- *target forward*: one verification pass (the prompt prefill is counted apart).
- *accepted by position*: how often draft position i was accepted, beside how often it was drafted.
- *rows per forward*: the mean number of requests a batched verification pass scored.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    new_tokens: int = 0
    target_forwards: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_by_position: list[int] = field(default_factory=list)  # [gamma]: accepted at draft position i
    drafted_by_position: list[int] = field(default_factory=list)  # [gamma]: drafted at draft position i
    accepted_per_step: list[int] = field(default_factory=list)  # accepted drafts of each target forward
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    wall_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_target_forward": self.tokens_per_target_forward,
            "accepted_by_position": list(self.accepted_by_position),
            "drafted_by_position": list(self.drafted_by_position),
            "prefill_seconds": self.prefill_seconds,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "wall_seconds": self.wall_seconds,
            "tokens_per_second": self.tokens_per_second,
        }

    def record_step(self, drafted: int, accepted: int) -> None:
        self.target_forwards += 1
        self.accepted_per_step.append(accepted)
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        for i in range(drafted):
            self.drafted_by_position[i] += 1
            self.accepted_by_position[i] += int(i < accepted)


@dataclass
class BatchStats:
    batch_size: int = 0  # slots
    new_tokens: int = 0  # over every row
    target_forwards: int = 0  # batched verification passes
    rows_per_forward: float = 0.0  # mean active rows per pass
    wall_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "batch_size": self.batch_size,
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "rows_per_forward": self.rows_per_forward,
            "wall_seconds": self.wall_seconds,
            "tokens_per_second": self.tokens_per_second,
        }
