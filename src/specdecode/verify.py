"""Acceptance of drafted tokens (Leviathan et al. 2022, Algorithm 1; Chen et al. 2023).

Glossary:
- *drafted tokens*: the k tokens x_1..x_k the drafter proposed, with draft probabilities
  q_i(x) (one-hot when the drafter gives none).
- *accepted*: x_i is kept with probability min(1, p_i(x_i) / q_i(x_i)), p_i being the
  target's processed distribution at that position; acceptance stops at the first rejection.
- *rejected*: the first drafted token that fails; it and everything after it are discarded.
- *residual*: normalize(max(0, p_i - q_i)); the replacement for a rejected token is drawn from it.
- *bonus*: when all k are accepted, one more token is drawn from the target's p_{k+1}.

Every step therefore yields num_accepted + 1 tokens, distributed exactly as the target alone
would produce them. Temperature 0 is the same rule with one-hot distributions, computed as
"accept while the draft equals the target's argmax".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .config import SamplingParams
from .sampling import processed_probs, sample


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # [B] long: how many drafted tokens each row keeps
    next_tokens: torch.Tensor  # [B] long: the replacement (after a rejection) or the bonus token


def acceptance_probability(target_prob_x: torch.Tensor, draft_prob_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) for drafted tokens x. Both: [...]; q(x) > 0 since x was drawn from q."""
    return torch.clamp(target_prob_x / draft_prob_x, max=1.0)


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)). Both: [..., V] -> [..., V].

    The residual is empty only when p == q, and then a rejection has probability 0; if float
    rounding still produces one, the target distribution itself is returned (never NaN).
    """
    residual = torch.clamp(target_probs - draft_probs, min=0.0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / torch.where(mass > 0, mass, 1.0), target_probs)


def verify(
    draft_tokens: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor | None,  # [B, k, V] or None (deterministic proposal)
    target_logits: torch.Tensor,  # [B, k+1, V]
    params: SamplingParams,
    generators: Sequence[torch.Generator],  # one per row
    draft_lengths: Sequence[int] | None = None,  # real drafts per row (rows are right-padded); None: all k
) -> VerifyResult:
    """Row b keeps at most draft_lengths[b] drafts; its next token comes from position
    num_accepted[b] (a residual after a rejection, else the bonus after its own last draft)."""
    if params.greedy:
        return _verify_greedy(draft_tokens, target_logits, draft_lengths)
    return _verify_sampled(draft_tokens, draft_probs, processed_probs(target_logits, params), generators, draft_lengths)


def _verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor, draft_lengths=None) -> VerifyResult:
    target_choice = target_logits.argmax(-1)  # [B, k+1]
    k = draft_tokens.shape[1]
    agree = (draft_tokens == target_choice[:, :k]).long()  # [B, k]
    num_accepted = agree.cumprod(dim=1).sum(dim=1)  # [B]
    if draft_lengths is not None:
        num_accepted = torch.minimum(num_accepted, torch.tensor(list(draft_lengths), device=num_accepted.device))
    next_tokens = target_choice.gather(1, num_accepted[:, None]).squeeze(1)  # [B]
    return VerifyResult(num_accepted, next_tokens)


def _one_hot_like(tokens: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """tokens [B, k] -> one-hot [B, k, V] in the dtype of like [B, *, V]."""
    return torch.nn.functional.one_hot(tokens, like.shape[-1]).to(like.dtype)


def _verify_sampled(
    draft_tokens: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor | None,  # [B, k, V] or None
    target_probs: torch.Tensor,  # [B, k+1, V]
    generators: Sequence[torch.Generator],
    draft_lengths: Sequence[int] | None = None,
) -> VerifyResult:
    batch, k = draft_tokens.shape
    if draft_probs is None:
        draft_probs = _one_hot_like(draft_tokens, target_probs)
    draft_probs = draft_probs.to(target_probs.dtype)
    index = draft_tokens[..., None]  # [B, k, 1]
    target_prob_x = target_probs[:, :k].gather(-1, index).squeeze(-1)  # [B, k]
    draft_prob_x = draft_probs.gather(-1, index).squeeze(-1)  # [B, k]
    accept_prob = acceptance_probability(target_prob_x, draft_prob_x)  # [B, k]

    num_accepted = torch.empty(batch, dtype=torch.long)
    next_tokens = torch.empty(batch, dtype=torch.long)
    for row in range(batch):
        k_row = k if draft_lengths is None else int(draft_lengths[row])
        uniforms = torch.rand(
            k_row, generator=generators[row], dtype=target_probs.dtype, device=target_probs.device
        )  # [k_row]
        accepted = (uniforms < accept_prob[row, :k_row]).long()
        n = int(accepted.cumprod(0).sum())
        if n < k_row:
            next_dist = residual_distribution(target_probs[row, n], draft_probs[row, n])  # [V]
        else:
            next_dist = target_probs[row, k_row]  # bonus
        num_accepted[row] = n
        next_tokens[row] = sample(next_dist[None], generators[row])[0]
    return VerifyResult(num_accepted, next_tokens)
