"""Context-parallel sequence layout: which tokens of a sequence each CP rank holds.

A sequence of T tokens is cut into 2C equal chunks; CP rank i of C holds chunks i and
2C-1-i, concatenated in that order. Under a causal mask the early chunk is cheap and the
late one expensive, so every rank does the same attention work (model.ring_attention
relies on this layout). Positions for RoPE, position embeddings and the loss are each
local token's true place in the sequence, `context_parallel_positions`;
`use_context_parallel` makes a model's attention layers run the ring.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
import torch.distributed as dist

from model.ring_attention import BLOCKS, ring_attention


def _check_layout(seq_len: int, rank: int, size: int) -> None:
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"context-parallel size must be a positive integer, got {size!r}")
    if not 0 <= rank < size:
        raise ValueError(f"context-parallel rank {rank} is outside 0..{size - 1}")
    if seq_len % (2 * size):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x context-parallel size = {2 * size}")


def context_parallel_chunks(rank: int, size: int) -> tuple[int, int]:
    """Indices (of 2 x size) of the two sequence chunks rank `rank` holds."""
    return rank, 2 * size - 1 - rank


def split_for_context_parallel(x: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of x's sequence dimension `dim`, concatenated (a new tensor)."""
    _check_layout(x.shape[dim], rank, size)
    chunks = x.chunk(2 * size, dim)
    return torch.cat([chunks[i] for i in context_parallel_chunks(rank, size)], dim)


def merge_context_parallel(parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's local tensor (parts in rank order): the
    inverse of split_for_context_parallel."""
    halves = [part.chunk(2, dim) for part in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


def gather_from_context_parallel(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """All ranks' local tensors of `group` put back into the whole sequence, on every rank
    (an all_gather: for evaluation and tests, not differentiable)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return merge_context_parallel(parts, dim)


def context_parallel_positions(seq_len: int, rank: int, size: int, device=None) -> torch.Tensor:
    """True positions (int64, seq_len // size of them) of this rank's local tokens, in local order."""
    _check_layout(seq_len, rank, size)
    chunk = seq_len // (2 * size)
    return torch.cat([torch.arange(i * chunk, (i + 1) * chunk, device=device)
                      for i in context_parallel_chunks(rank, size)])


def context_parallel_batch(idx: torch.Tensor, targets: torch.Tensor | None, group=None):
    """This rank's share of a batch of whole windows: (local idx, local targets, positions),
    for `model(idx, targets, positions=positions)` after use_context_parallel."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    local = [None if t is None else split_for_context_parallel(t, rank, size) for t in (idx, targets)]
    return local[0], local[1], context_parallel_positions(idx.shape[1], rank, size, idx.device)


def use_context_parallel(model, group=None) -> None:
    """Make every attention layer of a GPT the ring over the CP `group`, with the model's
    own attention (flash: our kernel, naive: plain PyTorch) as the per-block compute."""
    if model.attention_name not in BLOCKS:
        raise ValueError(f"context parallelism needs attention={' or '.join(BLOCKS)} (the ring merges "
                         f"blocks by their log-sum-exp), got attention={model.attention_name}")
    ring = partial(ring_attention, group=group, block=model.attention_name)
    for block in model.blocks:
        block.attn.attention = ring
