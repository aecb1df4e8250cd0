"""Prompt-lookup drafting: propose what followed the last earlier occurrence of the context's tail.

Glossary:
- *tail n-gram*: the context's last n tokens; n is tried from ``max_n`` down to ``min_n``.
- *continuation*: the tokens that followed the most recent earlier occurrence of that n-gram,
  in the prompt or in the generated text; up to k of them are proposed.
- The proposal is deterministic (``probs=None``): verification treats it as one-hot, which
  keeps sampling exact.

The index is updated incrementally with each new committed token (O(max_n) work per token),
so a lookup never rescans the context.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..config import SamplingParams
from .base import Contexts, Draft, padded_draft


class _RowIndex:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.indexed = 0  # n-grams ending before this position are in the tables
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}

    def extend(self, context: list[int]) -> None:
        """Bring the index up to a longer context (tokens already seen must be unchanged)."""
        if len(context) < len(self.tokens) or context[: len(self.tokens)] != self.tokens[: len(context)]:
            self.__init__(self.min_n, self.max_n)  # context rewound: rebuild (only on reset)
        self.tokens = list(context)
        # an n-gram ending at position e (exclusive) maps to its continuation start e; only
        # n-grams with a continuation (e < len) are indexed, so the live tail never matches itself
        for end in range(max(self.indexed, 1), len(self.tokens)):
            for n, table in self.tables.items():
                if end >= n:
                    table[tuple(self.tokens[end - n : end])] = end
        self.indexed = max(self.indexed, len(self.tokens))

    def lookup(self, k: int) -> list[int]:
        length = len(self.tokens)
        for n in range(self.max_n, self.min_n - 1, -1):
            if length < n:
                continue
            start = self.tables[n].get(tuple(self.tokens[length - n :]))
            if start is not None:
                return self.tokens[start : start + k]
        return []


class NgramDrafter:
    max_batch = 1 << 20  # an index per row: no limit of its own

    def __init__(self, vocab_size: int, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.vocab_size = vocab_size
        self.min_n, self.max_n = min_n, max_n
        self.rows: list[_RowIndex] = []

    def reset(self, batch_size: int) -> None:
        self.rows = [_RowIndex(self.min_n, self.max_n) for _ in range(batch_size)]

    def start(self, rows: Sequence[int], contexts: Contexts) -> None:
        for slot, ids in zip(rows, contexts):
            self.rows[slot] = _RowIndex(self.min_n, self.max_n)
            self.rows[slot].extend(list(ids))

    def propose(
        self,
        rows: Sequence[int],
        contexts: Contexts,
        limits: Sequence[int],
        params: SamplingParams,
        generators: Sequence[torch.Generator],
        min_confidence: float = 0.0,  # lookups carry no probabilities: unused
    ) -> Draft:
        proposals = []
        for slot, ids, limit in zip(rows, contexts, limits):
            index = self.rows[slot]
            index.extend(list(ids))
            proposals.append(index.lookup(limit) if limit > 0 else [])
        return padded_draft(proposals, None, self.vocab_size)

    def commit(self, rows: Sequence[int], num_accepted: torch.Tensor) -> None:
        """Nothing to roll back: only committed tokens ever enter the index."""
