"""Deterministic, resumable, rank-sharded sampling of (seq_len + 1)-token windows.

The stream is cut into non-overlapping windows of seq_len + 1 tokens sharing one token
with the next window (x = w[:-1], y = w[1:]), so an epoch sees every token once as a target.
Epoch e visits the windows in the order of a permutation seeded by (seed, e). The position is
global, two integers (epoch, cursor): the first `cursor` entries of epoch e's permutation have
been consumed, by all ranks together. Each window slot of a batch takes the next world_size
entries, rank r the r-th of them, so ranks are disjoint, move in lockstep, and together consume
the permutation in order. Resuming from the position replays exactly the batches an uninterrupted
run would have drawn, and on a different number of ranks it continues from the same entry: no
window of the epoch is repeated or skipped. An epoch ends when fewer than world_size entries are
left (they are dropped, fewer than world_size windows, different ones each epoch; none with one
process).
"""
from __future__ import annotations

import numpy as np
import torch

from data.stream import TokenStream


def windows_to_batch(windows: list[np.ndarray], eot_id: int, return_doc_ids: bool):
    w = torch.from_numpy(np.stack(windows).astype(np.int64))
    x, y = w[:, :-1], w[:, 1:]
    if not return_doc_ids:
        return x, y
    # Position t belongs to the document counted by the EOTs strictly before it in the window.
    ends = (x == eot_id).to(torch.int32)
    doc_ids = torch.cumsum(ends, dim=1) - ends
    return x, y, doc_ids


class WindowSampler:
    def __init__(self, stream: TokenStream, seq_len: int, seed: int, eot_id: int, rank: int = 0, world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.stream, self.seq_len, self.seed, self.eot_id = stream, seq_len, seed, eot_id
        self.rank, self.world_size = rank, world_size
        self.n_windows = (stream.n_tokens - 1) // seq_len
        if self.n_windows < world_size:
            raise ValueError(
                f"the train split has {stream.n_tokens:,} tokens: {self.n_windows} window(s) of seq_len={seq_len} "
                f"+ 1, fewer than world_size={world_size}"
            )
        self.epoch, self.cursor = 0, 0
        self._order_epoch, self._order = -1, None

    def order(self, epoch: int) -> np.ndarray:
        """All window indices of `epoch`, in the order the ranks together consume them."""
        if self._order_epoch != epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._order_epoch = epoch
        return self._order

    def shard(self, epoch: int) -> np.ndarray:
        """Window indices this rank visits in `epoch` from its start, in order."""
        usable = self.n_windows - self.n_windows % self.world_size
        return self.order(epoch)[self.rank : usable : self.world_size]

    def _wrap(self) -> None:
        if self.cursor + self.world_size > self.n_windows:
            self.epoch, self.cursor = self.epoch + 1, 0

    def window(self, index: int) -> np.ndarray:
        return self.stream.read(index * self.seq_len, self.seq_len + 1)

    def next_batch(self, batch_size: int, return_doc_ids: bool = False):
        """(x, y) int64 (batch_size, seq_len); with return_doc_ids also the per-position
        document index within each window (0, 0, ..., 1, 1, ...) for document masking."""
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        windows = []
        for _ in range(batch_size):
            windows.append(self.window(int(self.order(self.epoch)[self.cursor + self.rank])))
            self.cursor += self.world_size
            self._wrap()
        return windows_to_batch(windows, self.eot_id, return_doc_ids)

    def state_dict(self) -> dict:
        """The global position (the same on every rank); world_size is recorded for information."""
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "world_size": self.world_size,
            "n_windows": self.n_windows,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a global position saved by any number of ranks."""
        for key in ("seed", "seq_len", "n_windows"):
            if int(state[key]) != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]} but this run has {key}={getattr(self, key)}: "
                    f"the data, seq_len or seed changed since the checkpoint"
                )
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._wrap()


class ValidationWindows:
    """Fixed validation batches: windows spread evenly over the held-out documents."""

    def __init__(self, stream: TokenStream, seq_len: int, eot_id: int):
        self.stream, self.seq_len, self.eot_id = stream, seq_len, eot_id
        self.n_windows = (stream.n_tokens - 1) // seq_len

    def batches(self, batch_size: int, n_batches: int, return_doc_ids: bool = False) -> list:
        need = batch_size * n_batches
        # Evenly spaced over all windows; repeats only when fewer windows exist than asked for.
        idx = (np.arange(need) * self.n_windows) // need
        windows = [self.stream.read(int(i) * self.seq_len, self.seq_len + 1) for i in idx]
        return [
            windows_to_batch(windows[b * batch_size : (b + 1) * batch_size], self.eot_id, return_doc_ids)
            for b in range(n_batches)
        ]
