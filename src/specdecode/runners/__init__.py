"""Runners execute a model over a KV cache: prefill, forward over new tokens, exact truncate."""

from .base import Runner

__all__ = ["Runner"]
