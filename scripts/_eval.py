"""What the long-context evals share: a checkpoint (file or run dir) back as a model, per-token
losses without a second copy of the model's loss code, an earlier result to draw beside this one,
and a memory meter for each forward."""
from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import _common  # noqa: F401  (puts the repo root on sys.path)
import torch
import torch.nn.functional as F

LOSS_CHUNK = 2048   # positions per float32 cross-entropy slice (bounds the upcast copy of the logits)


def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=_common.existing_path,
                        help="a checkpoint file, or a run dir (its newest checkpoint)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--attention", default=None, help="naive | sdpa | flash (default: auto for the device)")
    _common.add_out_argument(parser, "eval", dest="out_dir")   # loss_by_position_<name>, passkey_<name>, ...
    parser.add_argument("--name", type=_common.file_stem, default=None, help="output file stem (default from the run dir)")


def load_for_eval(args: argparse.Namespace):
    """(model, cfg, tokenizer, device, checkpoint path) for the parsed checkpoint arguments."""
    from training.builders import load_model_for_eval
    from training.run.resume import checkpoint_to_load

    path = checkpoint_to_load(args.checkpoint)[0] if args.checkpoint.is_dir() else args.checkpoint
    model, cfg, tokenizer = load_model_for_eval(path, device=args.device, attention=args.attention)
    return model, cfg, tokenizer, next(model.parameters()).device, path


def run_name(args: argparse.Namespace, path: Path) -> str:
    return args.name or path.parent.parent.name or "run"


@torch.no_grad()
def token_losses(model, x: torch.Tensor, y: torch.Tensor, device: torch.device, precision: str,
                 document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of every position, (B, T) float32 on the CPU; with document_ids (B, T) each
    token sees only its own document (the model's document mask)."""
    from training.process.device import autocast

    masks = {} if document_ids is None else {"document_ids": document_ids.to(device)}
    with autocast(device, precision):
        logits = model(x.to(device), **masks)
    y = y.to(device)
    out = torch.empty(y.shape, dtype=torch.float32)
    for s in range(0, y.shape[1], LOSS_CHUNK):
        chunk = logits[:, s : s + LOSS_CHUNK].float()
        out[:, s : s + LOSS_CHUNK] = F.cross_entropy(chunk.transpose(1, 2), y[:, s : s + LOSS_CHUNK], reduction="none").cpu()
    return out


def add_beside_argument(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--beside", type=_common.existing_file("--beside"), default=None, metavar="RESULT.json",
                        help=f"an earlier {what} of this tool (another run's) to show beside this one")


def read_beside(path: Path | None, tool: str, keys: tuple[str, ...]) -> dict | None:
    """The JSON an earlier run of `tool` wrote (its own `beside` left out), or None; a file that
    is not one is a one-line ValueError before any work."""
    if path is None:
        return None
    try:
        result = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"--beside {path}: not JSON ({exc})") from None
    missing = [k for k in ("name", *keys) if not isinstance(result, dict) or k not in result]
    if missing:
        raise ValueError(f"--beside {path}: not a result of {tool} (it has no {', '.join(missing)})")
    result.pop("beside", None)
    return result


@contextlib.contextmanager
def _no_meter():
    yield argparse.Namespace(peak=None)


def memory_meter(args: argparse.Namespace, model, device: torch.device):
    """A factory of context managers that measure one forward's peak memory (`.peak`, bytes, the
    weights included): the CUDA allocator's; on a CPU, with --memory-budget-mb, the live tensors
    counted against that budget (a forward past it raises torch.OutOfMemoryError as a GPU would);
    on a CPU without one, nothing is measured (peak None)."""
    from _memory import allocated_bytes, peak_meter

    budget = getattr(args, "memory_budget_mb", None)
    if device.type == "cuda":
        if budget is not None:
            raise ValueError("--memory-budget-mb is for a CPU run: on a GPU the device's own memory is the limit")
        return lambda: peak_meter(device)
    if budget is None:
        return _no_meter
    weights = allocated_bytes(device, [*model.parameters(), *model.buffers()])
    return lambda: peak_meter(device, weights, int(budget * 2**20))
