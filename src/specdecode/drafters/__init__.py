"""Drafters propose the next few tokens cheaply; the target verifies them.

Glossary: a drafter *kind* names how proposals are made: ``model`` (a smaller language model),
``ngram`` (prompt lookup), ``hybrid`` (a lookup when one is found, else the model), ``head`` (a
draft head over the target's hidden states, ``drafters.head``, loaded from a head file); no kind
is plain decoding.
"""

from __future__ import annotations

from ..errors import SpecDecodeError
from ..runners import Runner
from .base import Draft, Drafter
from .head import HeadDrafter, head_drafter
from .hybrid import HybridDrafter
from .model import ModelDrafter
from .ngram import NgramDrafter

KINDS = ("model", "ngram", "hybrid", "head")

__all__ = ["Draft", "Drafter", "HeadDrafter", "HybridDrafter", "KINDS", "ModelDrafter", "NgramDrafter", "make_drafter"]


def make_drafter(kind: str | None, vocab_size: int, draft_runner: Runner | None = None,
                 head: str | None = None, target_model=None) -> Drafter | None:
    """The drafter of a kind over a target with ``vocab_size`` logits (None: plain decoding).
    ``model`` and ``hybrid`` draft with ``draft_runner``; ``head`` loads the head file ``head``
    made for ``target_model`` (the target's transformers model)."""
    if kind is None:
        return None
    if kind not in KINDS:
        raise SpecDecodeError(f"unknown drafter '{kind}' (choose {', '.join(KINDS[:-1])} or {KINDS[-1]})", field="draft")
    if kind == "ngram":
        return NgramDrafter(vocab_size)
    if kind == "head":
        if head is None or target_model is None:
            raise SpecDecodeError("the head drafter needs a head file (--draft head:PATH) and the target's model", field="draft")
        return head_drafter(head, target_model, vocab_size)
    if draft_runner is None:
        raise SpecDecodeError(f"the {kind} drafter needs a draft model", field="draft")
    model = ModelDrafter(draft_runner)
    return model if kind == "model" else HybridDrafter(model, NgramDrafter(vocab_size))
