"""What the long-context evals share: a checkpoint (file or run dir) back as a model, and
per-token losses without a second copy of the model's loss code."""
from __future__ import annotations

import argparse
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
    parser.add_argument("--name", default=None, help="output file stem (default from the run dir)")


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
