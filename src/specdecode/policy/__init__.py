"""How many tokens to draft each step: a fixed length, or the adaptive schedule over measured estimates."""

from .adaptive import AdaptiveGamma, FixedGamma
from .estimates import AcceptanceEstimates, CostEstimates

__all__ = ["AdaptiveGamma", "FixedGamma", "AcceptanceEstimates", "CostEstimates"]
