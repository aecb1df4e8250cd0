"""Turning logits into the distribution tokens are drawn from.

Glossary:
- *processed distribution*: softmax(logits / temperature) restricted to the top-k tokens and
  then to the smallest nucleus whose mass reaches top-p, renormalised. Draft and target go
  through the same function, so acceptance compares like with like.
- *greedy*: temperature 0; the distribution is one-hot at the argmax (ties: lowest id).

Randomness comes only from an explicit ``torch.Generator``.
"""

from __future__ import annotations

import torch

from .config import SamplingParams


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p.

    logits: [..., V]  ->  probs: [..., V] (float64 when the logits are float64, else float32)
    """
    work_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.to(work_dtype)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(work_dtype)
    scaled = logits / params.temperature
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        probs = _nucleus(probs, params.top_p)
    return probs


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p. probs: [..., V]"""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [..., V]
    keep_sorted = mass_before < top_p  # the top token always survives (mass_before = 0)
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = probs * keep
    return kept / kept.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row. probs: [N, V] -> tokens: [N] (long)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pick one token per row and return (tokens [N], probs [N, V] or None when greedy).

    logits: [N, V]. Greedy returns no probabilities: the choice is deterministic (one-hot).
    """
    if params.greedy:
        return logits.argmax(-1), None
    probs = processed_probs(logits, params)
    return sample(probs, generator), probs


def seeded_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's random stream: seeded when a seed is given, from the OS otherwise."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
