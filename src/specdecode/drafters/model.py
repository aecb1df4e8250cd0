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
from .base import Contexts, Draft, padded_draft


class ModelDrafter:
    def __init__(self, runner: Runner):
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self._context_lengths: dict[int, int] = {}  # slot -> committed tokens at its last proposal

    @property
    def max_batch(self) -> int:
        return self.runner.max_batch

    def reset(self, batch_size: int) -> None:
        self.runner.reset(batch_size)

    def start(self, rows: Sequence[int], contexts: Contexts) -> None:
        """Cache all but the last token of each row (it is fed with the first proposal)."""
        cache_all_but_last(self.runner, contexts, rows=rows)

    def propose(
        self,
        rows: Sequence[int],
        contexts: Contexts,
        limits: Sequence[int],
        params: SamplingParams,
        generators: Sequence[torch.Generator],
        min_confidence: float = 0.0,
    ) -> Draft:
        """min_confidence: stop drafting a row after a token the draft gave less than this
        probability (the token itself is still proposed; the decision never depends on later draws)."""
        slots, n = [int(r) for r in rows], len(contexts)
        cached = self.runner.lengths.tolist()
        self._context_lengths.update({slot: len(c) for slot, c in zip(slots, contexts)})
        # feed each row the committed tokens its cache has not seen (at least the pending one)
        logits = self._feed([list(c[cached[slot] :]) for slot, c in zip(slots, contexts)], slots)  # [n, V]
        tokens: list[list[int]] = [[] for _ in range(n)]
        probs: list[list[torch.Tensor]] = [[] for _ in range(n)]
        drafting = [j for j in range(n) if limits[j] > 0]
        while drafting:
            chosen, chosen_probs = self._choose_rows(logits[drafting], params, [generators[j] for j in drafting])
            going = []
            for i, j in enumerate(drafting):
                tokens[j].append(int(chosen[i]))
                if chosen_probs is not None:
                    probs[j].append(chosen_probs[i])
                if len(tokens[j]) < limits[j] and _confident(min_confidence, logits[j], chosen[i], None if chosen_probs is None else chosen_probs[i]):
                    going.append(j)
            if going:
                step = torch.tensor([[tokens[j][-1]] for j in going])  # [len(going), 1]
                out = self.runner.forward(step, rows=[slots[j] for j in going], counts=[1] * len(going))[:, -1]
                if len(going) == n:
                    logits = out
                else:
                    logits = logits.clone()
                    logits[going] = out
            drafting = going
        dtype = next((row[0].dtype for row in probs if row), torch.float32)
        return padded_draft(tokens, None if params.greedy else probs, self.vocab_size, dtype)

    def _feed(self, feeds: list[list[int]], slots: list[int]) -> torch.Tensor:
        """Append each row's unseen tokens; logits after each row's last one [n, V]."""
        width = max(len(f) for f in feeds)
        ids = torch.zeros((len(feeds), width), dtype=torch.long)
        for j, f in enumerate(feeds):
            ids[j, : len(f)] = torch.tensor(f, dtype=torch.long)
        counts = [len(f) for f in feeds]
        last = getattr(self.runner, "forward_last", None)  # runners that can skip the other positions' head
        if last is not None:
            return last(ids, rows=slots, counts=counts)
        out = self.runner.forward(ids, rows=slots, counts=counts)  # [n, width, V]
        return out[torch.arange(len(feeds)), torch.tensor(counts) - 1]

    def commit(self, rows: Sequence[int], num_accepted: torch.Tensor) -> None:
        """num_accepted [n]: keep each row's context plus its accepted drafted tokens that are cached."""
        lengths = self.runner.lengths.clone()  # [B]
        for slot, accepted in zip(rows, num_accepted.tolist()):
            slot = int(slot)
            lengths[slot] = min(int(lengths[slot]), self._context_lengths[slot] + accepted)
        self.runner.truncate(lengths)

    @staticmethod
    def _choose_rows(logits, params, generators):
        """logits [n, V] -> tokens [n], probs [n, V] | None, each row drawn with its own generator."""
        if params.greedy or len(generators) == 1:
            return choose(logits, params, generators[0])
        picks = [choose(logits[b : b + 1], params, g) for b, g in enumerate(generators)]
        return torch.cat([t for t, _ in picks]), torch.cat([p for _, p in picks])


def _confident(min_confidence: float, logits: torch.Tensor, token: torch.Tensor, prob: torch.Tensor | None) -> bool:
    """The chosen token has draft probability >= min_confidence. logits [V], token [], prob [V] | None."""
    if min_confidence <= 0:
        return True
    dist = prob if prob is not None else torch.softmax(logits.float(), dim=-1)  # [V]
    return bool(dist[int(token)] >= min_confidence)
