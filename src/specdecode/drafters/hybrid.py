"""Hybrid drafting: an n-gram continuation when one is long enough, else the draft model.

Glossary: a *lookup proposal* comes from the n-gram index (deterministic, ``probs=None``); a
*model proposal* from the draft model (with its probabilities). Each step uses one source for
each row's whole proposal, chosen from that row's context alone, so verification stays exact. The draft
model's cache stays in step either way: it feeds the committed tokens it has not seen at its
next proposal.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..config import SamplingParams
from .base import Contexts, Draft, as_rows, padded_draft, per_row
from .model import ModelDrafter
from .ngram import NgramDrafter


class HybridDrafter:
    def __init__(self, model: ModelDrafter, lookup: NgramDrafter, min_lookup: int = 3):
        if model.vocab_size != lookup.vocab_size:
            raise ValueError("drafters disagree on the vocabulary size")
        self.model, self.lookup = model, lookup
        self.vocab_size = model.vocab_size
        self.min_lookup = min_lookup
        self.last_source: str | None = None
        self.lookup_steps = 0
        self.model_steps = 0
        self._model_rows: list[int] = []

    def begin_batch(self, batch_size: int) -> None:
        self.model.begin_batch(batch_size)
        self.lookup.begin_batch(batch_size)

    def reset(self, prompt_ids: Contexts, rows: Sequence[int] | None = None) -> None:
        self.model.reset(prompt_ids, rows)
        self.lookup.reset(prompt_ids, rows)

    def propose(self, context: Contexts, k: int | Sequence[int], params: SamplingParams,
                generators: Sequence[torch.Generator], rows: Sequence[int] | None = None,
                min_confidence: float = 0.0) -> Draft:
        """Per row: the lookup when it finds at least min(k, min_lookup) tokens, else the model."""
        contexts = as_rows(context)
        n = len(contexts)
        limits = per_row(k, n)
        found = self.lookup.propose(contexts, limits, params, generators, rows)
        found_lengths = found.row_lengths()
        by_model = [j for j in range(n) if found_lengths[j] < min(limits[j], self.min_lookup)]
        self.lookup_steps += n - len(by_model)
        self.model_steps += len(by_model)
        self._model_rows = by_model
        self.last_source = "model" if by_model else "lookup"
        if not by_model:
            return found
        slots = list(range(n)) if rows is None else list(rows)
        drafted = self.model.propose(
            [contexts[j] for j in by_model], [limits[j] for j in by_model], params,
            [generators[j] for j in by_model], None if rows is None and n == 1 else [slots[j] for j in by_model],
            min_confidence,
        )
        if len(by_model) == n:
            return drafted
        model_lengths = drafted.row_lengths()
        tokens = [found.tokens[j, : found_lengths[j]].tolist() for j in range(n)]
        for i, j in enumerate(by_model):
            tokens[j] = drafted.tokens[i, : model_lengths[i]].tolist()
        probs = None
        if drafted.probs is not None:  # lookup rows are one-hot, model rows keep their distributions
            probs = [[torch.nn.functional.one_hot(torch.tensor(t), self.vocab_size).to(drafted.probs.dtype) for t in row]
                     for row in tokens]
            for i, j in enumerate(by_model):
                probs[j] = list(drafted.probs[i, : model_lengths[i]])
        return padded_draft(tokens, probs, self.vocab_size, drafted.probs.dtype if drafted.probs is not None else torch.float32)

    def commit(self, num_accepted: torch.Tensor, rows: Sequence[int] | None = None) -> None:
        if not self._model_rows:
            return
        n = len(num_accepted)
        slots = list(range(n)) if rows is None else list(rows)
        self.model.commit(num_accepted[self._model_rows], [slots[j] for j in self._model_rows] if rows is not None or n > 1 else None)
