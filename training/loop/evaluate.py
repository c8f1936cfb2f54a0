"""Held-out loss: the Trainer's evaluation, and the scripts' (training.builders.load_model_for_eval
brings a trained model back from its checkpoint)."""
from __future__ import annotations

import torch
from torch import nn

from training.process.device import autocast


@torch.no_grad()
def evaluate_loss(model: nn.Module, batches: list, device: torch.device, precision: str, env=None) -> float:
    """Mean loss over fixed validation batches (the same batches every call, so values compare);
    a batch (x, y, document_ids) is evaluated with the document mask.

    Under several processes (`env`, a training.parallel.distributed.DistEnv) data-parallel rank r
    evaluates batches r, r + N, ... and the sums are added over ranks; under context parallelism
    the C ranks of a group each add their share of every batch's mean (training.parallel.context).
    An FSDP-sharded model gathers its weights in every forward, so there each rank runs the same
    number of forwards (a short rank repeats a batch and discards the result).
    """
    from training.parallel.context import context_parallel_loss
    from training.parallel.distributed import all_reduce, is_sharded

    enabled = env is not None and env.enabled
    world, rank = (env.dp_size, env.dp_rank) if enabled else (1, 0)
    own = batches[rank::world]
    rounds = -(-len(batches) // world) if world > 1 and is_sharded(model) else len(own)
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    for i in range(rounds):
        x, y, *doc_ids = own[i] if i < len(own) else batches[0]   # doc ids: data.document_mask
        x, y = x.to(device), y.to(device)
        with autocast(device, precision):
            if enabled and env.cp_size > 1:   # the ring is planned from the CPU ids
                loss = context_parallel_loss(model, x, y, env.cp_group, doc_ids[0] if doc_ids else None,
                                             model.window).float()
            else:
                loss = model(x, y, **({"document_ids": doc_ids[0].to(device)} if doc_ids else {})).float()
        if i < len(own):
            total += loss
    model.train(was_training)
    if enabled:
        all_reduce(total, env)
    return (total / len(batches)).item()
