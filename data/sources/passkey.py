"""`data=passkey`: a corpus of passkey-retrieval documents (prompt + answer) to train on."""
from __future__ import annotations

import hashlib
from typing import Callable, Iterator

import numpy as np

from data.passkey import FILLER, filler_tokens, passkey_prompt, random_key


def utf8_length(text: str) -> int:
    return len(text.encode("utf-8"))


class PasskeySource:
    name = "passkey"

    def __init__(self, num_docs: int, length: int, depths: list[float] | None, key_digits: int, seed: int,
                 count_tokens: Callable[[str], int] = utf8_length):
        if num_docs < 2 or length < 1 or key_digits < 1:
            raise ValueError(f"data=passkey needs num_docs >= 2, length >= 1, key_digits >= 1 (got {num_docs}, {length}, {key_digits})")
        self.num_docs, self.length, self.key_digits, self.seed = int(num_docs), int(length), int(key_digits), int(seed)
        self.depths = None if depths is None else [float(d) for d in depths]
        self.count_tokens = count_tokens
        self.num_documents = self.num_docs
        settings = f"{self.num_docs}|{self.length}|{self.depths}|{self.key_digits}|{self.seed}"
        self.fingerprint = f"passkey-L{self.length}-{hashlib.sha256(settings.encode()).hexdigest()[:10]}"

    @classmethod
    def from_config(cls, cfg) -> "PasskeySource":
        depths = cfg.get("depths")
        return cls(int(cfg.num_docs), int(cfg.length), None if depths is None else list(depths),
                   int(cfg.get("key_digits", 5)), int(cfg.get("seed", 0)))

    def for_tokenizer(self, tokenizer) -> "PasskeySource":
        """Same documents, sized in the run's tokens instead of bytes (the cache key has the tokenizer).
        Where the tokenizer merges across filler sentences (data.passkey.filler_tokens) the texts
        differ from those built before filler was counted within a run, and the fingerprint says so,
        so that no token cache of the old texts is taken for the new."""
        count = lambda text: len(tokenizer.encode(text))  # noqa: E731
        source = PasskeySource(self.num_docs, self.length, self.depths, self.key_digits, self.seed, count_tokens=count)
        if filler_tokens(count) != count(FILLER):
            source.fingerprint += "-runs"
        return source

    def names(self) -> list[str]:
        """The documents' names, in order, without building their texts."""
        return [f"passkey-{i}" for i in range(self.num_docs)]

    def documents(self) -> Iterator[tuple[str, str]]:
        rng = np.random.default_rng(self.seed)
        for i, name in enumerate(self.names()):
            depth = self.depths[i % len(self.depths)] if self.depths else float(rng.uniform())
            prompt, answer = passkey_prompt(self.length, depth, random_key(rng, self.key_digits), self.count_tokens)
            yield name, f"{prompt}{answer}."
