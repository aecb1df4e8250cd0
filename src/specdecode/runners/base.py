"""The Runner contract.

Glossary:
- *cache length*: how many tokens of a row the runner's KV cache holds.
- *prefill*: reset the cache and run a prompt; returns the logits after its last token.
- *forward*: append tokens at each row's cursor and return logits for every new position.
- *truncate*: drop cached tokens so each row holds exactly ``lengths[b]`` tokens.

Contract (tested for every runner): ``prefill(a + b)`` gives the same logits as
``prefill(a); forward(b)``, and ``truncate`` followed by ``forward`` equals a fresh pass.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Runner(Protocol):
    vocab_size: int  # width of the logits
    max_context: int  # most tokens a row may hold
    device: torch.device

    @property
    def lengths(self) -> torch.Tensor:  # [B] long
        ...

    def reset(self, batch_size: int = 1) -> None:
        ...

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:  # ids [B, T] -> logits [B, V]
        ...

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [B, S] -> logits [B, S, V]
        ...

    def truncate(self, lengths: torch.Tensor) -> None:  # lengths [B]
        ...


def cache_all_but_last(runner: Runner, ids: torch.Tensor) -> None:
    """ids [B, T]: reset the runner to hold every token but the last (the first one fed to decode)."""
    if ids.shape[1] > 1:
        runner.prefill(ids[:, :-1])
    else:
        runner.reset(ids.shape[0])
