"""Drafters propose the next few tokens cheaply; the target verifies them."""

from .base import Draft, Drafter
from .model import ModelDrafter

__all__ = ["Draft", "Drafter", "ModelDrafter"]
