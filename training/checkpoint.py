"""Checkpoints: atomic writes, the newest complete one for `resume=auto`, validation on load.

A checkpoint is one `torch.save` file, `checkpoints/step_00000100.pt`, holding the model,
optimizer, step, tokens seen, every RNG state, the data sampler's position, the resolved config
and the wandb run id. It is written to `<name>.tmp`, fsynced and renamed, so a crash leaves
either the old set of files or the new one; a file that still fails to load (a disk error, a
copy cut short) is skipped by `resume=auto` with a warning naming it. Loading uses
`weights_only=True`: a checkpoint cannot run code.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch
from torch import nn

from training.rng import set_rng_state

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
REQUIRED_KEYS = ("step", "tokens", "model", "optimizer", "rng", "sampler", "config",
                 "wandb_id")
_NAME = re.compile(r"^step_(\d+)\.pt$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and the reason."""


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step_{step:08d}.pt"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(path: str | Path, state: dict) -> Path:
    """Write `state` atomically: temp file, fsync, rename, fsync the folder."""
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise ValueError(f"checkpoint state lacks {', '.join(missing)}")
    state = {"format_version": FORMAT_VERSION, **state}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return path


def list_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Checkpoint files in `ckpt_dir`, oldest step first (temp files are not checkpoints)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def prune_checkpoints(ckpt_dir: str | Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints, and temp files left by a killed writer."""
    for stale in Path(ckpt_dir).glob("*.pt.tmp"):
        stale.unlink(missing_ok=True)
    for old in list_checkpoints(ckpt_dir)[:-keep]:
        old.unlink(missing_ok=True)


def load_checkpoint(path: str | Path) -> dict:
    """Read and check a checkpoint's structure; CheckpointError (one line, naming it) otherwise."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # truncated zip, garbage bytes, disallowed pickle: all mean unusable
        reason = str(e).strip().splitlines()[0].split(". ")[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path} is unreadable (incomplete or corrupt): {reason}") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(state).__name__}, not a flashtrain checkpoint")
    missing = [k for k in ("format_version", *REQUIRED_KEYS) if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} is not a flashtrain checkpoint: lacks {', '.join(missing)}")
    if state["format_version"] != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format_version {state['format_version']}, "
                              f"this code reads {FORMAT_VERSION}")
    return state


def latest_checkpoint(ckpt_dir: str | Path) -> tuple[Path, dict] | None:
    """The newest checkpoint that loads, with its state; unreadable ones are skipped with a warning."""
    for path in reversed(list_checkpoints(ckpt_dir)):
        try:
            return path, load_checkpoint(path)
        except CheckpointError as e:
            log.warning("skipping %s", e)
    return None


def find_resume_checkpoint(resume: str | None, run_dir: str | Path) -> tuple[Path, dict] | None:
    """What `resume=` asks for: nothing (a fresh run), the newest usable checkpoint, or one file.

    A fresh run refuses a run dir that already holds checkpoints rather than interleave with them.
    """
    ckpt_dir = checkpoint_dir(run_dir)
    if resume is None:
        if list_checkpoints(ckpt_dir):
            raise ValueError(f"run.dir={run_dir} already holds checkpoints: pass resume=auto to continue "
                             f"that run, or choose another run.dir")
        return None
    if resume == "auto":
        found = latest_checkpoint(ckpt_dir)
        if found is None:
            log.info("resume=auto: no usable checkpoint in %s, starting from step 0", ckpt_dir)
        return found
    return Path(resume), load_checkpoint(resume)


def _describe_config_differences(saved: dict, current: dict, prefix: str = "model") -> str:
    diffs = [f"{prefix}.{k}={saved.get(k)!r} in checkpoint, {current.get(k)!r} now"
             for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
    return "; ".join(diffs)


def restore_model(model: nn.Module, state: dict, path: str | Path, current_model_cfg: dict | None = None) -> None:
    """Load the weights after checking every name and shape, so a mismatch is one clear line."""
    saved, wanted = state["model"], model.state_dict()
    problems = [f"{k} has shape {tuple(saved[k].shape)} in checkpoint, {tuple(v.shape)} in model"
                for k, v in wanted.items() if k in saved and saved[k].shape != v.shape]
    problems += [f"missing {k}" for k in wanted if k not in saved]
    problems += [f"unexpected {k}" for k in saved if k not in wanted]
    if problems:
        detail = problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
        if current_model_cfg is not None:
            config_diff = _describe_config_differences(state["config"].get("model", {}), current_model_cfg)
            detail += f"; config: {config_diff}" if config_diff else ""
        raise CheckpointError(f"checkpoint {path} does not match the model: {detail}")
    model.load_state_dict(saved)


def restore_training_state(path: str | Path, state: dict, *, model: nn.Module, optimizer, sampler,
                           data_fingerprint: str, model_cfg: dict) -> None:
    """Put a run back exactly where `state` left it: weights, optimizer moments, data position, RNGs.

    Refuses a checkpoint of other data: the sampler position would then index different tokens.
    """
    saved_fp = state["config"].get("run", {}).get("data_fingerprint")
    if saved_fp != data_fingerprint:
        raise CheckpointError(f"checkpoint {path} was trained on data {saved_fp}, this run reads {data_fingerprint}")
    restore_model(model, state, path, model_cfg)
    optimizer.load_state_dict(state["optimizer"])
    sampler.load_state_dict(state["sampler"])
    set_rng_state(state["rng"])
