"""Train/validation token streams over a token cache, split by document.

A split is a set of documents; its stream is their tokens concatenated in cache order
(each document already ends with the end-of-document id). Consecutive documents of one
split form a run, so a stream is a handful of contiguous slices of the memory map and a
window is nearly always a single slice.
"""
from __future__ import annotations

import numpy as np


def split_documents(offsets: np.ndarray, keys: np.ndarray, val_fraction: float) -> np.ndarray:
    """Boolean mask of validation documents: about `val_fraction` of the tokens.

    Documents are taken in the order of their name hashes (independent of the tokenizer and
    of the corpus order) whenever they still fit in the token budget; at least one document
    goes to each side.
    """
    n_docs = len(keys)
    is_val = np.zeros(n_docs, dtype=bool)
    if val_fraction <= 0:
        return is_val
    if not 0 < val_fraction < 1:
        raise ValueError(f"data.val_fraction={val_fraction} must be in [0, 1)")
    if n_docs < 2:
        raise ValueError("the corpus has a single document; holding out validation by document needs at least 2")
    lengths = np.diff(offsets)
    budget = val_fraction * offsets[-1]
    taken = 0
    for i in np.argsort(keys, kind="stable"):
        if taken + lengths[i] <= budget:
            is_val[i] = True
            taken += lengths[i]
    if not is_val.any():
        is_val[np.argmin(lengths)] = True
    return is_val


class TokenStream:
    """The concatenation of the selected documents, read by (start, length)."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, selected: np.ndarray):
        # Runs of consecutive selected documents -> contiguous [start, end) file ranges.
        edges = np.diff(np.concatenate([[0], selected.astype(np.int8), [0]]))
        run_first, run_stop = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        self.tokens = tokens
        self.file_start = offsets[run_first]
        run_len = offsets[run_stop] - self.file_start
        self.stream_start = np.concatenate([[0], np.cumsum(run_len)])  # run r covers [start[r], start[r+1])
        self.n_tokens = int(self.stream_start[-1])
        self.n_docs = int(selected.sum())

    def read(self, start: int, length: int) -> np.ndarray:
        if start < 0 or start + length > self.n_tokens:
            raise IndexError(f"window [{start}, {start + length}) outside a stream of {self.n_tokens} tokens")
        r = int(np.searchsorted(self.stream_start, start, side="right")) - 1
        pieces = []
        while length > 0:
            offset = start - self.stream_start[r]
            take = min(length, int(self.stream_start[r + 1] - start))
            pieces.append(self.tokens[self.file_start[r] + offset : self.file_start[r] + offset + take])
            start, length, r = start + take, length - take, r + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
