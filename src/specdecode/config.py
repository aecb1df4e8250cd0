"""Frozen request and engine configuration, validated where it is built.

Glossary:
- *greedy*: temperature 0; every choice is the argmax of the target's logits.
- *gamma*: how many tokens the drafter proposes per step (the draft length).
- *stop strings*: text that ends a request; the text before it is returned, the stop itself is not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .errors import SpecDecodeError

DEFAULT_DRAFT_VOCAB = None  # token ids a llama.cpp draft scores, None: all (see runners.llamacpp.trim_vocabulary)
# the weight format a llama.cpp draft runs in: 'source' as its GGUF ships, or a copy llama.cpp
# requantizes (see runners.llamacpp.requantized_gguf); q4_0 drafts a token faster than Q4_K_M
DRAFT_QUANTS = ("source", "q4_0", "q8_0")
DEFAULT_DRAFT_QUANT = "q4_0"
# where a llama.cpp draft prefills a prompt: on the int8 path, its keys and values then copied
# into llama.cpp's cache (see runners.llamacpp), or in llama.cpp itself
DRAFT_PREFILLS = ("int8", "llamacpp")
DEFAULT_DRAFT_PREFILL = "int8"
# the adaptive policy's confidence stop: a draft model stops drafting after a token it gave less
# than this probability (0.5 to 0.8 all beat no stop on HumanEval greedy, docs/benchmarks.md);
# a fixed gamma drafts gamma tokens unless told otherwise
ADAPTIVE_DRAFT_CONFIDENCE = 0.7


def parse_draft_vocab(value) -> int | None:
    """--draft-vocab: 'full' (None) or a positive count of token ids; a one-line error otherwise."""
    text = str(value).strip().lower()
    if text == "full":
        return None
    count = int(text) if text.isdigit() else 0
    if count < 1:
        raise SpecDecodeError(f"--draft-vocab must be a positive number of token ids or 'full', got '{value}'",
                              field="draft_vocab")
    return count


def check_draft_quant(value) -> str:
    """--draft-quant: one of DRAFT_QUANTS; a one-line error otherwise."""
    if value not in DRAFT_QUANTS:
        raise SpecDecodeError(f"draft_quant must be one of {', '.join(DRAFT_QUANTS)}, got {value!r}", field="draft_quant")
    return value


def draft_prefill_for(flag: str | None, one_prompt: bool = False) -> str:
    """--draft-prefill as given, else the default: llamacpp for a single prompt (loading the int8
    copy of the draft takes longer than it saves on one prompt), int8 otherwise."""
    if flag is not None:
        return flag
    return "llamacpp" if one_prompt else DEFAULT_DRAFT_PREFILL


def check_draft_prefill(value) -> str:
    """--draft-prefill: one of DRAFT_PREFILLS; a one-line error otherwise."""
    if value not in DRAFT_PREFILLS:
        raise SpecDecodeError(f"draft_prefill must be one of {', '.join(DRAFT_PREFILLS)}, got {value!r}", field="draft_prefill")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. The same transform is applied to draft and target logits."""

    temperature: float = 0.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # 1.0 disables nucleus filtering
    max_new_tokens: int = 128
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None
    ignore_eos: bool = False  # an end-of-sequence token is a token like any other: always max_new_tokens

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
        if not isinstance(self.ignore_eos, bool):
            raise SpecDecodeError(f"ignore_eos must be true or false, got {self.ignore_eos!r}", field="ignore_eos")

    def stopping_ids(self, eos_ids):
        """The tokens that end a request under these settings (none with ignore_eos)."""
        return [] if self.ignore_eos else list(eos_ids)

    def warmup(self, max_new_tokens: int) -> "SamplingParams":
        """The same sampling settings for a short warm-up run, no stop strings."""
        return replace(self, max_new_tokens=max_new_tokens, stop=())

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class SpecConfig:
    """Engine settings that do not change per token.

    gamma: tokens drafted per step, or "auto" for the adaptive policy (up to max_gamma).
    draft_confidence: a draft model stops drafting after a token it gave less than this
    probability; None: ADAPTIVE_DRAFT_CONFIDENCE with the adaptive policy, off with a fixed gamma
    (``stop_confidence`` is the value in force).
    lookup_fill: with the adaptive policy and a draft model, a long enough prompt lookup drafts
    instead of the model, and steps the policy makes plain draft any lookup (``engine``'s glossary).
    """

    gamma: int | str = 5
    max_gamma: int = 8
    draft_confidence: float | None = None
    lookup_fill: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.gamma, str):
            if self.gamma != "auto":
                try:
                    object.__setattr__(self, "gamma", int(self.gamma))
                except ValueError:
                    raise SpecDecodeError(f"gamma must be an integer >= 1 or 'auto', got {self.gamma!r}", field="gamma") from None
        if self.gamma != "auto" and (not isinstance(self.gamma, int) or isinstance(self.gamma, bool) or self.gamma < 1):
            raise SpecDecodeError(f"gamma must be an integer >= 1 or 'auto', got {self.gamma!r}", field="gamma")
        if not isinstance(self.max_gamma, int) or not 1 <= self.max_gamma <= 32:
            raise SpecDecodeError(f"max_gamma must be an integer in 1..32, got {self.max_gamma!r}", field="max_gamma")
        if self.draft_confidence is not None:
            _check_number("draft_confidence", self.draft_confidence)
            if not 0 <= self.draft_confidence < 1:
                raise SpecDecodeError(f"draft_confidence must be in [0, 1), got {self.draft_confidence}", field="draft_confidence")

    @property
    def adaptive(self) -> bool:
        return self.gamma == "auto"

    @property
    def stop_confidence(self) -> float:
        """The draft probability below which a draft model stops drafting (0: never)."""
        if self.draft_confidence is not None:
            return self.draft_confidence
        return ADAPTIVE_DRAFT_CONFIDENCE if self.adaptive else 0.0

    @property
    def longest_draft(self) -> int:
        return self.max_gamma if self.adaptive else int(self.gamma)


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpecDecodeError(f"{name} must be a finite number, got {value!r}", field=name)
