"""The Drafter contract.

Glossary:
- *context*: every committed token of a row (prompt + generated), the last one included.
- *proposal*: k' <= k tokens the drafter guesses come next, with the draft distribution each
  was drawn from, or ``probs=None`` for a deterministic proposal (treated as one-hot, exact).
- *commit*: after verification the drafter learns how many of its tokens were accepted, so it
  can keep any cache of its own in step with the committed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from ..config import SamplingParams


@dataclass
class Draft:
    tokens: torch.Tensor  # [B, k'] long
    probs: torch.Tensor | None  # [B, k', V] or None (deterministic proposal)


class Drafter(Protocol):
    vocab_size: int

    def reset(self, prompt_ids: torch.Tensor) -> None:  # [B, T]
        ...

    def propose(
        self,
        context: torch.Tensor,  # [B, L]
        k: int,
        params: SamplingParams,
        generators: Sequence[torch.Generator],
    ) -> Draft:
        ...

    def commit(self, num_accepted: torch.Tensor) -> None:  # [B]
        ...
