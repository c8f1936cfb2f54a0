"""Dense-retrieval documents: many named keys, each asked for later, at distances spread over the document.

Why: a passkey document (data/passkey.py) holds one 3-token answer in a window of predictable
filler, so the loss carries almost no signal about retrieval (a 32K run of them retrieved nothing;
docs/long-context.md). Here a document of `length` tokens interleaves `pairs` statements
("Remember this: the <name> key is <key>. ...") with later questions ("What is the <name> key?
The <name> key is <key>."), so one window holds many answers, each at its own distance. The forms
are data/passkey.py's with a name; the eval's key is the one named "secret", so what is trained is
what scripts/eval_passkey.py asks.

Distances: each pair draws its distance d (question start - statement start) uniformly over what
the document allows, then its statement's place uniformly among those leaving room for d, so the
longest distances (a key at the very start, asked for at the very end: the eval's depth 0) are as
common as any other. Events are laid out in the order of their drawn places; where they crowd, the
later one moves up. Between events runs background text: FILLER's words, cycled.

`ask_last` (one key a document): the question ends the document, as it ends the eval's prompt, and
its statement comes a distance before it drawn uniformly over what fits. A question at the end of
a long document is then as often near its key as far from it. In 32K documents, a question in the
last 1K with its key within 3K comes once in ~10 documents instead of once in ~300 without it:
the eval's depths 0.9 and 1 at 32K, the cells every recipe here missed most (docs/long-context.md).

Names: a key's name is free again once its question is asked; while open it names no other key,
so every question's answer is the latest key stated under that name.

Exact length: a document is `length - 1` tokens of the run's tokenizer, so that with the
end-of-text token after it, it fills one window of trainer.seq_len = length, and with
data.windows=fixed every training window is one whole document (a moving cut would split most long
pairs across two windows). Counting is additive because every piece starts with a space (the
byte-level BPE's pre-tokenizer never merges across that boundary); the whole text is counted once
more at the end and padded or refused if it is not exact.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import numpy as np

from data.passkey import EVAL_NAME, FILLER, QUESTION_FORM, STATEMENT_FORM, random_key

# Pronounceable two-syllable names ("bako", "tiru", ...): 4,900 of them, more than a 32K-token
# document can hold open at once.
NAMES = [EVAL_NAME] + [a + b for a, b in itertools.product(
    (c + v for c in "bdfgklmnprstvz" for v in "aeiou"), repeat=2)]


@dataclass(frozen=True)
class Pair:
    name: str
    key: str
    statement: int           # token position of the statement's first token
    question: int | None     # token position of the question's first token; None when it did not fit


def statement_text(name: str, key: str) -> str:
    return " " + STATEMENT_FORM.format(name=name, key=key).strip()


def question_text(name: str, key: str) -> str:
    return " " + QUESTION_FORM.format(name=name) + f" {key}."


def dense_document(length: int, pairs: int, key_digits: int, rng: np.random.Generator,
                   count_tokens: Callable[[str], int], ask_last: bool = False) -> tuple[str, list[Pair]]:
    """(text of exactly `length` - 1 tokens, its pairs in order of statement). Raises ValueError
    when not even one pair fits, or `ask_last` is asked of several."""
    if ask_last and pairs != 1:
        raise ValueError(f"data.passkey.ask_last: the question ends a document of one key, not of {pairs}")
    budget = length - 1
    spare = 2    # the first piece loses its space, which can cost a token or two: laid out in budget - spare
    sizes: dict[str, int] = {}

    def size(piece: str) -> int:
        if piece not in sizes:
            sizes[piece] = count_tokens(piece)
        return sizes[piece]

    typical = size(statement_text("bako", "9" * key_digits)), size(question_text("bako", "9" * key_digits))
    room = budget - spare - sum(typical)
    if room < 0:
        raise ValueError(f"data.passkey.length={length}: a dense document needs at least {sum(typical) + spare + 1} "
                         f"tokens of this tokenizer for one key and its question")
    if pairs * sum(typical) > budget - spare:
        raise ValueError(f"data.passkey.pairs={pairs}: at most {(budget - spare) // sum(typical)} keys and their "
                         f"questions fit in a document of data.passkey.length={length} tokens of this tokenizer")
    words = [" " + w for w in FILLER.split()]
    pieces, cursor, cycle = [], 0, itertools.count()
    names, keys, stated, asked, pending = {}, {}, {}, {}, 0
    free = NAMES[: 2 * pairs + 1]    # more than can be open at once; "secret" among them

    def background(until: float) -> None:
        nonlocal cursor
        while True:
            word = words[next(cycle) % len(words)]
            if cursor + size(word) > until:
                return
            pieces.append(word)
            cursor += size(word)

    if ask_last:   # its question (this key's own size) ends the document, the statement d before it
        name, key = free[int(rng.integers(len(free)))], random_key(rng, key_digits)
        statement, question = statement_text(name, key), question_text(name, key)
        asked_at = budget - spare - size(question)
        if asked_at < size(statement):
            raise ValueError(f"data.passkey.length={length}: too short for the statement and question of key "
                             f"{key!r} named {name!r} with data.passkey.ask_last")
        stated_at = asked_at - rng.uniform(size(statement), asked_at)   # d uniform over what fits
        for placed, at, piece in ((stated, stated_at, statement), (asked, asked_at, question)):
            background(at)
            placed[0] = cursor
            pieces.append(piece)
            cursor += size(piece)
        names[0], keys[0] = name, key
        events = []
    else:
        distance = rng.uniform(typical[0], typical[0] + room, pairs)
        start = rng.uniform(0, 1, pairs) * (room + typical[0] - distance)
        events = sorted([(s, 0, j) for j, s in enumerate(start)] + [(s + d, 1, j) for j, (s, d) in
                                                                     enumerate(zip(start, distance))])
    for at, is_question, j in events:
        if is_question and j not in stated:
            continue
        background(at)
        if is_question:
            piece = question_text(names[j], keys[j])
            if cursor + size(piece) > budget - spare:
                continue
            asked[j] = cursor
            free.append(names[j])
            pending -= size(piece)
        else:
            pick = int(rng.integers(len(free)))
            name, key = free[pick], random_key(rng, key_digits)
            piece = statement_text(name, key)
            owed = size(question_text(name, key))
            if cursor + size(piece) + pending + owed > budget - spare:   # room for every open key's question
                continue
            names[j], keys[j], stated[j] = name, key, cursor
            free[pick] = free[-1]
            free.pop()
            pending += owed
        pieces.append(piece)
        cursor += size(piece)
    # The document starts without the first piece's space, as the eval's prompt does; that may change
    # the first piece's count, and every position after it moves with it.
    shift = count_tokens(pieces[0][1:]) - size(pieces[0]) if pieces else 0
    moved = lambda at: at if at is None or at == 0 else at + shift  # noqa: E731
    text = _pad("".join(pieces)[1:], budget, words, count_tokens, cursor + shift)
    found = [Pair(names[j], keys[j], moved(stated[j]), moved(asked.get(j))) for j in sorted(stated, key=stated.get)]
    return text, found


def _pad(text: str, budget: int, words: list[str], count_tokens: Callable[[str], int], have: int) -> str:
    """`text` with background words (then the shortest pieces that do not merge with what precedes
    them) after it up to exactly `budget` tokens. `have`: text's count as the caller summed it from
    its pieces, which spares encoding the whole text once more (a third of a passkey build); where
    that sum is not the text's count (a tokenizer merging across pieces) and the padded text misses
    the budget, the padding is redone from the text's own count."""
    for start in (have, None):
        padded = _fill(text, count_tokens(text) if start is None else start, budget, words, count_tokens)
        if (got := count_tokens(padded)) == budget:
            return padded
    raise ValueError(f"a dense-retrieval document came out {got} tokens instead of {budget}: this tokenizer "
                     f"merges across the pieces' spaces (data/retrieval.py)")


def _fill(text: str, have: int, budget: int, words: list[str], count_tokens: Callable[[str], int]) -> str:
    """`text`, of `have` tokens, with background words and short pieces after it, counted up to `budget`."""
    units = sorted({(count_tokens(u), u) for u in words + [" .", "."]}, reverse=True)
    adds = lambda piece: count_tokens(text[-40:] + piece) - count_tokens(text[-40:]) == count_tokens(piece)  # noqa: E731
    cycle = itertools.cycle(words)
    while have < budget:
        word, gap = next(cycle), budget - have
        piece = word if count_tokens(word) <= gap else next((u for n, u in units if n <= gap and adds(u)), None)
        if piece is None:
            break
        text, have = text + piece, have + count_tokens(piece)
    return text
