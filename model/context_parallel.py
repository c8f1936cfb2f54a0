"""Context-parallel sequence layout: which tokens of a sequence each CP rank holds.

A sequence of T tokens is cut into 2C equal chunks; CP rank i of C holds chunks i and
2C-1-i, concatenated in that order. Under a causal mask the early chunk is cheap and the
late one expensive, so every rank does the same attention work (model.ring_attention
relies on this layout). Positions for RoPE, position embeddings and the loss are each
local token's true place in the sequence, `context_parallel_positions`;
`use_context_parallel` makes a model's attention layers run the ring.

Packed documents (`context_parallel_batch(..., document_ids=...)`): the chunks are dealt out by
the work the document mask leaves them (model.cp_layout.balanced_layout), and the model gets,
as its document ids, each local token's document start (a true position): the ring's layout and
steps travel with that tensor, and positions restart at the document starts on every rank.

Where context parallelism lives. model/ holds what the attention computes, given a process
group: this module (the batch cut into each rank's tokens, `use_context_parallel` putting the ring
in the attention layers' place), model.cp_layout (which chunks each rank holds, and their work)
and model.ring_attention (the ring's steps and their exact log-sum-exp merge). training/ holds
the processes: training.parallel.distributed builds the 2-D mesh whose CP groups are handed to the model,
training.parallel.context says what a config may combine with it and computes each rank's share
of the loss. Nothing in model/ creates a process group.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
import torch.distributed as dist

from kernels.masks import document_bounds
from model.cp_layout import Layout, balanced_layout, check_layout, host_to_device, visible_keys, zigzag_layout
from model.ring_attention import BLOCKS, attach_document_steps, masked_steps, ring_attention


def context_parallel_chunks(rank: int, size: int) -> tuple[int, int]:
    """Indices (of 2 x size) of the two sequence chunks rank `rank` holds."""
    return rank, 2 * size - 1 - rank


def split_for_context_parallel(x: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of x's sequence dimension `dim`, concatenated (a new tensor)."""
    check_layout(x.shape[dim], size, rank)
    return zigzag_layout(x.shape[dim], size).split(x, rank, dim)


def merge_context_parallel(parts: Sequence[torch.Tensor], dim: int = 1, layout: Layout | None = None) -> torch.Tensor:
    """The whole sequence from every rank's local tensor (parts in rank order): the
    inverse of split_for_context_parallel (or of `layout`'s split)."""
    layout = layout or zigzag_layout(sum(p.shape[dim] for p in parts), len(parts))
    return layout.merge(parts, dim)


def gather_from_context_parallel(x: torch.Tensor, group=None, dim: int = 1, layout: Layout | None = None) -> torch.Tensor:
    """All ranks' local tensors of `group` put back into the whole sequence, on every rank
    (an all_gather: for evaluation and tests, not differentiable)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return merge_context_parallel(parts, dim, layout)


def context_parallel_positions(seq_len: int, rank: int, size: int, device=None) -> torch.Tensor:
    """True positions (int64, seq_len // size of them) of this rank's local tokens, in local order."""
    check_layout(seq_len, size, rank)
    return zigzag_layout(seq_len, size).positions(rank, device)


def document_layout(document_ids: torch.Tensor, size: int, window: int | None = None):
    """(layout, every token's document start (B, T) int64 on the CPU) for whole windows packed
    with documents: the layout balances the visible (query, key) pairs over the `size` ranks.
    The ids are read on the host: pass the sampler's CPU tensor (a device one costs a sync)."""
    starts = document_bounds(document_ids.cpu())[:, 0].long()
    return balanced_layout(visible_keys(starts, starts.shape[1], window), size), starts


def context_parallel_batch(idx: torch.Tensor, targets: torch.Tensor | None, group=None,
                           document_ids: torch.Tensor | None = None, window: int | None = None):
    """This rank's share of a batch of whole windows: (local idx, local targets, model keyword
    arguments), for `model(idx, targets, **kwargs)` after use_context_parallel.

    kwargs holds `positions`, the local tokens' true positions, and with `document_ids` (the
    whole windows' ids, (B, T), best on the CPU) the local `document_ids`: each local token's
    document start, which the ring reads to find this batch's layout and steps (made here for
    `window`, the model's attention.window)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    check_layout(idx.shape[1], size, rank)
    kwargs = {}
    if document_ids is None:
        layout = zigzag_layout(idx.shape[1], size)
    else:
        layout, starts = document_layout(document_ids, size, window)
        local_ids = host_to_device(starts[:, layout.positions(rank)], idx.device)
        attach_document_steps(local_ids, masked_steps(layout, rank, starts, window, idx.device), window, rank, size)
        kwargs["document_ids"] = local_ids
    local = [None if t is None else layout.split(t, rank) for t in (idx, targets)]
    return local[0], local[1], {"positions": layout.positions(rank, idx.device), **kwargs}


def positions_in_documents(positions: torch.Tensor, document_starts: torch.Tensor) -> torch.Tensor:
    """model.reset_positions under context parallelism: a token's document id is its document's
    start, a true position, so its position in the document is the difference."""
    return positions - document_starts


def use_context_parallel(model, group=None) -> None:
    """Make every attention layer of a GPT the ring over the CP `group`, with the model's
    own attention (flash: our kernel, naive: plain PyTorch) as the per-block compute, and its
    per-document positions count from the document starts that context_parallel_batch hands it."""
    if model.attention_name not in BLOCKS:
        raise ValueError(f"context parallelism needs attention={' or '.join(BLOCKS)} (the ring merges "
                         f"blocks by their log-sum-exp), got attention={model.attention_name}")
    ring = partial(ring_attention, group=group, block=model.attention_name)
    for block in model.blocks:
        block.attn.attention = ring
    model.document_positions = positions_in_documents
