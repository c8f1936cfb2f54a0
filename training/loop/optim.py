"""AdamW with weight-decay groups and the warmup + cosine learning-rate schedule."""
from __future__ import annotations

import math

import torch
from omegaconf import DictConfig
from torch import nn

def param_groups(model: nn.Module, weight_decay: float, decay_embeddings: bool = True) -> list[dict]:
    """Decay every matrix: the blocks' weights and, with `decay_embeddings`, the token and
    position tables (a tied output head is the token table).

    Norm gains and biases are 1-D and decaying them only fights their purpose. Embedding tables
    are decayed as nanoGPT and GPT-2 decay them (every 2-D tensor), so nanoGPT's recipes train
    here as they do there; on tiny-shakespeare leaving them undecayed made no difference within
    noise through step 1,750 (benchmarks/shakespeare_char/shakespeare_char_h200.md). `decay_embeddings=False`
    exempts them, for corpora whose rare tokens should not shrink between their uses.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for param in model.parameters():  # deduplicated: a tied tensor appears once
        if not param.requires_grad:
            continue
        decayed = param.dim() >= 2 and (decay_embeddings or id(param) not in embeddings)
        (decay if decayed else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, optim: DictConfig, device: torch.device) -> torch.optim.AdamW:
    from training.config.checks import check_group
    check_group("optim", optim)
    fused = device.type == "cuda" if optim.fused == "auto" else bool(optim.fused)
    return torch.optim.AdamW(param_groups(model, optim.weight_decay, optim.get("decay_embeddings", True)), lr=optim.lr,
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
