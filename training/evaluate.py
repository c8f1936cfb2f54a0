"""Held-out loss during training, and a trained model back from a checkpoint for scripts."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import nn

from training.checkpoint import is_sharded, load_checkpoint, restore_model
from training.dcp import consolidate
from training.device import autocast, resolve_device, resolve_precision

log = logging.getLogger(__name__)


@torch.no_grad()
def evaluate_loss(model: nn.Module, batches: list, device: torch.device, precision: str, env=None) -> float:
    """Mean loss over fixed validation batches (the same batches every call, so values compare);
    a batch (x, y, document_ids) is evaluated with the document mask.

    Under several processes (`env`, a training.distributed.DistEnv) data-parallel rank r
    evaluates batches r, r + N, ... and the sums are added over ranks; under context parallelism
    the C ranks of a group each add their share of every batch's mean (training.context_parallel).
    An FSDP-sharded model gathers its weights in every forward, so there each rank runs the same
    number of forwards (a short rank repeats a batch and discards the result).
    """
    from training.context_parallel import context_parallel_loss
    from training.distributed import all_reduce, is_sharded

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


def load_model_for_eval(ckpt_path: str | Path, device: str = "auto", attention: str | None = None):
    """(model in eval mode, the run's resolved config, its tokenizer) from one checkpoint (a file,
    or an FSDP run's DCP folder) or a weights-only export (`model.safetensors`, see training/export.py), whatever the number of
    processes that trained it.

    The tokenizer is the copy the run kept in its run.dir (no corpus needed); runs older than
    that rebuild it through the data package, the same builder training used, so ids match.
    `attention` swaps the backend (e.g. naive vs flash) for evals. A token cache no longer
    where the checkpoint says is looked for in $FLASHTRAIN_CACHE (see relocate_cache).
    """
    from data import build_data
    from data.tokenizer import load_run_tokenizer
    from model.attention import resolve_attention
    from training.export import load_weights, read_config
    from training.trainer import model_from_config

    weights_only = Path(ckpt_path).suffix == ".safetensors"
    state = None if weights_only else load_checkpoint(ckpt_path)
    if state is not None and is_sharded(state):  # a DCP folder (trainer.parallel=fsdp): its weights on this process
        state["model"] = consolidate(ckpt_path, keys=("model",))["model"]
    cfg = OmegaConf.create(read_config(ckpt_path) if weights_only else state["config"])
    dev = resolve_device(device)
    attn = resolve_attention(attention or "auto", dev)
    relocate_cache(cfg)
    path = Path(ckpt_path)
    tokenizer = load_run_tokenizer(cfg.tokenizer, [path.parent, path.parent.parent])
    if tokenizer is None:
        log.warning("%s's run keeps no tokenizer.json: rebuilding the tokenizer from the corpus", path)
        tokenizer = build_data(cfg, seq_len=cfg.trainer.seq_len, seed=cfg.seed, rank=0, world_size=1).tokenizer
    model = model_from_config(cfg, tokenizer.vocab_size, attention=attn)
    if weights_only:
        load_weights(model, ckpt_path)
    else:
        restore_model(model, state, ckpt_path, OmegaConf.to_container(cfg.model))
    cfg.attention.name = attn
    cfg.trainer.precision = resolve_precision(cfg.trainer.precision, dev)
    return model.to(dev).eval(), cfg, tokenizer


def relocate_cache(cfg) -> None:
    """A checkpoint records its run's absolute `data.cache_dir`; on another machine (or after the
    folder moved) that path is gone. Then $FLASHTRAIN_CACHE, when set, is where to look, rather
    than re-tokenizing the corpus into a new folder at the old path."""
    saved, env = Path(str(cfg.data.cache_dir)).expanduser(), os.environ.get("FLASHTRAIN_CACHE")
    if not saved.exists() and env and Path(env).expanduser() != saved:
        log.info("data.cache_dir %s of the checkpoint is gone: using FLASHTRAIN_CACHE=%s", saved, env)
        cfg.data.cache_dir = env
