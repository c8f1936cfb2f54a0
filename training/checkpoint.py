"""Checkpoints: atomic writes, the newest complete one for `resume=auto`, validation on load.

A checkpoint is one `torch.save` file, `checkpoints/step_00000100.pt`, holding the model,
optimizer, step, tokens seen, every RNG state, the data sampler's position, the resolved config
and the wandb run id. It is written to `<name>.tmp`, fsynced and renamed, so a crash leaves
either the old set of files or the new one; a file that still fails to load (a disk error, a
copy cut short) is skipped by `resume=auto` with a warning naming it. Loading uses
`weights_only=True`: a checkpoint cannot run code.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path

import torch
from torch import nn

from training.rng import set_rng_state

log = logging.getLogger(__name__)

FORMAT_VERSION = 2      # 2 added "checksum"; version 1 files (no checksum) still load
READABLE_VERSIONS = (1, 2)
REQUIRED_KEYS = ("step", "tokens", "model", "optimizer", "rng", "sampler", "config",
                 "wandb_id")
_NAME = re.compile(r"^step_(\d+)\.pt$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and the reason."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, permissions); the older ones are untouched."""


# Files known to verify, by (path, size, mtime, inode): those this process wrote or checked.
_verified: set[tuple] = set()


def _file_id(path: Path) -> tuple:
    st = path.stat()
    return str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino


def _update_digest(h, obj) -> None:
    """Feed `obj` to the hash in a canonical order; lists and tuples alike (pickling may swap them)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(obj.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}".encode())
        for key in sorted(obj, key=repr):
            h.update(repr(key).encode())
            _update_digest(h, obj[key])
    elif isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)}".encode())
        for item in obj:
            _update_digest(h, item)
    else:
        h.update(f"S{obj!r}".encode())


def state_checksum(state: dict) -> str:
    """sha256 over everything in a checkpoint's state but the checksum itself."""
    h = hashlib.sha256()
    _update_digest(h, {k: v for k, v in state.items() if k != "checksum"})
    return "sha256:" + h.hexdigest()


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
    """Write `state` with its checksum atomically: temp file, fsync, rename, fsync the folder.

    A failed write (a full disk) removes the partial temp file and raises CheckpointWriteError;
    the checkpoints already there are untouched.
    """
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise ValueError(f"checkpoint state lacks {', '.join(missing)}")
    state = {"format_version": FORMAT_VERSION, **state}
    state["checksum"] = state_checksum(state)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        reason = e.strerror or str(e) or type(e).__name__
        hint = ": free some space and rerun with resume=auto" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        raise CheckpointWriteError(e.errno, f"could not write checkpoint {path} ({reason}); the older "
                                            f"checkpoints are untouched{hint}") from e
    _verified.add(_file_id(path))
    return path


def list_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Checkpoint files in `ckpt_dir`, oldest step first (temp files are not checkpoints)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def is_usable(path: Path) -> bool:
    """Whether the checkpoint loads and matches its checksum (remembered for files seen intact)."""
    try:
        if _file_id(path) in _verified:
            return True
        load_checkpoint(path)
    except (OSError, CheckpointError):
        return False
    return True


def prune_checkpoints(ckpt_dir: str | Path, keep: int) -> None:
    """Keep the newest `keep` usable checkpoints; delete older usable ones and stale temp files.

    Unusable files are never counted as kept (nor deleted: they are evidence, and `resume=auto`
    skips them with a warning), so the newest usable checkpoint always survives. Only the run
    holding the folder's lock calls this, so a `.tmp` here is not another writer's.
    """
    if keep < 1:
        raise ValueError(f"keep={keep}: pruning must keep at least one checkpoint")
    for stale in Path(ckpt_dir).glob("*.pt.tmp"):
        stale.unlink(missing_ok=True)
    kept = 0
    for path in reversed(list_checkpoints(ckpt_dir)):
        if not is_usable(path):
            log.warning("checkpoint %s is unusable: kept on disk, not counted among the %d kept", path, keep)
        elif kept < keep:
            kept += 1
        else:
            path.unlink(missing_ok=True)


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
    if state["format_version"] not in READABLE_VERSIONS:
        raise CheckpointError(f"checkpoint {path} has format_version {state['format_version']}, "
                              f"this code reads {', '.join(map(str, READABLE_VERSIONS))}")
    if state["format_version"] >= 2:
        try:
            actual = state_checksum(state)
        except Exception as e:  # a flipped byte can also make a tensor's storage unreadable
            raise CheckpointError(f"checkpoint {path} is unreadable (incomplete or corrupt): {e}") from e
        if state.get("checksum") != actual:
            raise CheckpointError(f"checkpoint {path} is corrupt: its contents do not match the stored "
                                  f"checksum {state.get('checksum')}")
        _verified.add(_file_id(path))
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

    A fresh run refuses a run dir that already holds checkpoints rather than interleave with them;
    `resume=auto` refuses one whose checkpoints are all unusable rather than start over on top of
    their metrics.
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
            present = list_checkpoints(ckpt_dir)
            if present:
                raise CheckpointError(f"resume=auto: none of the {len(present)} checkpoint(s) in {ckpt_dir} is "
                                      f"usable (see the warnings above); move them aside to start over from step 0")
            log.info("resume=auto: no checkpoint in %s, starting from step 0", ckpt_dir)
        return found
    if Path(resume).is_dir():
        raise CheckpointError(f"resume={resume} is a folder: pass a checkpoint file (<run.dir>/checkpoints/"
                              f"step_XXXXXXXX.pt), or run.dir={resume} resume=auto to continue that run")
    return Path(resume), load_checkpoint(resume)


