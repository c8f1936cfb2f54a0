"""The checkpoint store: one interface over both checkpoint formats, for the loop, the resume
planner (training.run.resume), the evals and the export tools.

    store = CheckpointStore(run_dir)                    # <run.dir>/checkpoints/
    store.list()                                        # oldest step first, either format
    store.lineages()                                    # which run wrote each (cheap), the unreadable apart
    store.latest(run_id)                                # the newest that verifies, with its state
    path, weights = store.save(meta, model, optimizer, plan, weights=True)   # every rank; atomic
    store.prune(keep, run_id)
    state = load_checkpoint(path)                       # any checkpoint: read and verified
    restore = Restore(path, state)                      # put back into a run (training.run.resume)

A checkpoint holds the model, optimizer, step, tokens seen, every RNG state, the data sampler's
position, the resolved config, the wandb run id and the run's lineage (its id, and the
checkpoint it branched from), with the sha256 of all of it. Two formats, chosen by the parallel
plan (`plan.shards_state`), never by the loop:

- one `torch.save` file, `checkpoints/step_00000100.pt`, from rank 0: written to `<name>.tmp`
  (created exclusively: a planted link is never followed), fsynced and renamed, so a crash
  leaves either the old set of files or the new one; a failed write (a full disk, a file-size
  limit) removes the temp file;
- a DCP folder, `checkpoints/step_00000100.dcp/`, that every rank writes its shards into
  (training.run.dcp, private to this module): the same state, the same rules (made visible by one
  rename once complete, every file verified by sha256 against its manifest).

Either loads wherever a checkpoint is read; `resume=auto` takes the newest of either. A file
that fails to load (a disk error, a copy cut short) is skipped with a warning naming it.
Loading uses `weights_only=True`: a checkpoint cannot run code. Pruning and `resume=auto` look
only at the files of one run (the resume planner decides which): another run's checkpoint in
the same folder is never deleted, never counted as kept.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import re
import shutil
from pathlib import Path

import torch
from torch import nn

from training.process.faults import os_error_in
from training.process.rng import set_rng_state
from training.run import dcp
from training.run.files import CHECKPOINTS, RecordingWriter, new_file

log = logging.getLogger(__name__)

FORMAT_VERSION = 3      # 2 added "checksum", 3 "lineage"; older files still load (a version 2 file has no lineage)
READABLE_VERSIONS = (1, 2, 3)
REQUIRED_KEYS = ("step", "tokens", "model", "optimizer", "rng", "sampler", "config",
                 "wandb_id")
_NAME = re.compile(r"^step_(\d+)\.(pt|dcp)$")
_TENSOR_KEYS = ("model", "optimizer")   # in the shards of a sharded checkpoint, not its state.pt
_META_KEYS = tuple(k for k in REQUIRED_KEYS if k not in _TENSOR_KEYS)
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


def lineage_id(state: dict) -> str | None:
    """The id of the run that wrote a checkpoint's state; None for files from before lineages."""
    lineage = state.get("lineage")
    return lineage.get("id") if isinstance(lineage, dict) else None


def step_of(path: Path) -> int:
    """The step in a checkpoint's file name."""
    return int(_NAME.match(Path(path).name).group(1))


def is_sharded(state: dict) -> bool:
    """Whether `state` is a sharded checkpoint's (its model and optimizer are in the DCP shards)."""
    return "model" not in state


# ----------------------------------------------------------------------------- one run's checkpoints

