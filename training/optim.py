"""AdamW with weight-decay groups and the warmup + cosine learning-rate schedule."""
from __future__ import annotations

import math

import torch
from omegaconf import DictConfig
from torch import nn

SCHEDULES = ("cosine", "constant")


def validate_optim(optim: DictConfig) -> None:
    """Raise ValueError naming the first bad `optim.*` value (wrong types included)."""
    from training.config import is_number

    def bad(key: str, reason: str) -> ValueError:
        return ValueError(f"optim.{key}={optim[key]!r}: {reason}")

    if optim.name != "adamw":
        raise bad("name", "only adamw is implemented")
    for key in ("lr", "min_lr", "eps", "weight_decay", "grad_clip"):
        if not is_number(optim[key]):
            raise bad(key, "must be a number")
    if not optim.lr > 0:
        raise bad("lr", "must be > 0")
    if not 0 <= optim.min_lr <= optim.lr:
        raise bad("min_lr", f"must lie in [0, optim.lr={optim.lr}]")
    betas = optim.betas
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2 \
            or not all(is_number(b) and 0 <= b < 1 for b in betas):
        raise bad("betas", "expected two values in [0, 1), e.g. [0.9,0.95]")
    if not optim.eps > 0:
        raise bad("eps", "must be > 0")
    if not optim.weight_decay >= 0:
        raise bad("weight_decay", "must be >= 0")
    if not (isinstance(optim.warmup_steps, int) and not isinstance(optim.warmup_steps, bool)
            and optim.warmup_steps >= 0):
        raise bad("warmup_steps", "must be an integer >= 0")
    if optim.schedule not in SCHEDULES:
        raise bad("schedule", f"expected one of {', '.join(SCHEDULES)}")
    if not optim.grad_clip >= 0:
        raise bad("grad_clip", "must be >= 0 (0 disables clipping)")
    if optim.fused not in ("auto", True, False):
        raise bad("fused", "expected auto, true or false")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay the weight matrices only.

    Norm gains and biases are 1-D and decaying them only fights their purpose; embedding rows are
    looked up, not multiplied, so decay would shrink rare tokens towards zero between their uses.
    A tied output head shares its tensor with the embedding and so is not decayed either.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for param in model.parameters():  # deduplicated: a tied tensor appears once
        if not param.requires_grad:
            continue
        (decay if param.dim() >= 2 and id(param) not in embeddings else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, optim: DictConfig, device: torch.device) -> torch.optim.AdamW:
    validate_optim(optim)
    fused = device.type == "cuda" if optim.fused == "auto" else bool(optim.fused)
    return torch.optim.AdamW(param_groups(model, optim.weight_decay), lr=optim.lr,
                             betas=tuple(optim.betas), eps=optim.eps, fused=fused)


def lr_at(step: int, optim: DictConfig, max_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine to min_lr.

    A pure function of the step, so a resumed run needs no scheduler state beyond the step count.
    """
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / (optim.warmup_steps + 1)
    if optim.schedule == "constant":
        return optim.lr
    span = max(1, max_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / span)
    return optim.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (optim.lr - optim.min_lr)
