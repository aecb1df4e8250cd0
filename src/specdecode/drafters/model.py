"""A smaller language model as drafter.

Glossary: the draft model samples k tokens one at a time from its processed distribution
(same temperature / top-k / top-p as the target). Its cache holds a prefix of the context;
each proposal first feeds whatever committed tokens it has not seen, and ``commit`` drops the
drafted tokens that were not accepted.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..config import SamplingParams
from ..runners import Runner, cache_all_but_last
from ..sampling import choose
from .base import Draft


class ModelDrafter:
    def __init__(self, runner: Runner, min_confidence: float = 0.0):
        """min_confidence: stop drafting after a token the draft gave less than this probability
        (the token itself is still proposed; the decision never depends on later draws)."""
        self.runner = runner
        self.min_confidence = min_confidence
        self.vocab_size = runner.vocab_size
        self._context_length = 0  # committed tokens at the last proposal

    def reset(self, prompt_ids: torch.Tensor) -> None:
        """prompt_ids [B, T]: cache all but the last prompt token (it is fed with the first proposal)."""
        cache_all_but_last(self.runner, prompt_ids)

    def propose(
        self,
        context: torch.Tensor,  # [B, L]
        k: int,
        params: SamplingParams,
        generators: Sequence[torch.Generator],
    ) -> Draft:
        self._context_length = context.shape[1]
        cached = int(self.runner.lengths[0])
        logits = self.runner.forward(context[:, cached:])[:, -1]  # [B, V]
        tokens, probs = [], []
        for i in range(k):
            token, prob = self._choose_rows(logits, params, generators)  # [B], [B, V] | None
            tokens.append(token)
            probs.append(prob)
            if i + 1 < k and self._confident(logits, token, prob):
                logits = self.runner.forward(token[:, None])[:, -1]
            else:
                break
        draft_tokens = torch.stack(tokens, dim=1)  # [B, k]
        draft_probs = None if params.greedy else torch.stack(probs, dim=1)  # [B, k, V]
        return Draft(draft_tokens, draft_probs)

    def _confident(self, logits: torch.Tensor, token: torch.Tensor, prob: torch.Tensor | None) -> bool:
        """Every row's chosen token has draft probability >= min_confidence. logits [B, V], token [B]."""
        if self.min_confidence <= 0:
            return True
        dist = prob if prob is not None else torch.softmax(logits.float(), dim=-1)  # [B, V]
        return bool((dist.gather(-1, token[:, None]) >= self.min_confidence).all())

    def commit(self, num_accepted: torch.Tensor) -> None:
        """num_accepted [B]: keep the context plus the accepted drafted tokens that are cached."""
        cached = self.runner.lengths  # [B]
        self.runner.truncate(torch.minimum(cached, self._context_length + num_accepted.cpu()))

    @staticmethod
    def _choose_rows(logits, params, generators):
        """logits [B, V] -> tokens [B], probs [B, V] | None, each row drawn with its own generator."""
        if params.greedy or len(generators) == 1:
            return choose(logits, params, generators[0])
        picks = [choose(logits[b : b + 1], params, g) for b, g in enumerate(generators)]
        return torch.cat([t for t, _ in picks]), torch.cat([p for _, p in picks])
