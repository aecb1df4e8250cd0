"""A Runner over a transformers causal LM with a DynamicCache.

This is the only module that calls transformers models. Rows of a batch share one length
here (ragged rows are the batching layer's job); truncation crops the cache exactly.

Glossary: *cache length* is how many tokens the KV cache holds; *logits width* is the
model's output vocabulary, which may exceed the tokenizer's.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from ..errors import SpecDecodeError


class HFRunner:
    def __init__(self, model: PreTrainedModel):
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        config = model.config.get_text_config()
        self.vocab_size = int(model.get_output_embeddings().out_features)
        self.max_context = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.cache: DynamicCache | None = None
        self._batch = 1
        self._length = 0

    @property
    def lengths(self) -> torch.Tensor:  # [B]
        return torch.full((self._batch,), self._length, dtype=torch.long)

    def reset(self, batch_size: int = 1) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self._batch = batch_size
        self._length = 0

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> logits after the last token [B, V]."""
        self.reset(ids.shape[0])
        return self._run(ids, logits_to_keep=1)[:, -1]

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, S] -> logits [B, S, V] for each new position."""
        if self.cache is None:
            self.reset(ids.shape[0])
        return self._run(ids, logits_to_keep=0)

    def truncate(self, lengths: torch.Tensor) -> None:
        """lengths [B]: keep exactly that many cached tokens per row (all rows equal here)."""
        target = int(lengths[0])
        if bool((lengths != target).any()):
            raise ValueError("HFRunner keeps rows at one length; ragged truncation needs the batching layer")
        if target > self._length or target < 0:
            raise ValueError(f"cannot truncate a cache of {self._length} tokens to {target}")
        if target < self._length and self.cache is not None:
            self.cache.crop(target - self._length)
        self._length = target

    def _run(self, ids: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        if ids.shape[0] != self._batch:
            raise ValueError(f"batch of {ids.shape[0]} rows, cache has {self._batch}")
        new_length = self._length + ids.shape[1]
        if new_length > self.max_context:
            raise SpecDecodeError(f"context of {new_length} tokens exceeds the model's {self.max_context}")
        positions = torch.arange(self._length, new_length, device=self.device).expand(ids.shape[0], -1)
        out = self.model(
            input_ids=ids.to(self.device),
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        self._length = new_length
        return out.logits
