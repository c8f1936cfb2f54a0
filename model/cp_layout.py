"""Which tokens of a window each rank of a context-parallel group holds, and how much attention
each rank then computes.

A window of T tokens is cut into M equal chunks and each of the C ranks holds M / C of them,
concatenated in sequence order, so local tensors keep global order and every rank holds T / C
tokens (the ring passes equal shapes). Two ways to choose the chunks:

- zig-zag (M = 2C, rank i holds chunks i and 2C-1-i): under a plain causal mask one sequence
  costs every rank the same, whatever T; it is the layout of model.context_parallel.
- balanced, for packed documents: with a document mask a query sees only the earlier keys of its
  own document, so the work of a chunk depends on where documents start, and the zig-zag split
  of a realistic mix leaves the busiest rank ~1.3x the mean at C = 2 and ~2x at C = 8
  (benchmarks/parallel/ring_balance_cpu.md). `balanced_layout` cuts the window into 8 to 64 chunks per
  rank (`CHUNKS_PER_RANK`), counts each chunk's visible (query, key) pairs and deals the chunks
  out largest first, each to the least loaded rank that still has room (LPT with equal counts),
  keeping zig-zag where that is already as even. Any assignment gives the same attention
  (the ring's masks follow the positions), so balancing changes the cost, never the result.

The work of a query is its number of visible keys: min(p + 1 - doc_start(p), window).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# The balanced layout's chunks: at least 8 per rank, more (up to 64) while they stay 4K tokens
# or longer; fewer where T / C does not divide. 8 chunks per rank leave the busiest rank up to
# 1.25x the mean for the 1M-token mix at C = 8 (a document of ~10^5 tokens is then a few chunks);
# 32-64 bring it within 1.002 (benchmarks/parallel/ring_balance_cpu.md).
CHUNKS_PER_RANK = (8, 64)
CHUNK_TOKENS = 4096


@dataclass(frozen=True)
class Layout:
    """`chunks[r]`: the chunk indices (ascending) rank r holds, of `chunk` tokens each."""
    chunk: int
    chunks: tuple[tuple[int, ...], ...]

    @property
    def size(self) -> int:
        return len(self.chunks)

    @property
    def seq_len(self) -> int:
        return self.chunk * sum(len(c) for c in self.chunks)

    def positions(self, rank: int, device=None) -> torch.Tensor:
        """True positions (int64) of rank `rank`'s local tokens, in local order (ascending)."""
        return torch.cat([torch.arange(j * self.chunk, (j + 1) * self.chunk, device=device)
                          for j in self.chunks[rank]])

    def split(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """Rank `rank`'s chunks of x's sequence dimension `dim`, concatenated (a new tensor)."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"sequence length {x.shape[dim]} is not this layout's {self.seq_len}")
        return torch.cat([x.narrow(dim, j * self.chunk, self.chunk) for j in self.chunks[rank]], dim)

    def merge(self, parts, dim: int = 1) -> torch.Tensor:
        """The whole sequence from every rank's local tensor (parts in rank order)."""
        pieces = {}
        for rank, part in enumerate(parts):
            for i, j in enumerate(self.chunks[rank]):
                pieces[j] = part.narrow(dim, i * self.chunk, self.chunk)
        return torch.cat([pieces[j] for j in range(len(pieces))], dim)


def check_layout(seq_len: int, size: int, rank: int | None = None) -> None:
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"context-parallel size must be a positive integer, got {size!r}")
    if rank is not None and not 0 <= rank < size:
        raise ValueError(f"context-parallel rank {rank} is outside 0..{size - 1}")
    if seq_len % (2 * size):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x context-parallel size = {2 * size}")


def zigzag_layout(seq_len: int, size: int) -> Layout:
    check_layout(seq_len, size)
    return Layout(seq_len // (2 * size), tuple((r, 2 * size - 1 - r) for r in range(size)))


def visible_keys(document_starts: torch.Tensor | None, seq_len: int, window: int | None) -> torch.Tensor:
    """(B or 1, T) int64: how many keys each query sees under causal, documents and window."""
    positions = torch.arange(seq_len)
    first = torch.zeros(1, seq_len, dtype=torch.long) if document_starts is None else document_starts.long().cpu()
    if window is not None:
        first = torch.maximum(first, positions - window + 1)
    return positions + 1 - first


def rank_work(layout: Layout, work: torch.Tensor) -> list[int]:
    """Visible (query, key) pairs of each rank's queries, from per-token `work` (B, T)."""
    per_chunk = work.sum(0).view(-1, layout.chunk).sum(1)
    return [int(per_chunk[list(c)].sum()) for c in layout.chunks]


def _chunks_per_rank(seq_len: int, size: int) -> int:
    n_local, (per_rank, most) = seq_len // size, CHUNKS_PER_RANK
    while per_rank < most and n_local // (2 * per_rank) >= CHUNK_TOKENS:
        per_rank *= 2
    while n_local % per_rank:
        per_rank //= 2
    return per_rank


def balanced_layout(work: torch.Tensor, size: int) -> Layout:
    """The chunk assignment that evens out per-token `work` (B, T) over `size` ranks (see the module
    docstring); deterministic, so every rank of a group computes the same one from the same work."""
    seq_len = work.shape[1]
    check_layout(seq_len, size)
    zigzag = zigzag_layout(seq_len, size)
    per_rank = _chunks_per_rank(seq_len, size)
    chunk = seq_len // (size * per_rank)
    per_chunk = work.sum(0).view(-1, chunk).sum(1).tolist()
    load, owned = [0] * size, [[] for _ in range(size)]
    for j in sorted(range(len(per_chunk)), key=lambda j: (-per_chunk[j], j)):
        rank = min((r for r in range(size) if len(owned[r]) < per_rank), key=lambda r: (load[r], r))
        load[rank] += per_chunk[j]
        owned[rank].append(j)
    if max(rank_work(zigzag, work)) <= max(load):
        return zigzag
    return Layout(chunk, tuple(tuple(sorted(c)) for c in owned))


def imbalance(layout: Layout, work: torch.Tensor) -> float:
    """The busiest rank's visible pairs over the mean."""
    loads = rank_work(layout, work)
    return max(loads) * len(loads) / max(sum(loads), 1)


def host_to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device`; to a GPU through pinned memory, so the copy does not wait for
    the work already queued there."""
    device = torch.device(device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
