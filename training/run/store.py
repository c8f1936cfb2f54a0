"""Checkpoints: atomic writes, the newest complete one of a run for `resume=auto`, validation on load.

A checkpoint is one `torch.save` file, `checkpoints/step_00000100.pt`, holding the model,
optimizer, step, tokens seen, every RNG state, the data sampler's position, the resolved config,
the wandb run id and the run's lineage (its id, and the checkpoint it branched from). It is
written to `<name>.tmp` (created exclusively: a planted link is never followed), fsynced and
renamed, so a crash leaves either the old set of files or the new one; a failed write (a full
disk, a file-size limit) removes the temp file. A file that still fails to load (a disk error, a
copy cut short) is skipped by `resume=auto` with a warning naming it. Loading uses
`weights_only=True`: a checkpoint cannot run code. Pruning and `resume=auto` look only at the
files of one run (training.run.resume decides which): another run's checkpoint in the same folder is
never deleted, never counted as kept.

Under `trainer.parallel=fsdp` a checkpoint is a folder, `checkpoints/step_00000100.dcp/`, that
every rank writes its shards into (training.run.dcp): the same state, the same rules (made visible by
one rename once complete, every file verified by sha256 against its manifest, lineage, pruning).
Both kinds load wherever a checkpoint is read; `resume=auto` takes the newest of either.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import re
import shutil
import time
from pathlib import Path

import torch
from torch import nn

from training.run import dcp
from training.process.rng import set_rng_state
from training.run.files import RecordingWriter, new_file, os_error_in

log = logging.getLogger(__name__)

FORMAT_VERSION = 3      # 2 added "checksum", 3 "lineage"; older files still load (a version 2 file has no lineage)
READABLE_VERSIONS = (1, 2, 3)
REQUIRED_KEYS = ("step", "tokens", "model", "optimizer", "rng", "sampler", "config",
                 "wandb_id")
_NAME = re.compile(r"^step_(\d+)\.(pt|dcp)$")
_TENSOR_KEYS = ("model", "optimizer")   # in the shards of a sharded checkpoint, not its state.pt
ANY_RUN = "*"   # pruning / picking over every file, whichever run wrote it (lineage ids are hex)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and the reason."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, permissions); the older ones are untouched."""


# Files known to verify, by (path, size, mtime, inode) -> their lineage id: those this process
# wrote or checked.
_verified: dict[tuple, str | None] = {}


def _file_id(path: Path) -> tuple:
    if path.is_dir() and not path.is_symlink():   # a sharded checkpoint: every file in it
        return (str(path.resolve()), *sorted((p.name, *_file_id(p)[1:]) for p in path.iterdir()))
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


def checkpoint_path(run_dir: str | Path, step: int, sharded: bool = False) -> Path:
    """The single file of a step, or (sharded) its DCP folder."""
    return checkpoint_dir(run_dir) / f"step_{step:08d}{dcp.SUFFIX if sharded else '.pt'}"


def lineage_id(state: dict) -> str | None:
    """The id of the run that wrote a checkpoint's state; None for files from before lineages."""
    lineage = state.get("lineage")
    return lineage.get("id") if isinstance(lineage, dict) else None


def save_checkpoint(path: str | Path, state: dict) -> Path:
    """Write `state` with its checksum atomically: exclusive temp file, fsync, rename, fsync the folder.

    A failed write (a full disk, a file-size limit, an interrupt) removes the partial temp file;
    write errors raise CheckpointWriteError naming the cause. The checkpoints already there are untouched.
    """
    state = _stamped(state, REQUIRED_KEYS)
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with new_file(path) as f:
            writer = RecordingWriter(f)
            try:
                torch.save(state, writer)
            except RuntimeError as e:  # torch's zip writer hides the OSError of a failed write
                if writer.error is None:
                    raise
                raise writer.error from e
    except OSError as e:
        raise _write_error(path, e) from e
    _verified[_file_id(path)] = lineage_id(state)
    return path


def _write_error(path: Path, e: OSError) -> CheckpointWriteError:
    error = os_error_in(e) or e
    reason = error.strerror or str(error) or type(error).__name__
    hint = {errno.ENOSPC: ": free some space and rerun with resume=auto",
            errno.EDQUOT: ": free some space (disk quota) and rerun with resume=auto",
            errno.EFBIG: ": raise the file-size limit (ulimit -f) and rerun with resume=auto"}.get(error.errno, "")
    return CheckpointWriteError(error.errno, f"could not write checkpoint {path} ({reason}); the older "
                                             f"checkpoints are untouched{hint}")


