"""Passkey retrieval (Mohtashami & Jaggi, 2023): can the model fetch a number from far back?

A prompt is repetitive filler with one sentence stating a random key at a chosen depth
(0 = start, 1 = end of the filler), followed by a question; the answer is the key. The
same construction serves as a training task (`data=passkey`) and as an eval
(`scripts/eval_passkey.py`).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

FILLER = "The river runs past the old mill. The fields are quiet and the clouds drift east. "
# The sentence forms with a name, which dense-retrieval training documents (data/retrieval.py) use for
# many keys at once; the eval's single key is the one named "secret", so the forms it asks in are
# exactly the ones trained on.
STATEMENT_FORM = "Remember this: the {name} key is {key}. The {name} key is {key}. "
QUESTION_FORM = "What is the {name} key? The {name} key is"
EVAL_NAME = "secret"
KEY_SENTENCE = STATEMENT_FORM.replace("{name}", EVAL_NAME)
QUESTION = QUESTION_FORM.format(name=EVAL_NAME)


def random_key(rng: np.random.Generator, digits: int) -> str:
    return str(int(rng.integers(10 ** (digits - 1), 10**digits)))


def filler_tokens(count_tokens: Callable[[str], int]) -> int:
    """The tokens one sentence of filler adds within a run of them: a BPE merges across the
    repetitions (the trailing space joins the next word), so a repetition alone counts one or two
    more, and a 32K-token prompt sized by it came out ~4% short."""
    return count_tokens(FILLER * 2) - count_tokens(FILLER)


def passkey_prompt(n_tokens: int, depth: float, key: str, count_tokens: Callable[[str], int]) -> tuple[str, str]:
    """(prompt, answer) whose prompt is about `n_tokens` long as measured by `count_tokens`;
    the answer is the key after a space, the continuation a model should produce."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"passkey depth={depth} must be in [0, 1]")
    fixed = count_tokens(KEY_SENTENCE.format(key=key)) + count_tokens(QUESTION)
    n_filler = max(0, round((n_tokens - fixed) / filler_tokens(count_tokens)))
    before = round(n_filler * depth)
    prompt = FILLER * before + KEY_SENTENCE.format(key=key) + FILLER * (n_filler - before) + QUESTION
    return prompt, f" {key}"
