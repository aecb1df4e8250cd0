"""The Runner contract.

Glossary:
- *cache length*: how many tokens a row of the runner's KV cache holds.
- *batch*: the rows the runner holds, made by ``reset(batch_size)``; at most ``max_batch``.
- *rows*: the batch rows a call works on (default: every row, in order); the other rows are left
  untouched.
- *counts*: how many of a row's block tokens are real; the rest is right padding, which is
  scored (or not) and never kept in the cache.
- *prefill*: empty the named rows (without ``rows``: reset the batch to the block's rows) and run
  a prompt per row; returns the logits after each last token.
- *forward*: append tokens at each row's cursor and return logits for every new position.
- *truncate*: drop cached tokens so each row holds exactly ``lengths[b]`` tokens.
- *hidden states*: a pass can also return the residual-stream states of its positions at the
  layers a draft head reads (``return_hidden``, numbered as in ``runners.hf``).

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
    max_batch: int  # most rows a batch may have (1: one request at a time)
    device: torch.device

    @property
    def lengths(self) -> torch.Tensor:  # [B] long
        ...

    def reset(self, batch_size: int = 1) -> None:
        ...

    def prefill(self, ids: torch.Tensor, rows: Sequence[int] | None = None) -> torch.Tensor:
        ...  # ids [n, T] -> logits [n, V]

    def forward(self, ids: torch.Tensor, rows: Sequence[int] | None = None,
                counts: Sequence[int] | None = None) -> torch.Tensor:
        ...  # ids [n, S] -> logits [n, S, V]; positions past counts[j] are padding
    # A runner that serves draft heads (``runners.hf``) also takes return_hidden=[indices] in
    # prefill and forward and then returns (logits, states [n, T or S, len(indices), H]).

    def forward_last(self, ids: torch.Tensor, rows: Sequence[int] | None = None,
                     counts: Sequence[int] | None = None) -> torch.Tensor:
        ...  # ids [n, S] -> logits [n, V] after each row's last real token

    def truncate(self, lengths: torch.Tensor) -> None:  # lengths [B]
        ...


def cache_all_but_last(runner: Runner, ids, rows: Sequence[int] | None = None,
                       return_hidden: Sequence[int] | None = None) -> list[torch.Tensor | None] | None:
    """Make the runner hold every prompt token but the last (the first one fed to decode).

    rows None: ids [B, T] starts a new batch. rows given: ids holds one prompt (token list) per
    named slot of the current batch; each slot is emptied and prefilled alone, and with
    return_hidden (hidden-state indices, ``runners.hf``) each slot's states [T - 1, L, H] come
    back in a list (None for a one-token prompt).
    """
    if rows is None:
        if ids.shape[1] > 1:
            runner.prefill(ids[:, :-1])
        else:
            runner.reset(ids.shape[0])
        return None
    states: list[torch.Tensor | None] = []
    for row, prompt in zip(rows, ids):
        prompt = [int(t) for t in prompt]
        if len(prompt) > 1 and return_hidden:
            states.append(runner.prefill(torch.tensor([prompt[:-1]]), rows=[row], return_hidden=return_hidden)[1][0])
        elif len(prompt) > 1:
            runner.prefill(torch.tensor([prompt[:-1]]), rows=[row])
        else:
            lengths = runner.lengths.clone()
            lengths[row] = 0
            runner.truncate(lengths)
            states.append(None)
    return states if return_hidden else None
