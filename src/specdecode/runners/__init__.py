"""Runners execute a model over a KV cache: prefill, forward over new tokens, exact truncate.

Glossary (one module each):
- ``base``: the Runner contract.
- ``factory``: which runner a model gets, its fast path, and building it.
- ``hf`` over ``ragged_cache``: transformers models, rows of their own lengths.
- ``int8``, ``attention``, ``lean``: the batch-invariant CPU path (per-token int8 linears,
  row-wise attention, the direct decode loop).
- ``llamacpp`` with ``gguf_files``, ``llamacpp_state``, ``llamacpp_build``: GGUF drafts in llama.cpp.
"""

from .base import Runner, cache_all_but_last

__all__ = ["Runner", "cache_all_but_last"]
