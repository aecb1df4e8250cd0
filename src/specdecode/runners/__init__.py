"""Runners execute a model over a KV cache: prefill, forward over new tokens, exact truncate."""

from .base import Runner, cache_all_but_last

__all__ = ["Runner", "cache_all_but_last"]
