"""Weights-only export: `model.safetensors`, loadable on one GPU or a CPU without the optimizer,
the RNGs or pickle.

A finished run writes `<run.dir>/model.safetensors`; `python scripts/export_weights.py CKPT` makes
one from any checkpoint. The file holds every weight once (a tied output head is stored under the
embedding's name only) and, as metadata, the run's resolved config as JSON, which
`training.builders.load_model_for_eval` uses to rebuild the model and tokenizer, and a checksum of
the tensors (the checkpoints' sha256), so that a damaged file is refused, not run (files written
before it load unchecked).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from training.run.files import replacing


def save_weights(state_dict: dict, path: str | Path, config: dict) -> Path:
    """Write the weights atomically (see save_safetensors); tensors sharing storage are kept once."""
    seen, tensors = set(), {}
    for name, tensor in state_dict.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        tensors[name] = tensor.detach().to("cpu").contiguous()
    from training.run.store import state_checksum

    return save_safetensors(tensors, path, {"format": "flashtrain", "config": json.dumps(config),
                                            "checksum": state_checksum(tensors)})


def save_safetensors(tensors: dict, path: str | Path, metadata: dict) -> Path:
    """A safetensors file written atomically (training.run.files.replacing). A failed write (a full
    disk, a read-only folder) leaves no temporary file and raises OSError with the system's reason."""
    from safetensors.torch import save_file

    from training.process.faults import os_error_in

    path = Path(path)
    try:
        with replacing(path) as tmp:
            save_file(tensors, str(tmp), metadata=metadata)
    except Exception as e:
        error = os_error_in(e)
        if error is None:
            raise
        raise OSError(error.errno, f"could not write {path} ({error.strerror or error})") from e
    return path


def read_config(path: str | Path) -> dict:
    """The run config stored in an exported file; ValueError when it is not one of ours."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # noqa: BLE001 (a torn or foreign file: one line naming it)
        raise ValueError(f"weights file {path} is unreadable: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    if meta.get("format") != "flashtrain" or "config" not in meta:
        raise ValueError(f"weights file {path} was not written by flashtrain (no config in its metadata)")
    return json.loads(meta["config"])


def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Load an exported file into `model`: every tensor must be present (tied ones once), and match
    the checksum the file stores."""
    from safetensors import safe_open

    from training.run.store import state_checksum

    with safe_open(str(path), framework="pt") as f:
        stored_checksum = (f.metadata() or {}).get("checksum")
        saved = {name: f.get_tensor(name) for name in f.keys()}
    if stored_checksum is not None and state_checksum(saved) != stored_checksum:
        raise ValueError(f"weights file {path} is corrupt: its tensors do not match the stored checksum {stored_checksum}")
    missing, unexpected = model.load_state_dict(saved, strict=False)
    params = model.state_dict()
    stored = {params[k].data_ptr() for k in saved if k in params}
    missing = [k for k in missing if params[k].data_ptr() not in stored]  # tied to a loaded tensor: fine
    if missing or unexpected:
        raise ValueError(f"weights file {path} does not match the model: "
                         + ", ".join([f"missing {k}" for k in missing] + [f"unexpected {k}" for k in unexpected])[:300])
