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
from .base import Contexts, Draft, padded_draft
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

    @property
    def max_batch(self) -> int:
        return self.model.max_batch

    def reset(self, batch_size: int) -> None:
        self.model.reset(batch_size)
        self.lookup.reset(batch_size)

    def start(self, rows: Sequence[int], contexts: Contexts) -> None:
        self.model.start(rows, contexts)
        self.lookup.start(rows, contexts)

    def propose(self, rows: Sequence[int], contexts: Contexts, limits: Sequence[int], params: SamplingParams,
                generators: Sequence[torch.Generator], min_confidence: float = 0.0) -> Draft:
        """Per row: the lookup when it finds at least min(k, min_lookup) tokens, else the model."""
        n = len(contexts)
        found = self.lookup.propose(rows, contexts, limits, params, generators)
        by_model = [j for j in range(n) if found.lengths[j] < min(limits[j], self.min_lookup)]
        self.lookup_steps += n - len(by_model)
        self.model_steps += len(by_model)
        self._model_rows.extend(rows[j] for j in by_model)  # (a step may propose per sampling group)
        self.last_source = "model" if by_model else "lookup"
        if not by_model:
            return found
        drafted = self.model.propose([rows[j] for j in by_model], [contexts[j] for j in by_model],
                                     [limits[j] for j in by_model], params, [generators[j] for j in by_model],
                                     min_confidence)
        if len(by_model) == n:
            return drafted
        tokens = [found.tokens[j, : found.lengths[j]].tolist() for j in range(n)]
        for i, j in enumerate(by_model):
            tokens[j] = drafted.tokens[i, : drafted.lengths[i]].tolist()
        probs = None
        if drafted.probs is not None:  # lookup rows are one-hot, model rows keep their distributions
            probs = [[torch.nn.functional.one_hot(torch.tensor(t), self.vocab_size).to(drafted.probs.dtype) for t in row]
                     for row in tokens]
            for i, j in enumerate(by_model):
                probs[j] = list(drafted.probs[i, : drafted.lengths[i]])
        return padded_draft(tokens, probs, self.vocab_size, drafted.probs.dtype if drafted.probs is not None else torch.float32)

    def commit(self, rows: Sequence[int], num_accepted: torch.Tensor) -> None:
        """num_accepted [n]: the model rows proposed since the last commit roll the draft model's cache back."""
        model_rows, self._model_rows = self._model_rows, []
        if not model_rows:
            return
        position = {int(r): j for j, r in enumerate(rows)}
        self.model.commit(model_rows, num_accepted[[position[int(r)] for r in model_rows]])
