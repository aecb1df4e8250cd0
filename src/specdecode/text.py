"""Incremental detokenisation and stop strings.

Glossary:
- *emitted text*: what has been streamed to the caller so far; it never shrinks.
- *held-back text*: a tail not yet emitted because it may be the start of a stop string or an
  incomplete UTF-8 character.
- *stop string*: when it appears, the text before it is final, the stop itself is not returned,
  and generation ends (also when it falls in the middle of an accepted block).
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX_TOKENS = 4  # prompt tokens decoded with the output so leading spaces come out right


@dataclass
class TextDelta:
    text: str  # newly emitted text
    kept_tokens: int  # how many of this step's tokens belong to the output
    stopped: bool  # a stop string was found


class TextStream:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.prefix = list(prompt_ids[-PREFIX_TOKENS:])
        self.prefix_text = self._decode_raw(self.prefix)
        self.stop = stop
        self.token_ids: list[int] = []
        self.text = ""  # final text once finished; emitted text while running
        self._emitted = 0

    def _decode_raw(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def decode(self, ids: list[int]) -> str:
        full = self._decode_raw(self.prefix + ids)
        if full.startswith(self.prefix_text):
            return full[len(self.prefix_text) :]
        return self._decode_raw(ids)

    def push(self, tokens: list[int]) -> TextDelta:
        """Add a step's tokens; return the text that can be emitted now."""
        before = len(self.token_ids)
        self.token_ids.extend(tokens)
        full = self.decode(self.token_ids)
        stop = self._find_stop(full)
        if stop is not None:
            cut, end = stop
            kept = self._tokens_reaching(before, end)
            self.token_ids = self.token_ids[: before + kept]
            return TextDelta(self._emit(full[:cut]), kept, True)
        safe = len(full) - self._holdback(full)
        return TextDelta(self._emit(full[:safe]), len(tokens), False)

    def finish(self) -> str:
        """Flush held-back text at the end of generation."""
        full = self.decode(self.token_ids)
        stop = self._find_stop(full)
        return self._emit(full if stop is None else full[: stop[0]])

    def _emit(self, text: str) -> str:
        delta = text[self._emitted :]
        if delta:
            self._emitted = len(text)
            self.text = text
        return delta

    def _find_stop(self, full: str) -> tuple[int, int] | None:
        """(start, end) of the earliest stop string in the text, or None."""
        if not self.stop:
            return None
        start = max(0, self._emitted - max(len(s) for s in self.stop))
        hits = [(i, i + len(s)) for s in self.stop if (i := full.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _holdback(self, full: str) -> int:
        hold = 0
        if full.endswith("\ufffd"):
            hold = len(full) - len(full.rstrip("\ufffd"))
        for s in self.stop:
            for n in range(min(len(s) - 1, len(full)), 0, -1):
                if full.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return hold

    def _tokens_reaching(self, before: int, end: int) -> int:
        """Fewest of this step's tokens whose text contains the whole stop string."""
        for kept in range(1, len(self.token_ids) - before + 1):
            if len(self.decode(self.token_ids[: before + kept])) >= end:
                return kept
        return len(self.token_ids) - before


def answer_text(tokenizer, prompt_ids: list[int], token_ids: list[int]) -> str:
    """The text a whole answer decodes to after its prompt, as a stream of it would emit it."""
    stream = TextStream(tokenizer, prompt_ids)
    stream.push(list(token_ids))
    stream.finish()
    return stream.text
