"""Train/validation token streams over a token cache, split by document (or, for a corpus of too
few documents, by token: the last val_fraction of its tokens).

A split is a set of documents; its stream is their tokens concatenated in cache order
(each document already ends with the end-of-document id). Consecutive documents of one
split form a run, so a stream is a handful of contiguous slices of the memory map and a
window is nearly always a single slice.
"""
from __future__ import annotations

import numpy as np


def split_documents(offsets: np.ndarray, keys: np.ndarray, val_fraction: float,
                    train_only: np.ndarray | None = None) -> np.ndarray | None:
    """Boolean mask of validation documents: about `val_fraction` of the tokens; None when whole
    documents cannot make such a split (see split_corpus).

    Documents are taken in the order of their name hashes (independent of the tokenizer and
    of the corpus order) whenever they still fit in the token budget; at least one document
    goes to each side. "Cannot": fewer than 2 documents, or the documents that fit hold less
    than half the budget (one big file beside a few small ones). `train_only` (a boolean mask)
    marks documents that are never held out and count for nothing in the budget: the other
    documents are split as they would be on their own (a mix's synthetic documents, data/sources/mix.py).
    """
    n_docs = len(keys)
    is_val = np.zeros(n_docs, dtype=bool)
    if val_fraction <= 0:
        return is_val
    if not 0 < val_fraction < 1:
        raise ValueError(f"data.val_fraction={val_fraction} must be in [0, 1)")
    candidates = np.ones(n_docs, dtype=bool) if train_only is None else ~train_only
    if candidates.sum() < 2:
        return None
    lengths = np.diff(offsets)
    budget = val_fraction * lengths[candidates].sum()
    taken = 0
    for i in np.argsort(keys, kind="stable"):
        if candidates[i] and taken + lengths[i] <= budget:
            is_val[i] = True
            taken += lengths[i]
    if taken < budget / 2 or is_val[candidates].all():
        return None
    return is_val


def split_corpus(offsets: np.ndarray, keys: np.ndarray, val_fraction: float,
                 train_only: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, str]:
    """(offsets, is_val, how): whole held-out documents where there are enough of them
    (how = "documents"), else the last `val_fraction` of the corpus's tokens (how = "tokens"):
    `offsets` then gains one boundary at the cut, so the two sides are two runs of the cache
    (a document cut there continues in validation; its EOT still ends it for document masks).
    With `train_only` (see split_documents) there is no such fallback: the last tokens would be
    documents that must stay in training, so too few other documents is a ValueError."""
    is_val = split_documents(offsets, keys, val_fraction, train_only)
    if is_val is not None:
        return offsets, is_val, "documents"
    if train_only is not None and train_only.any():
        raise ValueError(f"data.val_fraction={val_fraction}: the corpus's {int((~train_only).sum())} document(s) "
                         f"cannot be split into whole held-out and training documents; use more of the corpus "
                         f"or another val_fraction")
    total = int(offsets[-1])
    cut = total - max(1, round(val_fraction * total))
    offsets = np.unique(np.concatenate([offsets, [cut]])).astype(offsets.dtype)
    return offsets, offsets[1:] > cut, "tokens"


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
