"""`data=passkey`: a corpus of passkey-retrieval documents to train on: `kind=single`, one key in
filler (prompt + answer, data/passkey.py); `kind=dense`, many named keys each asked for later
(data/retrieval.py), documents of exactly `length` tokens with their end-of-text token.

`pieces` (dense only) cuts each `length`-token unit into that many documents of equal length, the
count cycling through the list unit by unit: with `length` = the window and data.windows=fixed,
every window holds whole documents of one length, short ones (many answers a window, where the copy
forms) beside long ones (few answers, at distances up to the window) in one run, and with
data.document_mask=true each document is read on its own, as the eval's prompt is. `piece_pairs`
(a list beside `pieces`) gives each unit's documents their own number of keys in place of `pairs`:
several in the long ones multiplies the answers at long distances (one 32K document with one key
has one answer, at a distance spread over the document), while the short ones keep one each.
`ask_last` (dense, one key a document) puts each question at its document's end, as the eval asks."""
from __future__ import annotations

import functools
import hashlib
from typing import Callable, Iterator

import numpy as np

from data.passkey import FILLER, filler_tokens, passkey_prompt, random_key
from data.retrieval import dense_document

KINDS = ("single", "dense")


def utf8_length(text: str) -> int:
    return len(text.encode("utf-8"))


def _token_counter(tokenizer) -> Callable[[str], int]:
    """len(tokenizer.encode(text)), remembered for short texts. Dense documents are laid out from a
    few dozen pieces (filler words, key sentences, a padded tail's last 40 characters), each counted
    again for every document: 6.6M encodes of one-token words for the 107K documents of
    experiment=long-context-mixed-naive-h100, 48 of the 82 s its token cache took to build on a
    CPU. Whole documents are counted as they come."""
    @functools.lru_cache(maxsize=1 << 16)
    def short(text: str) -> int:
        return len(tokenizer.encode(text))

    return lambda text: short(text) if len(text) <= 64 else len(tokenizer.encode(text))


