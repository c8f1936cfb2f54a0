"""Context parallelism in training (`trainer.context_parallel=C`): what is allowed, the loss, and
the parallel plan's part for it (`ContextSplit`).

Under torchrun with N processes the ranks form a 2-D mesh (dp = N / C, cp = C; see
training.parallel.distributed.init_distributed): the C ranks of a CP group receive the same windows from
the sampler (sharded by DP rank only), each keeps its chunks of every sequence at their true
positions (model.context_parallel: chunks i and 2C-1-i, or with data.document_mask the chunks
dealt out by the documents' attention work) and the attention layers run the ring
(model.ring_attention) over the CP group, with the document mask and attention.window.

The loss of a CP rank is the sum of its own tokens' losses divided by the count of non-ignored
targets in the whole micro-batch (known on every rank: each holds the whole windows), so the C
shares add up to the single-process mean exactly, however unevenly -100 targets fall on the
ranks. Gradients are reduced over all N ranks (DDP or FSDP2 average over the world), so the
training step scales each share by C: the average over N of C x share is the mean over the DP
groups of the micro-batch means, the single-process loss and gradient. Evaluation adds the
unscaled shares over all ranks.

This is the process-group side of context parallelism; the attention side is in model/ (see
model.context_parallel for the map of both).
"""
from __future__ import annotations

import torch
from omegaconf import DictConfig

from model.context_parallel import context_parallel_batch, use_context_parallel
from model.gpt import IGNORE_INDEX
from model.ring_attention import BLOCKS


def context_parallel_size(cfg: DictConfig) -> int:
    return int(cfg.trainer.get("context_parallel", 1))


def check_processes(size: int, world_size: int) -> None:
    """C > 1 needs torchrun with a multiple of C processes."""
    if size > 1 and world_size == 1:
        raise ValueError(f"trainer.context_parallel={size} splits each sequence over {size} processes: start a "
                         f"multiple of {size} of them with torchrun --nproc_per_node=N")
    if world_size % size:
        raise ValueError(f"trainer.context_parallel={size} does not divide the {world_size} processes "
                         f"(the data-parallel size is processes / context_parallel)")


def check_attention(name: str, size: int) -> None:
    """The ring's per-block compute must return the log-sum-exp: flash or naive."""
    if size > 1 and name not in BLOCKS:
        raise ValueError(f"trainer.context_parallel={size} needs attention={' or '.join(BLOCKS)} (the ring merges "
                         f"blocks by their log-sum-exp, which {name} does not return)")


def check_context_parallel(cfg: DictConfig, world_size: int) -> None:
    """Raise a one-line ValueError for a combination context parallelism does not support
    (before any process group, data or model is built). A no-op for C = 1. What the ring cannot
    combine with in the config alone (attention dropout, the atomic backward, the kernel choice)
    is checked with the other cross-key checks in training.config.checks."""
    size, t = context_parallel_size(cfg), cfg.trainer
    if size == 1:
        return
    check_processes(size, world_size)
    if t.seq_len % (2 * size):
        raise ValueError(f"trainer.seq_len={t.seq_len} is not divisible by 2 x trainer.context_parallel = "
                         f"{2 * size} (each rank holds two equal chunks of every sequence)")
    check_attention(cfg.attention.name, size)


def context_parallel_loss(forward, idx: torch.Tensor, targets: torch.Tensor, group,
                          document_ids: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """This CP rank's share of the micro-batch's mean loss: `forward` (the model, wrapped or
    compiled) on the rank's chunks of the whole windows `idx`, `targets` (and their document ids,
    with the model's attention.window), summed over its tokens and divided by the whole
    micro-batch's count of non-ignored targets. Adding the shares of the CP group gives the
    single-process mean loss, and their gradients its gradients."""
    count = (targets != IGNORE_INDEX).sum()
    idx, targets, kwargs = context_parallel_batch(idx, targets, group, document_ids, window)
    return forward(idx, targets, reduction="sum", **kwargs) / count


class ContextSplit:
    """The parallel plan's context-parallel part: the C ranks of `group` split every sequence
    (C = 1: nothing is split and the loss is the model's mean)."""

    def __init__(self, size: int = 1, group=None):
        self.size, self.group = size, group

    def apply(self, model) -> None:
        """Every attention layer of the plain model becomes the ring over the CP group."""
        if self.size > 1:
            use_context_parallel(model, self.group)

    def share(self, forward, idx: torch.Tensor, targets: torch.Tensor, document_ids: torch.Tensor | None = None,
              window: int | None = None) -> torch.Tensor:
        """This rank's part of the micro-batch's mean loss: the mean itself, or its CP share. The
        document ids stay where the sampler made them (the CPU): the ring is planned from them on
        the host."""
        if self.size == 1:
            masks = {} if document_ids is None else {"document_ids": document_ids.to(idx.device, non_blocking=True)}
            return forward(idx, targets, **masks)
        return context_parallel_loss(forward, idx, targets, self.group, document_ids, window)

    def train_loss(self, forward, idx: torch.Tensor, targets: torch.Tensor,
                   document_ids: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
        """The loss to back-propagate: the share scaled by C (gradients are averaged over all ranks)."""
        share = self.share(forward, idx, targets, document_ids, window)
        return share if self.size == 1 else self.size * share
