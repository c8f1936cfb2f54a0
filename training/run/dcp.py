"""Sharded checkpoints of `trainer.parallel=fsdp`: `torch.distributed.checkpoint` (DCP) folders,
the checkpoint store's second format (training.run.store is the one module that uses this).

    checkpoints/step_00000100.dcp/
        .metadata          DCP's index of every tensor's shards (written last by DCP, on rank 0)
        __<rank>_0.distcp  each rank's own shards of the model and AdamW moments, written in parallel
        state.pt           everything else a single-file checkpoint holds (step, tokens, RNGs, sampler
                           position, config, wandb id, lineage), from rank 0
        manifest.json      size and sha256 of every file above, written after them

Every rank writes its shards into `step_XXXXXXXX.dcp.tmp/`; once DCP's save returns (its metadata
is complete), each rank hashes a share of the shard files, rank 0 writes `state.pt` and the
manifest, fsyncs and renames the folder to its final name: only then is it a checkpoint. A crash
before the rename leaves a `.tmp` folder that nothing loads and the next save's pruning removes,
so the previous checkpoint stays the one `resume=auto` uses. On load, every file is checked
against the manifest (sizes, sha256): the single-file format's rules (verification, lineage,
pruning of this run's files only, no links followed) hold for the folder as a whole.

The model and optimizer tensors are addressed by parameter name and global shape, so a folder
saved by N ranks loads into M ranks (FSDP2 or DDP) or one process: DCP reshards on load. The
data position is the sampler's global one, as in the single-file format. `consolidate` turns a
folder into the single-file state on one process (evals, `scripts/export_weights.py`).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from training.parallel.data_parallel import optimizer_by_index
from training.run.files import fsync_dir, new_file, temp_path

MANIFEST = "manifest.json"
STATE_FILE = "state.pt"
SUFFIX = ".dcp"
_TENSOR_KEYS = ("model", "optimizer")   # in the DCP shards; every other key is in state.pt


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return "sha256:" + h.hexdigest()


def _describe(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def _fresh_temp_dir(tmp: Path) -> None:
    """An empty temp folder, created here: a leftover of a crashed save is removed, a link refused."""
    if tmp.is_symlink():
        tmp.unlink()  # a planted link: removed, never followed
    elif tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)


def save_sharded(path: str | Path, meta: dict, model: nn.Module, optimizer, env) -> Path | None:
    """Every rank: write its shards of `model` and `optimizer` under `path`, rank 0 the rest of
    the state (`meta`, already holding its format version and checksum) and the manifest, then
    the atomic rename. Returns the folder on rank 0 (None elsewhere)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from training.parallel.distributed import barrier

    path = Path(path)
    tmp = temp_path(path)   # step_X.dcp.tmp/
    if env.is_main:
        _fresh_temp_dir(tmp)
    barrier(env)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
    barrier(env)   # DCP's .metadata is on disk: every shard is complete
    shards = sorted(p.name for p in tmp.iterdir())
    mine = {name: _describe(tmp / name) for name in shards[env.rank::env.world_size]}
    hashed = [None] * env.world_size
    if env.enabled:
        dist.all_gather_object(hashed, mine, group=env.control)
    else:
        hashed = [mine]
    if not env.is_main:
        barrier(env)
        return None
    with new_file(tmp / STATE_FILE) as f:
        torch.save(meta, f)
    files = {name: d for part in hashed for name, d in part.items()}
    files[STATE_FILE] = _describe(tmp / STATE_FILE)
    with new_file(tmp / MANIFEST, "w") as f:
        json.dump({"format": "flashtrain-dcp", "files": dict(sorted(files.items()))}, f, indent=1)
    fsync_dir(tmp)
    _publish(tmp, path)
    barrier(env)
    return path


def _publish(tmp: Path, path: Path) -> None:
    """Make the complete folder visible under its name in one rename (an older folder of the same
    step, from a run that went on past it, is replaced only once the new one is whole)."""
    old = path.with_name(path.name + ".old")
    if path.exists() and not path.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    elif path.is_symlink():
        path.unlink()
    os.rename(tmp, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def read_manifest(path: Path) -> dict:
    """The manifest's files; ValueError naming the problem when the folder is not a whole checkpoint."""
    manifest = path / MANIFEST
    if path.is_symlink() or not path.is_dir():
        raise ValueError("not a checkpoint folder" if not path.is_symlink() else "a symbolic link, never followed")
    if not manifest.is_file() or manifest.is_symlink():
        raise ValueError(f"no {MANIFEST} (an incomplete save)")
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{MANIFEST} is unreadable ({type(e).__name__})") from None
    if STATE_FILE not in files or ".metadata" not in files:
        raise ValueError(f"{MANIFEST} lists no {STATE_FILE} or DCP .metadata (an incomplete save)")
    return files


def read_state(path: Path) -> dict:
    """state.pt of a folder, not yet verified against the manifest (cheap: for lineage peeks)."""
    read_manifest(path)
    return torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)


def verify(path: Path) -> None:
    """ValueError naming the first file that is missing, a link, or differs from the manifest."""
    for name, expected in read_manifest(path).items():
        file = path / name
        if file.is_symlink() or not file.is_file():
            raise ValueError(f"{name} is missing")
        if file.stat().st_size != expected["size"] or _sha256(file) != expected["sha256"]:
            raise ValueError(f"{name} does not match its sha256 in {MANIFEST}")


def load_sharded(path: str | Path, model: nn.Module, optimizer) -> None:
    """Every rank: load the folder's model and optimizer into this run's (sharded or not) model
    and optimizer; DCP reads each rank's part of every tensor, whatever the saving ranks were."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def consolidate(path: str | Path, keys: tuple[str, ...] = _TENSOR_KEYS) -> dict:
    """The single-file state of a folder on one process (no process group): whole tensors, the
    optimizer indexed by parameter position as `torch.optim` saves it. `keys=("model",)` reads
    the weights only."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = Path(path)
    tensors: dict = {}   # filled from DCP's metadata, as its own dcp_to_torch_save does
    _load_state_dict(tensors, storage_reader=dcp.FileSystemReader(str(path)),
                     planner=_EmptyStateDictLoadPlanner(keys=set(keys)), no_dist=True)
    state = read_state(path)
    state["model"] = tensors["model"]
    if "optimizer" in keys:
        state["optimizer"] = optimizer_by_index(tensors["optimizer"])
    return state
