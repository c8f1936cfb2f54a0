"""Held-out loss during training, and a trained model back from a checkpoint for scripts."""
from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import nn

from training.checkpoint import load_checkpoint, restore_model
from training.device import autocast, resolve_device, resolve_precision


@torch.no_grad()
def evaluate_loss(model: nn.Module, batches: list, device: torch.device, precision: str) -> float:
    """Mean loss over fixed validation batches (the same batches every call, so values compare)."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    for x, y in batches:
        with autocast(device, precision):
            total += model(x.to(device), y.to(device)).float()
    model.train(was_training)
    return (total / len(batches)).item()


def load_model_for_eval(ckpt_path: str | Path, device: str = "auto", attention: str | None = None):
    """(model in eval mode, the run's resolved config, its tokenizer) from one checkpoint file.

    The tokenizer is rebuilt from the saved config through the data package, the same builder
    training used, so ids match; `attention` swaps the backend (e.g. naive vs flash) for evals.
    """
    from data import build_data
    from model import build_model
    from model.attention import resolve_attention

    state = load_checkpoint(ckpt_path)
    cfg = OmegaConf.create(state["config"])
    dev = resolve_device(device)
    attn = resolve_attention(attention or "auto", dev)
    bundle = build_data(cfg, seq_len=cfg.trainer.seq_len, seed=cfg.seed, rank=0, world_size=1)
    model = build_model(cfg.model, vocab_size=bundle.vocab_size, attention=attn)
    restore_model(model, state, ckpt_path, OmegaConf.to_container(cfg.model))
    cfg.attention.name = attn
    cfg.trainer.precision = resolve_precision(cfg.trainer.precision, dev)
    return model.to(dev).eval(), cfg, bundle.tokenizer