def _stamped(state: dict, required: tuple[str, ...]) -> dict:
    missing = [k for k in required if k not in state]
    if missing:
        raise ValueError(f"checkpoint state lacks {', '.join(missing)}")
    state = {"format_version": FORMAT_VERSION, **state}
    state["checksum"] = state_checksum(state)
    return state


def save_sharded_checkpoint(path: str | Path, state: dict, model: nn.Module, optimizer, env) -> Path | None:
    """Every rank: the sharded checkpoint folder `path` (training.run.dcp) of `model` and `optimizer`
    with the rest of `state` (no model or optimizer in it); returns the folder on rank 0."""
    path = Path(path)
    meta = _stamped(state, tuple(k for k in REQUIRED_KEYS if k not in _TENSOR_KEYS)) if env.is_main else None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        written = dcp.save_sharded(path, meta, model, optimizer, env)
    except OSError as e:
        raise _write_error(path, e) from e
    if written is not None:
        _verified[_file_id(path)] = lineage_id(meta)
    return written


def list_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Checkpoint files in `ckpt_dir`, oldest step first (temp files are not checkpoints)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def step_of(path: Path) -> int:
    """The step in a checkpoint's file name."""
    return int(_NAME.match(Path(path).name).group(1))


def peek_lineage(path: Path) -> str | None:
    """The run id a checkpoint names, read without checking its checksum (cheap: its tensors are
    memory-mapped, not read); CheckpointError when it does not load as one of ours."""
    path = Path(path)
    try:
        found = _verified.get(_file_id(path), False)
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} is unreadable: {e.strerror or e}") from e
    return lineage_id(_read(path)) if found is False else found


def checkpoint_lineage(path: Path) -> str | None:
    """The lineage id of a checkpoint that loads and matches its checksum (remembered for files
    seen intact); CheckpointError or OSError otherwise."""
    found = _verified.get(_file_id(path), False)
    return lineage_id(load_checkpoint(path)) if found is False else found


def is_usable(path: Path) -> bool:
    """Whether the checkpoint loads and matches its checksum."""
    try:
        checkpoint_lineage(path)
    except (OSError, CheckpointError):
        return False
    return True


def is_of_run(path: Path, run_id: str | None) -> bool:
    """Whether `path` is a usable checkpoint written by run `run_id` (any run's for ANY_RUN)."""
    try:
        if run_id != ANY_RUN and peek_lineage(path) != run_id:
            return False
    except CheckpointError:
        return False
    return is_usable(path)


def prune_checkpoints(ckpt_dir: str | Path, keep: int, run_id: str | None = ANY_RUN) -> None:
    """Keep the newest `keep` usable checkpoints of run `run_id`; delete its older ones and stale temp files.

    Unusable files are never counted as kept (nor deleted: they are evidence, and `resume=auto`
    skips them with a warning), so the newest usable checkpoint always survives; another run's
    files are neither counted nor deleted. Only the run holding the folder's lock calls this, so a
    `.tmp` here is not another writer's.
    """
    if keep < 1:
        raise ValueError(f"keep={keep}: pruning must keep at least one checkpoint")
    for stale in [*Path(ckpt_dir).glob("*.pt.tmp"), *Path(ckpt_dir).glob(f"*{dcp.SUFFIX}.tmp"),
                  *Path(ckpt_dir).glob(f"*{dcp.SUFFIX}.old")]:
        _remove(stale)
    kept = 0
    for path in reversed(list_checkpoints(ckpt_dir)):
        try:
            foreign = run_id != ANY_RUN and peek_lineage(path) != run_id
        except CheckpointError:
            foreign = False  # unreadable: whoever wrote it, it is evidence
        if foreign:
            continue
        if not is_usable(path):
            log.warning("checkpoint %s is unusable: kept on disk, not counted among the %d kept", path, keep)
        elif kept < keep:
            kept += 1
        else:
            _remove(path)


def _remove(path: Path) -> None:
    """A checkpoint file, or a sharded checkpoint's folder (a link itself, never what it points to)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def is_sharded(state: dict) -> bool:
    """Whether `state` is a sharded checkpoint's (its model and optimizer are in the DCP shards)."""
    return "model" not in state


def _read_sharded(path: Path) -> dict:
    try:
        state = dcp.read_state(path)
    except Exception as e:  # no manifest, a link, a state.pt cut short: all mean unusable
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path} is unusable (incomplete or corrupt): {reason}") from e
    return _checked_structure(path, state, tuple(k for k in REQUIRED_KEYS if k not in _TENSOR_KEYS))