class PasskeySource:
    name = "passkey"

    def __init__(self, num_docs: int, length: int, depths: list[float] | None, key_digits: int, seed: int,
                 count_tokens: Callable[[str], int] = utf8_length, kind: str = "single", pairs: int | None = None,
                 pieces: list[int] | None = None, piece_pairs: list[int] | None = None, ask_last: bool = False):
        if num_docs < 2 or length < 1 or key_digits < 1:
            raise ValueError(f"data=passkey needs num_docs >= 2, length >= 1, key_digits >= 1 (got {num_docs}, {length}, {key_digits})")
        if kind not in KINDS:
            raise ValueError(f"data.passkey.kind={kind!r}: expected one of {', '.join(KINDS)}")
        if kind == "dense" and (pairs is None or pairs < 1):
            raise ValueError(f"data.passkey.pairs={pairs}: kind=dense needs the number of keys per document (>= 1)")
        if kind == "dense" and depths is not None:
            raise ValueError("data.passkey.depths: kind=dense spreads its keys' distances itself; set depths=null")
        if kind == "single" and pairs is not None:
            raise ValueError(f"data.passkey.pairs={pairs}: only kind=dense has several keys; set pairs=null")
        if pieces is not None and kind != "dense":
            raise ValueError("data.passkey.pieces: only kind=dense documents are cut into pieces; set pieces=null")
        if pieces is not None and (not pieces or any(int(n) < 1 or length % int(n) for n in pieces)):
            raise ValueError(f"data.passkey.pieces={list(pieces)}: each count must be >= 1 and divide "
                             f"data.passkey.length={length}")
        if piece_pairs is not None and (pieces is None or len(piece_pairs) != len(pieces)
                                        or any(int(n) < 1 for n in piece_pairs)):
            raise ValueError(f"data.passkey.piece_pairs={list(piece_pairs)}: needs data.passkey.pieces, one count "
                             f"(>= 1) for each of its {len(pieces or [])} entries")
        if ask_last and (kind != "dense" or max(piece_pairs or [pairs or 0]) != 1):
            raise ValueError("data.passkey.ask_last: needs kind=dense with one key a document (pairs=1, and "
                             "piece_pairs all 1 if set)")
        self.num_docs, self.length, self.key_digits, self.seed = int(num_docs), int(length), int(key_digits), int(seed)
        self.pieces = None if pieces is None else [int(n) for n in pieces]
        self.piece_pairs = None if piece_pairs is None else [int(n) for n in piece_pairs]
        self.depths = None if depths is None else [float(d) for d in depths]
        self.kind, self.pairs = kind, None if pairs is None else int(pairs)
        self.ask_last = bool(ask_last)
        self.count_tokens = count_tokens
        self.num_documents = len(self.names())
        settings = f"{self.num_docs}|{self.length}|{self.depths}|{self.key_digits}|{self.seed}"
        if kind == "dense":   # single's fingerprint as before, so its token caches stay valid
            settings += f"|dense|{self.pairs}"
        if self.pieces is not None:
            settings += f"|pieces|{self.pieces}"
        if self.piece_pairs is not None:
            settings += f"|piece_pairs|{self.piece_pairs}"
        if self.ask_last:
            settings += "|ask_last"
        self.fingerprint = f"passkey-L{self.length}-{hashlib.sha256(settings.encode()).hexdigest()[:10]}"

    @classmethod
    def from_config(cls, cfg) -> "PasskeySource":
        depths, pairs, pieces, piece_pairs = (cfg.get(k) for k in ("depths", "pairs", "pieces", "piece_pairs"))
        return cls(int(cfg.num_docs), int(cfg.length), None if depths is None else list(depths),
                   int(cfg.get("key_digits", 5)), int(cfg.get("seed", 0)), kind=str(cfg.get("kind", "single")),
                   pairs=None if pairs is None else int(pairs), pieces=None if pieces is None else list(pieces),
                   piece_pairs=None if piece_pairs is None else list(piece_pairs),
                   ask_last=bool(cfg.get("ask_last", False)))

    def for_tokenizer(self, tokenizer) -> "PasskeySource":
        """Same documents, sized in the run's tokens instead of bytes (the cache key has the tokenizer).
        Where the tokenizer merges across filler sentences (data.passkey.filler_tokens) the texts
        differ from those built before filler was counted within a run, and the fingerprint says so,
        so that no token cache of the old texts is taken for the new."""
        count = _token_counter(tokenizer)
        source = PasskeySource(self.num_docs, self.length, self.depths, self.key_digits, self.seed, count_tokens=count,
                               kind=self.kind, pairs=self.pairs, pieces=self.pieces, piece_pairs=self.piece_pairs,
                               ask_last=self.ask_last)
        if self.kind == "single" and filler_tokens(count) != count(FILLER):
            source.fingerprint += "-runs"
        return source

    def layout(self) -> list[tuple[str, int, int | None]]:
        """(name, length in tokens, keys) of each document, in order: unit i of `length` tokens whole,
        or cut into pieces[k] documents of equal length with piece_pairs[k] keys each (k = i mod the
        list's length; `pairs` keys without piece_pairs)."""
        if self.pieces is None:
            return [(f"passkey-{i}", self.length, self.pairs) for i in range(self.num_docs)]
        cycle = [(n, self.pairs if self.piece_pairs is None else self.piece_pairs[k]) for k, n in enumerate(self.pieces)]
        cuts = (cycle[i % len(cycle)] for i in range(self.num_docs))
        return [(f"passkey-{i}.{j}", self.length // n, keys) for i, (n, keys) in enumerate(cuts) for j in range(n)]

    def names(self) -> list[str]:
        """The documents' names, in order, without building their texts."""
        return [name for name, _, _ in self.layout()]

    def documents(self) -> Iterator[tuple[str, str]]:
        rng = np.random.default_rng(self.seed)
        if self.kind == "dense":
            for name, length, keys in self.layout():
                yield name, dense_document(length, keys, self.key_digits, rng, self.count_tokens, self.ask_last)[0]
            return
        for i, name in enumerate(self.names()):
            depth = self.depths[i % len(self.depths)] if self.depths else float(rng.uniform())
            prompt, answer = passkey_prompt(self.length, depth, random_key(rng, self.key_digits), self.count_tokens)
            yield name, f"{prompt}{answer}."
