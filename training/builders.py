"""Config -> objects, in one place: the builders train.py, the Trainer, the scripts and the tests use.

The `model` and `data` packages build from config nodes they trust; here each node is first
checked against the config's schema (training.config.checks.check_group: one line naming a bad key),
what `auto` means on this machine is resolved, and a finished run's checkpoint or export is
turned back into a model for evaluation.

    cfg = compose([...]); device = resolve_config(cfg)
    bundle = build_data(cfg, seq_len=cfg.trainer.seq_len, seed=cfg.seed)
    model = model_from_config(cfg, bundle.vocab_size)
    model, cfg, tokenizer = load_model_for_eval("runs/a/model.safetensors")
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from training.config.checks import check_group, kernel_words, validate_config
from training.interop.huggingface import apply_init_from
from training.parallel.context import context_parallel_size
from training.process.device import resolve_device, resolve_precision, set_deterministic
from training.run.lock import ensure_writable
from training.run.resume import CONTINUING
from training.run.store import load_checkpoint, read_tensors, restore_model

log = logging.getLogger("train")


def build_data(cfg, seq_len: int, seed: int, rank: int = 0, world_size: int = 1, progress: bool | None = None,
               seq_len_from: str = "trainer.seq_len", check_tokenizer=None):
    """data.build_data for `cfg.data` and `cfg.tokenizer`, after the data group's types and ranges
    are checked (schema defaults filled in) and its cache folder is known to be writable.
    seq_len_from: what set seq_len, as a refusal names it (a tool's flag, where not the config);
    check_tokenizer: data.build.build_data's."""
    from data.build import build_data as build

    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be at least 1")
    data = check_group("data", cfg.data)
    cache_dir = ensure_writable(Path(str(cfg.data.cache_dir)), "data.cache_dir")  # before anything is built
    return build(cfg, data, cache_dir, seq_len, seed, rank, world_size, progress, seq_len_from, check_tokenizer)


def build_model(cfg_model, vocab_size: int, attention: str, window: int | None = None,
                deterministic: bool = True, kernel: str = "auto"):
    """model.build_model after the `model` node (DictConfig or dict) is checked against the schema:
    a bad value is one ValueError naming the key, before any weights are allocated."""
    from model import build_model as build

    values = OmegaConf.to_container(cfg_model, resolve=True) if isinstance(cfg_model, DictConfig) else dict(cfg_model)
    return build(check_group("model", values), vocab_size, attention, window, deterministic, kernel)


def resolve_config(cfg: DictConfig) -> torch.device:
    """Validate every group and record in `cfg` what `auto` became (device, attention, precision)."""
    from model.attention import check_score_options, resolve_attention

    if cfg.get("resume") in CONTINUING and OmegaConf.is_interpolation(cfg.run, "dir"):
        raise ValueError(f"resume={cfg.resume} needs run.dir=<the folder of the run to continue>: without it every "
                         f"run gets a new folder, so there would be nothing to resume")
    OmegaConf.resolve(cfg)
    if cfg.model.get("init_from"):
        apply_init_from(cfg)  # the Hugging Face folder's architecture and tokenizer replace the configured ones
    validate_config(cfg)
    device = resolve_device(cfg.device)
    # before anything starts CUDA (resolving the kernel below reads the GPU's capability)
    set_deterministic(bool(cfg.trainer.get("deterministic", False)), device)
    attention = cfg.attention.name
    if attention == "auto" and context_parallel_size(cfg) > 1:  # the ring needs a block that returns the lse
        attention = "flash" if device.type == "cuda" else "naive"
    with open_dict(cfg):
        cfg.device = device.type
        cfg.attention.name = resolve_attention(attention, device, _score_options(cfg))
        cfg.trainer.precision = resolve_precision(cfg.trainer.precision, device)
        if cfg.attention.name == "flash":
            cfg.attention.plan = str(attention_plan(cfg, device))
        elif kernel_words(cfg) != ("auto", "auto"):
            raise ValueError(f"attention.kernel={cfg.attention.kernel} chooses attention=flash's kernels; "
                             f"attention={cfg.attention.name} takes only attention.kernel=auto")
    check_score_options(cfg.attention.name, cfg.model.get("attention_softcap"), bool(cfg.model.get("attention_sinks")),
                        cfg.model.get("attention_dropout") or 0.0)
    if cfg.trainer.get("deterministic") and cfg.attention.name == "sdpa" and device.type == "cuda":
        log.info("trainer.deterministic=true with attention=sdpa: PyTorch leaves out its cuDNN backend and runs a "
                 "deterministic backward (slower than its default)")
    return device


def _score_options(cfg: DictConfig) -> bool:
    """Whether the model soft-caps its attention scores or has attention sinks (kernels/scores.py)."""
    return cfg.model.get("attention_softcap") is not None or bool(cfg.model.get("attention_sinks"))


def attention_plan(cfg: DictConfig, device: torch.device):
    """The kernel plan (kernels/plan.py) the model's training calls will get: what q, k, v will
    be (the autocast dtype, head dim, causal, the mask, the length, what is done to the scores)
    decides it before any work, so the run can log and record it; a kernel word that cannot run is
    the kernels' one-line ValueError."""
    from kernels.plan import Setting, arch_of, plan_kernels

    dtype = torch.bfloat16 if cfg.trainer.precision == "bf16" else torch.float32
    head_dim = cfg.model.d_model // cfg.model.n_head
    if context_parallel_size(cfg) > 1:
        mask = "key_bounds"       # the ring gives each block its share of the mask
    elif cfg.data.get("document_mask"):
        mask = "documents"
    else:
        mask = "none" if cfg.attention.get("window") is None else "window"
    # q, k and v are views of the fused QKV projection (or, after RoPE, contiguous): TMA reads them
    # whenever a head's row is a multiple of 16 bytes
    tma = head_dim * dtype.itemsize % 16 == 0
    setting = Setting(arch_of(device), dtype, head_dim, True, mask, int(cfg.trainer.seq_len), tma,
                      bool(cfg.attention.get("deterministic", True)), *kernel_words(cfg),
                      dropout=bool(cfg.model.get("attention_dropout")),
                      softcap=cfg.model.get("attention_softcap") is not None,
                      sinks=bool(cfg.model.get("attention_sinks")))
    return plan_kernels(setting)


def model_from_config(cfg: DictConfig, vocab_size: int, attention: str | None = None):
    """The GPT of `cfg.model` (attention: the resolved `cfg.attention.name` unless given) with the
    sliding window of `cfg.attention.window`."""
    attention = attention or cfg.attention.name
    return build_model(cfg.model, vocab_size=vocab_size, attention=attention,
                       window=cfg.attention.get("window"),
                       deterministic=cfg.attention.get("deterministic", True),  # absent in configs saved before it
                       kernel=kernel_words(cfg) if attention == "flash" else "auto")


def load_model_for_eval(ckpt_path: str | Path, device: str = "auto", attention: str | None = None):
    """(model in eval mode, the run's resolved config, its tokenizer) from one checkpoint (a file,
    or an FSDP run's DCP folder) or a weights-only export (`model.safetensors`, see training/interop/weights.py), whatever the number of
    processes that trained it.

    The tokenizer is the copy the run kept in its run.dir (no corpus needed); runs older than
    that rebuild it through the data package, the same builder training used, so ids match.
    `attention` swaps the backend (e.g. naive vs flash) for evals. A token cache no longer
    where the checkpoint says is looked for in $FLASHTRAIN_CACHE (see relocate_cache).
    """
    from data.tokenizer import load_run_tokenizer
    from model.attention import resolve_attention
    from training.interop.weights import load_weights, read_config

    weights_only = Path(ckpt_path).suffix == ".safetensors"
    state = None if weights_only else read_tensors(ckpt_path, load_checkpoint(ckpt_path), optimizer=False)
    cfg = OmegaConf.create(read_config(ckpt_path) if weights_only else state["config"])
    dev = resolve_device(device)
    attn = resolve_attention(attention or "auto", dev, _score_options(cfg))
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
