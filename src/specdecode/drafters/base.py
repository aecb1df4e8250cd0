"""The Drafter contract.

Glossary:
- *context*: every committed token of a row (prompt + generated), the last one included.
- *proposal*: k' <= k tokens the drafter guesses come next, with the draft distribution each
  was drawn from, or ``probs=None`` for a deterministic proposal (treated as one-hot, exact).
- *commit*: after verification the drafter learns how many of its tokens were accepted, so it
  can keep any cache of its own in step with the committed tokens.
- *rows / slots*: in a batch, each call names the batch slots it concerns (``rows``); the
  contexts, per-row draft limits ``k`` and generators are given in the same order. Without
  ``rows`` a call covers slots 0..n-1 (the single-request case). A proposal is right-padded to
  its longest row; ``Draft.lengths`` says how many tokens of each row are real.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, Union

import torch

from ..config import SamplingParams


Contexts = Union[torch.Tensor, Sequence[Sequence[int]]]  # [n, L] or one token list per row


@dataclass
class Draft:
    tokens: torch.Tensor  # [n, k'] long, right-padded
    probs: torch.Tensor | None  # [n, k', V] or None (deterministic proposal)
    lengths: list[int] | None = None  # real tokens of each row; None: every row has k'

    def row_lengths(self) -> list[int]:
        return list(self.lengths) if self.lengths is not None else [self.tokens.shape[1]] * self.tokens.shape[0]


class Drafter(Protocol):
    vocab_size: int

    def begin_batch(self, batch_size: int) -> None:  # empty slots 0..batch_size-1
        ...

    def reset(self, prompt_ids: Contexts, rows: Sequence[int] | None = None) -> None:
        ...

    def propose(
        self,
        context: Contexts,
        k: int | Sequence[int],
        params: SamplingParams,
        generators: Sequence[torch.Generator],
        rows: Sequence[int] | None = None,
        min_confidence: float = 0.0,
    ) -> Draft:
        """Up to k tokens per row; a drafter with probabilities stops a row after a token it gave
        less than min_confidence (that token is still proposed)."""
        ...

    def commit(self, num_accepted: torch.Tensor, rows: Sequence[int] | None = None) -> None:  # [n]
        ...


def as_rows(context: Contexts) -> list[list[int]]:
    return context.tolist() if isinstance(context, torch.Tensor) else [list(map(int, row)) for row in context]


def per_row(k: int | Sequence[int], n: int) -> list[int]:
    return [int(k)] * n if isinstance(k, int) else [int(x) for x in k]


def padded_draft(tokens: list[list[int]], probs: list[list[torch.Tensor]] | None, vocab: int,
                 dtype: torch.dtype = torch.float32) -> Draft:
    """Right-pad per-row proposals (token 0, zero probabilities) into one Draft."""
    width = max((len(t) for t in tokens), default=0)
    ids = torch.zeros((len(tokens), width), dtype=torch.long)
    for j, row in enumerate(tokens):
        ids[j, : len(row)] = torch.tensor(row, dtype=torch.long)
    stacked = None
    if probs is not None:
        stacked = torch.zeros((len(tokens), width, vocab), dtype=dtype)
        for j, row in enumerate(probs):
            for i, p in enumerate(row):
                stacked[j, i] = p
    lengths = [len(t) for t in tokens]
    return Draft(ids, stacked, None if all(n == width for n in lengths) else lengths)