class CheckpointStore:
    """The checkpoints of one run folder, `<run.dir>/checkpoints/`, in either format."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.folder = self.run_dir / CHECKPOINTS

    def path(self, step: int, sharded: bool = False) -> Path:
        """The single file of a step, or (sharded) its DCP folder."""
        return self.folder / f"step_{step:08d}{dcp.SUFFIX if sharded else '.pt'}"

    def list(self) -> list[Path]:
        """The checkpoints here, oldest step first (temp files are not checkpoints)."""
        if not self.folder.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.folder.iterdir() if (m := _NAME.match(p.name))]
        return [p for _, p in sorted(found)]

    def lineages(self) -> tuple[dict[Path, str | None], list[Path]]:
        """({readable checkpoint: the run id it names}, unreadable checkpoints, warned about), oldest
        first. Read without hashing: only the checkpoint a run resumes from is verified in full."""
        readable, unreadable = {}, []
        for path in self.list():
            try:
                readable[path] = peek_lineage(path)
            except CheckpointError as e:
                log.warning("skipping %s", e)
                unreadable.append(path)
        return readable, unreadable

    def latest(self, run_id: str | None = ANY_RUN) -> tuple[Path, dict] | None:
        """The newest checkpoint of run `run_id` that loads, with its state; unreadable ones are
        skipped with a warning, another run's are passed over."""
        for path in reversed(self.list()):
            try:
                state = load_checkpoint(path)
            except CheckpointError as e:
                log.warning("skipping %s", e)
                continue
            if run_id == ANY_RUN or lineage_id(state) == run_id:
                return path, state
        return None

    def note(self, run_id: str | None = ANY_RUN) -> str:
        """Where the last good checkpoint of run `run_id` is, for messages of a run that stopped."""
        good = next((p for p in reversed(self.list()) if is_of_run(p, run_id)), None)
        return f"the last good checkpoint is {good}" if good else "no checkpoint was saved yet"

    def save(self, meta: dict, model: nn.Module, optimizer, plan, weights: bool = False
             ) -> tuple[Path | None, dict | None]:
        """Every rank: checkpoint `meta` (the state but the model and optimizer, its "step"
        naming the file) with the model's and optimizer's state, in the format the parallel plan
        asks for: a DCP folder every rank writes its shards into, or the whole state gathered
        into one file by rank 0. Returns (the checkpoint, and with `weights` the whole model's
        state dict) on rank 0, (None, None) elsewhere; CheckpointWriteError when it could not be
        written (the older checkpoints untouched)."""
        if plan.shards_state:
            path = self.path(meta["step"], sharded=True)
            stamped = _stamped(meta, _META_KEYS) if plan.is_main else None
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                written = dcp.save_sharded(path, stamped, model, optimizer, plan.env)
            except OSError as e:
                raise _write_error(path, e) from e
            if written is None:
                return None, None
            _verified[_file_id(path)] = lineage_id(stamped)
            return path, dcp.consolidate(path, keys=("model",))["model"] if weights else None
        model_sd, optim_sd = plan.full_state(model, optimizer)
        if not plan.is_main:
            return None, None
        path = save_checkpoint(self.path(meta["step"]), {**meta, "model": model_sd, "optimizer": optim_sd})
        return path, model_sd if weights else None

    def prune(self, keep: int, run_id: str | None = ANY_RUN) -> None:
        """Keep the newest `keep` usable checkpoints of run `run_id`; delete its older ones and stale temp files.

        Unusable files are never counted as kept (nor deleted: they are evidence, and `resume=auto`
        skips them with a warning), so the newest usable checkpoint always survives; another run's
        files are neither counted nor deleted. Only the run holding the folder's lock calls this, so a
        `.tmp` here is not another writer's.
        """
        if keep < 1:
            raise ValueError(f"keep={keep}: pruning must keep at least one checkpoint")
        for stale in [*self.folder.glob("*.pt.tmp"), *self.folder.glob(f"*{dcp.SUFFIX}.tmp"),
                      *self.folder.glob(f"*{dcp.SUFFIX}.old")]:
            _remove(stale)
        kept = 0
        for path in reversed(self.list()):
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


# ----------------------------------------------------------------------------- any one checkpoint

def is_checkpoint_folder(path: str | Path) -> bool:
    """Whether `path` names a DCP checkpoint folder (a folder that is itself one checkpoint)."""
    return Path(path).name.endswith(dcp.SUFFIX)


def save_checkpoint(path: str | Path, state: dict) -> Path:
    """Write `state` as one file with its checksum atomically: exclusive temp file, fsync, rename,
    fsync the folder.

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


def peek_lineage(path: Path) -> str | None:
    """The run id a checkpoint names, read without checking its checksum (cheap: its tensors are
    memory-mapped, not read); CheckpointError when it does not load as one of ours."""
    path = Path(path)
    try:
        found = _verified.get(_file_id(path), False)
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} is unreadable: {e.strerror or e}") from e
    return lineage_id(_read(path)) if found is False else found


def is_usable(path: Path) -> bool:
    """Whether the checkpoint loads and matches its checksum (remembered for files seen intact)."""
    try:
        if _verified.get(_file_id(path), False) is False:
            load_checkpoint(path)
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


def _read_sharded(path: Path) -> dict:
    try:
        state = dcp.read_state(path)
    except Exception as e:  # no manifest, a link, a state.pt cut short: all mean unusable
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path} is unusable (incomplete or corrupt): {reason}") from e
    return _checked_structure(path, state, _META_KEYS)


def _read(path: Path) -> dict:
    """A checkpoint's state, structure checked, tensors memory-mapped (not yet read); a sharded
    checkpoint's without its model and optimizer (they stay in the shards)."""
    if is_checkpoint_folder(path):
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


