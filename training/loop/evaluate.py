"""Held-out loss: the Trainer's evaluation, and the scripts' (training.builders.load_model_for_eval
brings a trained model back from its checkpoint)."""
from __future__ import annotations

import torch
from torch import nn

from training.parallel.plan import ParallelPlan
from training.process.device import autocast


@torch.no_grad()
def evaluate_loss(model: nn.Module, batches: list, device: torch.device, precision: str,
                  plan: ParallelPlan | None = None) -> float:
    """Mean loss over fixed validation batches (the same batches every call, so values compare);
    a batch (x, y, document_ids) is evaluated with the document mask.

    Under several processes (`plan`, the run's training.parallel.plan.ParallelPlan) data-parallel
    rank r evaluates batches r, r + N, ... and the sums are added over ranks; under context
    parallelism the C ranks of a group each add their share of every batch's mean. Where the plan
    asks every rank to run as many forwards (FSDP2 gathers its weights in each), a short rank
    repeats a batch and discards the result.
    """
    plan = plan or ParallelPlan()
    own, rounds = plan.eval_batches(batches)
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    for i in range(rounds):
        x, y, *doc_ids = own[i] if i < len(own) else batches[0]   # doc ids: data.document_mask
        with autocast(device, precision):   # the ring is planned from the CPU ids
            loss = plan.eval_loss(model, x.to(device), y.to(device), *doc_ids).float()
        if i < len(own):
            total += loss
    model.train(was_training)
    plan.all_reduce(total)
    return (total / len(batches)).item()
