"""Deterministic, resumable, rank-sharded sampling of (seq_len + 1)-token windows.

Epoch e cuts the stream into consecutive windows of seq_len + 1 tokens, each sharing its last
token with the next (x = w[:-1], y = w[1:]), the first starting at an offset o_e, and visits them
in the order of a permutation; both are drawn from (seed, e).

`windows="moving"` (the default) draws o_e uniformly from [0, seq_len) (fewer values when the
stream holds less than two windows), so every epoch cuts the text somewhere else: a token comes
back at another position, after another prefix, as it does under nanoGPT's random window starts.
A fixed cut shows a small corpus the same windows every epoch, each token always at the same
position after the same prefix, and a model learns those windows by heart (tiny-shakespeare's
5,000 steps are 82 epochs of the same 3,921 windows; benchmarks/shakespeare_char/shakespeare_char_h200.md shows
the fixed cut's validation loss turning up first). Why an offset per epoch rather than
independent random starts: within an epoch every token is still a
target exactly once (but for fewer than 2 * seq_len at the two ends), the position stays two
integers, and the sharding and resume below hold as they are.

`windows="fixed"` (o_e = 0 in every epoch) is the cut used before moving windows. It stays for
one use: continuing, batch for batch, a checkpoint written with it (a sampler state without a
`windows` entry is such a checkpoint's) or repeating an earlier run exactly.

The position is global, two integers (epoch, cursor): the first `cursor` entries of epoch e's
permutation have been consumed, by all ranks together. Each window slot of a batch takes the next
world_size entries, rank r the r-th of them, so ranks are disjoint, move in lockstep, and together
consume the permutation in order. Resuming from the position replays exactly the batches an
uninterrupted run would have drawn, and on a different number of ranks it continues from the same
entry: no window of the epoch is repeated or skipped. An epoch ends when fewer than world_size
entries are left (they are dropped, fewer than world_size windows, different ones each epoch; none
with one process).
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


WINDOWS = ("moving", "fixed")   # how each epoch cuts the stream (module docstring)


class WindowSampler:
    def __init__(self, stream: TokenStream, seq_len: int, seed: int, eot_id: int, rank: int = 0, world_size: int = 1,
                 windows: str = "moving"):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        if windows not in WINDOWS:
            raise ValueError(f"data.windows={windows!r}: expected one of {', '.join(WINDOWS)}")
        self.stream, self.seq_len, self.seed, self.eot_id = stream, seq_len, seed, eot_id
        self.rank, self.world_size, self.windows = rank, world_size, windows
        self.n_windows = self._count(0)   # the windows of a cut at offset 0: the most an epoch holds
        # Offsets leave room for at least one window: o <= n_tokens - 1 - seq_len.
        self.n_offsets = min(seq_len, stream.n_tokens - seq_len) if windows == "moving" else 1
        fewest = self._count(self.n_offsets - 1)
        if fewest < world_size:
            raise ValueError(
                f"the train split has {stream.n_tokens:,} tokens: {fewest} window(s) of seq_len={seq_len} "
                f"+ 1, fewer than world_size={world_size}"
            )
        self.epoch, self.cursor = 0, 0
        self._plan_epoch, self._plan = -1, None

    def _count(self, offset: int) -> int:
        return (self.stream.n_tokens - 1 - offset) // self.seq_len

    def _epoch_plan(self, epoch: int) -> tuple[int, np.ndarray]:
        """(offset, window order) of `epoch`; the fixed cut keeps the permutation it always drew."""
        if self._plan_epoch != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            offset = int(rng.integers(self.n_offsets)) if self.windows == "moving" else 0
            self._plan = offset, rng.permutation(self._count(offset))
            self._plan_epoch = epoch
        return self._plan

    def offset(self, epoch: int) -> int:
        """Where epoch `epoch`'s first window starts in the stream."""
        return self._epoch_plan(epoch)[0]

    def order(self, epoch: int) -> np.ndarray:
        """All window indices of `epoch`, in the order the ranks together consume them."""
        return self._epoch_plan(epoch)[1]

    def shard(self, epoch: int) -> np.ndarray:
        """Window indices this rank visits in `epoch` from its start, in order."""
        order = self.order(epoch)
        usable = len(order) - len(order) % self.world_size
        return order[self.rank : usable : self.world_size]

    def _wrap(self) -> None:
        if self.cursor + self.world_size > len(self.order(self.epoch)):
            self.epoch, self.cursor = self.epoch + 1, 0

    def window(self, index: int, epoch: int) -> np.ndarray:
        """Window `index` of epoch `epoch`'s cut: seq_len + 1 tokens."""
        return self.stream.read(self.offset(epoch) + index * self.seq_len, self.seq_len + 1)

    def next_batch(self, batch_size: int, return_doc_ids: bool = False):
        """(x, y) int64 (batch_size, seq_len); with return_doc_ids also the per-position
        document index within each window (0, 0, ..., 1, 1, ...) for document masking."""
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        windows = []
        for _ in range(batch_size):
            windows.append(self.window(int(self.order(self.epoch)[self.cursor + self.rank]), self.epoch))
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
            "windows": self.windows,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a global position saved by any number of ranks. A state without
        `windows` predates moving windows: its position is in the fixed cut."""
        for key in ("seed", "seq_len", "n_windows"):
            if int(state[key]) != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]} but this run has {key}={getattr(self, key)}: "
                    f"the data, seq_len or seed changed since the checkpoint"
                )
        saved = state.get("windows", "fixed")
        if saved != self.windows:
            why = "it was written before moving windows existed" if "windows" not in state else f"its run had data.windows={saved}"
            raise ValueError(f"its data position is in {saved} windows ({why}) but this run has "
                             f"data.windows={self.windows}: pass data.windows={saved} to continue it exactly")
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