def read_tensors(path: str | Path, state: dict, optimizer: bool = True) -> dict:
    """`state` (load_checkpoint's) with its model's (and, with `optimizer`, the optimizer's)
    tensors, whichever the format: a DCP folder's are read from its shards on this one process (no
    process group), the optimizer indexed by parameter position as `torch.optim` saves it."""
    if not is_sharded(state):
        return state
    return dcp.consolidate(path, keys=_TENSOR_KEYS if optimizer else ("model",))


def describe_differences(saved: dict, current: dict, prefix: str = "model") -> str:
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
            config_diff = describe_differences(state["config"].get("model", {}), current_model_cfg)
            detail += f"; config: {config_diff}" if config_diff else ""
        raise CheckpointError(f"checkpoint {path} does not match the model: {detail}")
    model.load_state_dict(saved)


class Restore:
    """A checkpoint put back into a run, in two halves around the parallel plan's wrapping:
    `into_model` before it (the plain model's weights from a file, the data sampler's position,
    every RNG), `finish` after it (the optimizer's moments, or a DCP folder's weights and moments
    from its shards, which DCP reshards onto this run's ranks). A fresh start's (no checkpoint)
    puts nothing back."""

    def __init__(self, path: Path | None = None, state: dict | None = None):
        self.path, self._state, self._optimizer = path, state, None
        self.step, self.tokens, self.wandb_id = ((state["step"], state["tokens"], state["wandb_id"]) if state
                                                 else (0, 0, None))

    def into_model(self, model: nn.Module, model_cfg: dict, sampler, sampler_state: dict) -> None:
        """The weights into the plain model (a file's; a folder's come in `finish`), `sampler_state`
        into the sampler and the RNGs; the optimizer's moments are held for `finish`, copied out
        of the checkpoint: it is memory-mapped, and the optimizer would keep its tensors (a load
        onto the same device and dtype does not copy), so the file's space would stay in use after
        pruning deletes it, until the process ends."""
        if self._state is None:
            return
        from torch.utils._pytree import tree_map

        state, path = self._state, self.path
        if not is_sharded(state):
            restore_model(model, state, path, model_cfg)
            self._optimizer = tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, state["optimizer"])
        try:
            sampler.load_state_dict(sampler_state)
        except ValueError as e:
            raise CheckpointError(f"checkpoint {path}: {e}") from None
        set_rng_state(state["rng"])
        self._state = {"sharded": is_sharded(state)}   # the tensors are in the model now, or in the shards

    def finish(self, model: nn.Module, optimizer, plan) -> None:
        """Every rank, once the plan has wrapped the model and the optimizer is built over it."""
        if self._state is None:
            return
        if self._state["sharded"]:
            dcp.load_sharded(self.path, model, optimizer)   # DCP reshards onto this run's ranks
        else:
            _check_param_groups(self.path, self._optimizer, optimizer)
            plan.load_optimizer(model, optimizer, self._optimizer)
        self._state = self._optimizer = None


def _check_param_groups(path, saved: dict, optimizer) -> None:
    """Refuse optimizer moments grouped otherwise than this run groups its parameters (which
    tensors are decayed), in one line that says which setting does it."""
    sizes = lambda groups: [len(g["params"]) for g in groups]  # noqa: E731
    if sizes(saved["param_groups"]) != sizes(optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint {path} decays {sizes(saved['param_groups'])[0]} parameter tensors, this run "
            f"{sizes(optimizer.param_groups)[0]}: optim.decay_embeddings differs from the checkpoint's run (runs "
            f"from before that option decayed no embedding table: pass optim.decay_embeddings=false)")