# Model keys that do not change the function or the weights (exact memory features).
_MODEL_KEYS_FREE_TO_CHANGE = ("activation_checkpointing", "loss_chunk_size", "block_chunk_size",
                              "offload_activations")


def _describe_config_differences(saved: dict, current: dict, prefix: str = "model") -> str:
    diffs = [f"{prefix}.{k}={saved.get(k)!r} in checkpoint, {current.get(k)!r} now"
             for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
    return "; ".join(diffs)


def check_unchanged(path: str | Path, saved_cfg: dict, cfg, keys: tuple[str, ...]) -> None:
    """Refuse a resume that changes what the model computes outside the `model` group: the
    "group.key" names in `keys` (`data.document_mask`, `attention.window`), each at the schema's
    default where an older checkpoint or config lacks it."""
    from omegaconf import OmegaConf

    from training.schema import default_of

    diffs = []
    for key in keys:
        group, name = key.split(".")
        default = default_of(key)
        old = saved_cfg.get(group, {}).get(name, default)
        new = OmegaConf.select(cfg, key, default=default)
        if old != new:
            diffs.append(f"{key}={old!r} in checkpoint, {new!r} now")
    if diffs:
        raise CheckpointError(f"checkpoint {path} was trained with {'; '.join(diffs)}: it changes what the model "
                              f"computes (pass the checkpoint's values, or start a new run.dir)")


def check_model_config(path: str | Path, saved: dict, current: dict) -> None:
    """Refuse weights trained with another model config, even one with the same tensor shapes
    (heads, norm, RoPE base, tied embeddings): they would load into a different function.
    A key added to the schema since the checkpoint was written counts at its default."""
    from training.config import check_group

    saved, current = check_group("model", saved), check_group("model", current)
    ignore = set(_MODEL_KEYS_FREE_TO_CHANGE)
    if saved.get("pos_emb", "rope") == current.get("pos_emb") == "rope":
        ignore.add("max_seq_len")  # RoPE has no table: the longest length is a limit, not a weight
    diff = _describe_config_differences({k: v for k, v in saved.items() if k not in ignore},
                                        {k: v for k, v in current.items() if k not in ignore})
    if diff:
        raise CheckpointError(f"checkpoint {path} was trained with another model config: {diff} "
                              f"(pass the checkpoint's values, or start a new run.dir)")


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


DATA_CHANGES = "data_changes.jsonl"


def _sampler_state_for_new_data(saved: dict, sampler) -> dict:
    """The saved position carried over to a changed corpus: same epoch, same fraction of it."""
    if int(saved["n_windows"]) == sampler.n_windows:
        return saved
    in_epoch = len(sampler.order(int(saved["epoch"])))   # this epoch's windows on the new data
    cursor = int(saved["cursor"]) * in_epoch // max(1, int(saved["n_windows"]))
    return {**saved, "n_windows": sampler.n_windows, "cursor": min(cursor, in_epoch - sampler.world_size)}


def restore_training_state(path: str | Path, state: dict, *, model: nn.Module, optimizer, sampler,
                           data_fingerprint: str, model_cfg: dict, allow_data_change: bool = False,
                           run_dir: str | Path | None = None) -> None:
    """Put a run back exactly where `state` left it: weights, optimizer moments, data position, RNGs.

    Refuses another model config, and a checkpoint of other data (the sampler position would
    index different tokens) unless `allow_data_change`, which continues at the same point of the
    epoch on the new data and appends the change to <run_dir>/data_changes.jsonl.
    """
    check_model_config(path, state["config"].get("model", {}), model_cfg)
    saved_fp = state["config"].get("run", {}).get("data_fingerprint")
    sampler_state = state["sampler"]
    if saved_fp != data_fingerprint:
        if not allow_data_change:
            raise CheckpointError(f"checkpoint {path} was trained on data {saved_fp}, this run reads "
                                  f"{data_fingerprint}: the corpus changed; pass data.allow_changed=true to continue on the new data")
        log.warning("data changed since %s: %s -> %s; continuing (data.allow_changed=true)", path, saved_fp,
                    data_fingerprint)
        sampler_state = _sampler_state_for_new_data(sampler_state, sampler)
        if run_dir is not None:
            with open(Path(run_dir) / DATA_CHANGES, "a") as f:
                f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                    "step": state["step"], "checkpoint": str(path), "from": saved_fp,
                                    "to": data_fingerprint}) + "\n")
    restore_model(model, state, path, model_cfg)
    optimizer.load_state_dict(state["optimizer"])
    try:
        sampler.load_state_dict(sampler_state)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None
    set_rng_state(state["rng"])


def last_checkpoint_note(run_dir: str | Path) -> str:
    """Where the last good checkpoint is, for messages of a run that stopped."""
    good = next((p for p in reversed(list_checkpoints(checkpoint_dir(run_dir))) if is_usable(p)), None)
    return f"the last good checkpoint is {good}" if good else "no checkpoint was saved yet"
