"""Frozen request and engine configuration, validated where it is built.

Glossary:
- *greedy*: temperature 0; every choice is the argmax of the target's logits.
- *gamma*: how many tokens the drafter proposes per step (the draft length).
- *stop strings*: text that ends a request; the text before it is returned, the stop itself is not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import SpecDecodeError


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. The same transform is applied to draft and target logits."""

    temperature: float = 0.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # 1.0 disables nucleus filtering
    max_new_tokens: int = 128
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None

    def __post_init__(self) -> None:
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise SpecDecodeError(f"temperature must be >= 0, got {self.temperature}", field="temperature")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise SpecDecodeError(f"top_k must be an integer >= 0, got {self.top_k!r}", field="top_k")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise SpecDecodeError(f"top_p must be in (0, 1], got {self.top_p}", field="top_p")
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise SpecDecodeError(
                f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}", field="max_new_tokens"
            )
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise SpecDecodeError("stop must be non-empty strings", field="stop")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise SpecDecodeError(f"seed must be an integer, got {self.seed!r}", field="seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class SpecConfig:
    """Engine settings that do not change per token."""

    gamma: int = 5

    def __post_init__(self) -> None:
        if not isinstance(self.gamma, int) or isinstance(self.gamma, bool) or self.gamma < 1:
            raise SpecDecodeError(f"gamma must be an integer >= 1, got {self.gamma!r}", field="gamma")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpecDecodeError(f"{name} must be a finite number, got {value!r}", field=name)
