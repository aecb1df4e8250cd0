"""specdecode: exact speculative decoding (Leviathan, Kalman, Matias 2022) for Hugging Face causal LMs.

Glossary: the *target* is the model whose output we reproduce; the *drafter* proposes tokens
cheaply; *accepted* drafts are kept, the first *rejected* one is replaced by a token from the
*residual* distribution, and a fully accepted block earns a *bonus* token from the target.
"""

from .api import GenerationResult, SpeculativeGenerator
from .config import SamplingParams, SpecConfig
from .engine import SpecEngine
from .stats import GenerationStats
from .errors import SpecDecodeError

__all__ = [
    "GenerationResult",
    "GenerationStats",
    "SamplingParams",
    "SpecConfig",
    "SpecDecodeError",
    "SpecEngine",
    "SpeculativeGenerator",
]
__version__ = "0.1.0"
