"""Hybrid drafting: an n-gram continuation when one is long enough, else the draft model.

Glossary: a *lookup proposal* comes from the n-gram index (deterministic, ``probs=None``); a
*model proposal* from the draft model (with its probabilities). Each step uses one source for
the whole proposal, chosen from the context alone, so verification stays exact. The draft
model's cache stays in step either way: it feeds the committed tokens it has not seen at its
next proposal.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..config import SamplingParams
from .base import Draft
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

    def reset(self, prompt_ids: torch.Tensor) -> None:
        self.model.reset(prompt_ids)
        self.lookup.reset(prompt_ids)

    def propose(self, context: torch.Tensor, k: int, params: SamplingParams, generators: Sequence[torch.Generator]) -> Draft:
        found = self.lookup.propose(context, k, params, generators)
        if found.tokens.shape[1] >= min(k, self.min_lookup):
            self.last_source = "lookup"
            self.lookup_steps += 1
            return found
        self.last_source = "model"
        self.model_steps += 1
        return self.model.propose(context, k, params, generators)

    def commit(self, num_accepted: torch.Tensor) -> None:
        if self.last_source == "model":
            self.model.commit(num_accepted)
