"""The training step alone: `TrainStep`, one optimizer step of gradient accumulation, bf16 autocast,
torch.compile, clipping and the optimizer, laid out over the processes by the parallel plan
(training.parallel.plan). The Trainer calls it, and so do the scripts that run a training step on
a model of their own (max context, step profile): they measure the code that trains.
"""
from __future__ import annotations

from typing import Callable

import torch
from omegaconf import DictConfig

from training.loop.optim import build_optimizer
from training.parallel.plan import ParallelPlan
from training.process.device import autocast, resolve_precision


def clip_gradients(params: list, max_norm: float) -> torch.Tensor:
    """Total gradient norm (over all ranks' shards under FSDP), gradients scaled down to `max_norm`."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if hasattr(norm, "full_tensor"):  # a DTensor: the norm of this rank's shard, made global
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


class TrainStep:
    """One optimizer step of `micro_steps` micro-batches: forward under autocast (compiled when
    `trainer.compile`, where the plan places it), backward, gradient reduction across ranks,
    clipping, optimizer.

    `model` is the plain module (its state_dict is what checkpoints hold); the step calls what the
    plan made of it (DDP, FSDP2-sharded, the context-parallel ring, or the model itself), compiled
    or not. No host sync: the loss and gradient norm come back as device tensors.
    """

    def __init__(self, model, cfg: DictConfig, device: torch.device, plan: ParallelPlan | None = None,
                 micro_steps: int | None = None):
        t, self.plan = cfg.trainer, plan or ParallelPlan()
        self.model, self.device, self.precision = model, device, resolve_precision(t.precision, device)
        self.wrapped = self.plan.parallelize(model, device, self.precision)
        self.optimizer = build_optimizer(model, cfg.optim, device)  # after sharding: over the shards
        self.params = list(model.parameters())
        self.forward = self.plan.compile(model, self.wrapped) if t.compile else self.wrapped
        self.micro_steps = micro_steps or self.plan.micro_steps(t.grad_accum)
        self.grad_clip = cfg.optim.grad_clip or float("inf")

    def micro_loss(self, idx: torch.Tensor, targets: torch.Tensor, document_ids: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """The loss to back-propagate for one micro-batch (the plan's: the model's mean, or under
        context parallelism C x this rank's share of it)."""
        return self.plan.train_loss(self.forward, self.model, idx, targets, document_ids)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def __call__(self, next_batch: Callable[[], tuple]) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean loss over this rank's micro-batches, total gradient norm), both device tensors;
        the run's loss is the mean of the first over all ranks."""
        n, device = self.micro_steps, self.device
        loss = torch.zeros((), device=device)
        for i in range(n):
            x, y, *doc_ids = next_batch()  # (x, y) or, with data.document_mask, (x, y, document ids)
            self.plan.set_gradient_sync(self.wrapped, i == n - 1)
            with autocast(device, self.precision):
                micro_loss = self.micro_loss(x.to(device, non_blocking=True), y.to(device, non_blocking=True),
                                             *doc_ids)
            (micro_loss / n).backward()
            loss += micro_loss.detach() / n
        grad_norm = clip_gradients(self.params, self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm

    def full_state(self) -> tuple[dict | None, dict | None]:
        """(model, optimizer) state dicts of the whole model on rank 0 (None elsewhere), in the
        single-process format whatever the layout; every rank must call this (FSDP2 gathers)."""
        return self.plan.full_state(self.model, self.optimizer)