def _read(path: Path) -> dict:
    """A checkpoint's state, structure checked, tensors memory-mapped (not yet read); a sharded
    checkpoint's without its model and optimizer (they stay in the shards)."""
    if path.name.endswith(dcp.SUFFIX):
        return _read_sharded(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # truncated zip, garbage bytes, disallowed pickle: all mean unusable
        reason = str(e).strip().splitlines()[0].split(". ")[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path} is unreadable (incomplete or corrupt): {reason}") from e
    return _checked_structure(path, state, REQUIRED_KEYS)


def _checked_structure(path: Path, state, required: tuple[str, ...]) -> dict:
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(state).__name__}, not a flashtrain checkpoint")
    missing = [k for k in ("format_version", *required) if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} is not a flashtrain checkpoint: lacks {', '.join(missing)}")
    if state["format_version"] not in READABLE_VERSIONS:
        raise CheckpointError(f"checkpoint {path} has format_version {state['format_version']}, "
                              f"this code reads {', '.join(map(str, READABLE_VERSIONS))}")
    return state


def load_checkpoint(path: str | Path) -> dict:
    """Read and check a checkpoint's structure and checksum; CheckpointError (one line, naming it)
    otherwise. A file this process already verified (same size, mtime, inode) is not re-hashed."""
    path = Path(path)
    state = _read(path)
    if state["format_version"] >= 2 and _file_id(path) not in _verified:
        if is_sharded(state):
            try:
                dcp.verify(path)
            except (OSError, ValueError) as e:
                raise CheckpointError(f"checkpoint {path} is corrupt: {e}") from e
        try:
            actual = state_checksum(state)
        except Exception as e:  # a flipped byte can also make a tensor's storage unreadable
            raise CheckpointError(f"checkpoint {path} is unreadable (incomplete or corrupt): {e}") from e
        if state.get("checksum") != actual:
            raise CheckpointError(f"checkpoint {path} is corrupt: its contents do not match the stored "
                                  f"checksum {state.get('checksum')}")
        _verified[_file_id(path)] = lineage_id(state)
    return state


def latest_checkpoint(ckpt_dir: str | Path, run_id: str | None = ANY_RUN) -> tuple[Path, dict] | None:
    """The newest checkpoint of run `run_id` that loads, with its state; unreadable ones are
    skipped with a warning, another run's are passed over."""
    for path in reversed(list_checkpoints(ckpt_dir)):
        try:
            state = load_checkpoint(path)
        except CheckpointError as e:
            log.warning("skipping %s", e)
            continue
        if run_id == ANY_RUN or lineage_id(state) == run_id:
            return path, state
    return None


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

    from training.config.schema import default_of

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
    from training.config.checks import check_group

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
                           data_fingerprint: str, model_cfg: dict, allow_data_change: bool = False) -> dict | None:
    """Put a run back exactly where `state` left it: weights, optimizer moments, data position, RNGs.

    Refuses another model config, and a checkpoint of other data (the sampler position would
    index different tokens) unless `allow_data_change`, which continues at the same point of the
    epoch on the new data. Returns the data change to record (<run_dir>/data_changes.jsonl, written
    once the run is accepted), or None.
    """
    check_model_config(path, state["config"].get("model", {}), model_cfg)
    saved_fp = state["config"].get("run", {}).get("data_fingerprint")
    sampler_state, change = state["sampler"], None
    if saved_fp != data_fingerprint:
        if not allow_data_change:
            raise CheckpointError(f"checkpoint {path} was trained on data {saved_fp}, this run reads "
                                  f"{data_fingerprint}: the corpus changed; pass data.allow_changed=true to continue on the new data")
        log.warning("data changed since %s: %s -> %s; continuing (data.allow_changed=true)", path, saved_fp,
                    data_fingerprint)
        sampler_state = _sampler_state_for_new_data(sampler_state, sampler)
        change = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "step": state["step"],
                  "checkpoint": str(path), "from": saved_fp, "to": data_fingerprint}
    if not is_sharded(state):  # a sharded checkpoint's tensors load once the model is wrapped (load_sharded)
        restore_model(model, state, path, model_cfg)
        optimizer.load_state_dict(state["optimizer"])
    try:
        sampler.load_state_dict(sampler_state)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None
    set_rng_state(state["rng"])
    return change


def last_checkpoint_note(run_dir: str | Path, run_id: str | None = ANY_RUN) -> str:
    """Where the last good checkpoint of run `run_id` is, for messages of a run that stopped."""
    good = next((p for p in reversed(list_checkpoints(checkpoint_dir(run_dir))) if is_of_run(p, run_id)), None)
    return f"the last good checkpoint is {good}" if good else "no checkpoint was saved yet"
