"""What the API returns: a request's result, the chunks of a stream, and a batch's results.

Glossary: a *chunk* is the text and tokens one engine step added to a streamed request (text
is held back while it could still be the start of a stop string, see ``specdecode.text``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from .stats import BatchStats, GenerationStats
from .text import TextStream


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # new tokens only
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    stats: GenerationStats

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "stats": self.stats.to_dict(),
        }


@dataclass
class StreamChunk:
    text: str  # newly emitted text (may be empty)
    token_ids: list[int]  # this step's new tokens that belong to the output
    finish_reason: str | None


class GenerationStream:
    """Iterate for chunks; ``result`` is set once the stream is exhausted or closed."""

    def __init__(self, chunks: Iterator[StreamChunk]):
        self._chunks = chunks
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[StreamChunk]:
        return self._chunks

    def close(self) -> None:
        self._chunks.close()  # type: ignore[attr-defined]


@dataclass
class BatchResult:
    results: list[GenerationResult]  # in the order of the prompts
    stats: BatchStats

    def to_dict(self) -> dict:
        return {"batch": self.stats.to_dict(), "results": [r.to_dict() for r in self.results]}


def chunk_of_step(text: TextStream, stats: GenerationStats, step) -> StreamChunk:
    """An engine step's tokens (``engine.RowStep``) through a request's text stream: a stop
    string ends the request ("stop") and the stats then count only the tokens kept; a final
    chunk carries the rest of the text."""
    delta = text.push(step.tokens)
    kept = step.tokens[: delta.kept_tokens]
    finish = "stop" if delta.stopped else step.finish_reason
    if delta.stopped:
        stats.new_tokens -= len(step.tokens) - delta.kept_tokens
    if finish is not None:
        return StreamChunk(delta.text + text.finish(), kept, finish)
    return StreamChunk(delta.text, kept, None)
