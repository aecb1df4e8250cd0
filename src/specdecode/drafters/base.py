"""The Drafter contract.

Glossary:
- *context*: every committed token of a row (prompt + generated), the last one included.
- *proposal*: up to k tokens a row's drafter guesses come next, with the draft distribution each
  was drawn from, or ``probs=None`` for a deterministic proposal (treated as one-hot, exact).
- *start*: a row's drafter takes its request's context (a draft model prefills it).
- *commit*: after verification the drafter learns how many of its tokens were accepted, so it
  can keep any cache of its own in step with the committed tokens.
- *features*: a drafter that drafts from the target's hidden states (a draft head) names the
  hidden-state indices it reads in ``feature_layers``; the engine then asks the target for them
  in every pass and hands each row's committed states over with ``take_features``.
- *rows*: every call is ragged-batched: it names the batch slots it concerns, and gives their
  contexts, draft limits and generators in the same order (one request is slot 0 of a batch of
  one). A proposal is right-padded to its longest row; ``Draft.lengths`` says how many tokens of
  each row are real.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from ..config import SamplingParams

Contexts = Sequence[Sequence[int]]  # one token list per row


@dataclass
class Draft:
    tokens: torch.Tensor  # [n, k'] long, right-padded
    probs: torch.Tensor | None  # [n, k', V] or None (deterministic proposal)
    lengths: list[int]  # [n] real tokens of each row

    @classmethod
    def empty(cls, rows: int) -> "Draft":
        return cls(torch.empty((rows, 0), dtype=torch.long), None, [0] * rows)


class Drafter(Protocol):
    vocab_size: int
    max_batch: int  # most rows it drafts for together

    def reset(self, batch_size: int) -> None:  # empty slots 0..batch_size-1
        ...

    def start(self, rows: Sequence[int], contexts: Contexts) -> None:
        ...

    def propose(
        self,
        rows: Sequence[int],
        contexts: Contexts,
        limits: Sequence[int],  # [n] most tokens to draft per row
        params: SamplingParams,
        generators: Sequence[torch.Generator],  # [n]
        min_confidence: float = 0.0,
    ) -> Draft:
        """Up to limits[j] tokens for row j; a drafter with probabilities stops a row after a
        token it gave less than min_confidence (that token is still proposed)."""
        ...

    def commit(self, rows: Sequence[int], num_accepted: torch.Tensor) -> None:  # num_accepted [n]
        ...


class FeatureDrafter(Drafter, Protocol):
    feature_layers: tuple[int, ...]  # hidden-state indices it reads (``runners.hf``)

    def take_features(self, rows: Sequence[int], starts: Sequence[int],
                      features: Sequence[torch.Tensor | None]) -> None:
        """features[j] [count, L, H]: row rows[j]'s committed tokens' states from position starts[j]."""
        ...


def feature_layers(drafter) -> tuple[int, ...] | None:
    """The hidden-state indices a drafter reads from the target (None: it reads none)."""
    layers = getattr(drafter, "feature_layers", None)
    return tuple(layers) if layers else None


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
    return Draft(ids, stacked, [len(t) for t in tokens])


def spread(draft: Draft, held: Sequence[int], n: int) -> Draft:
    """A draft over rows ``held`` of n -> a draft over all n; the other rows propose nothing."""
    tokens = torch.zeros((n, draft.tokens.shape[1]), dtype=torch.long)
    tokens[list(held)] = draft.tokens
    probs = None
    if draft.probs is not None:
        probs = draft.probs.new_zeros((n,) + tuple(draft.probs.shape[1:]))
        probs[list(held)] = draft.probs
    lengths = [0] * n
    for j, length in zip(held, draft.lengths):
        lengths[j] = length
    return Draft(tokens, probs, lengths)
