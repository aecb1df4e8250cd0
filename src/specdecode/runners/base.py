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

from typing import Protocol, Sequence, runtime_checkable

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

    # Runners that batch requests (HFRunner, the test TableRunner) also take
    # prefill(ids, rows=...) and forward(ids, rows=..., counts=...): see runners.hf.

    def truncate(self, lengths: torch.Tensor) -> None:  # lengths [B]
        ...


def cache_all_but_last(runner: Runner, ids, rows: Sequence[int] | None = None) -> None:
    """Make the runner hold every prompt token but the last (the first one fed to decode).

    rows None: ids [B, T] starts a new batch. rows given: ids holds one prompt (token list) per
    named slot of the current batch; each slot is emptied and prefilled alone.
    """
    if rows is None:
        if ids.shape[1] > 1:
            runner.prefill(ids[:, :-1])
        else:
            runner.reset(ids.shape[0])
        return
    for row, prompt in zip(rows, ids):
        prompt = [int(t) for t in prompt]
        if len(prompt) > 1:
            runner.prefill(torch.tensor([prompt[:-1]]), rows=[row])
        else:
            lengths = runner.lengths.clone()
            lengths[row] = 0
            runner.truncate(lengths)
