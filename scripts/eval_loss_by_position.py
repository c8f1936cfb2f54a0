"""Mean validation loss per token-position bucket over long windows: does the model use far context?

    python scripts/eval_loss_by_position.py runs/a                        # its newest checkpoint
    python scripts/eval_loss_by_position.py runs/a/checkpoints/step_00000500.pt --seq-len 16384 --buckets 16
    python scripts/eval_loss_by_position.py runs/a --document-mask      # each token sees only its document

Windows come from the checkpoint's own data config (held-out documents, the same builders as
training) at --seq-len (default: the training length). A loss that keeps falling with position
means later tokens are predicted better thanks to earlier ones. --document-mask /
--no-document-mask (default: what the run trained with, data.document_mask) evaluates with or
without the document mask: with it, a token's context is only its own document's earlier tokens.
Writes <out>/loss_by_position_<name>.{json,md,png} (<name>_docmask with the mask).
"""
from __future__ import annotations

import argparse
import sys

import _common  # noqa: F401  (puts the repo root on sys.path)
import numpy as np

from _common import (environment, markdown_table, new_figure, print_table, require_positive, run_cli, save_figure,
                     write_json, write_text)
from _eval import add_checkpoint_args, load_for_eval, run_name, token_losses


def bucket_means(position_loss: np.ndarray, n_buckets: int) -> list[dict]:
    """Equal-width buckets over positions 0..T-1 of a (T,) mean-loss curve."""
    edges = np.linspace(0, len(position_loss), n_buckets + 1).round().astype(int)
    return [{"start": int(a), "end": int(b), "loss": float(position_loss[a:b].mean())}
            for a, b in zip(edges[:-1], edges[1:]) if b > a]


def main(argv: list[str]) -> None:
    parser = _common.argument_parser(__doc__)
    add_checkpoint_args(parser)
    parser.add_argument("--seq-len", type=int, default=None, help="window length (default: the run's trainer.seq_len)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--buckets", type=int, default=16)
    parser.add_argument("--document-mask", action=argparse.BooleanOptionalAction, default=None,
                        help="attend only within each document (default: the run's data.document_mask)")
    args = parser.parse_args(argv)
    require_positive(args, "seq_len", "batch_size", "batches", "buckets")

    from training.builders import build_data

    model, cfg, _, device, path = load_for_eval(args)
    seq_len = args.seq_len or int(cfg.trainer.seq_len)
    if args.buckets > seq_len:
        raise ValueError(f"--buckets {args.buckets}: more buckets than the {seq_len} positions of a window")
    mask = bool(cfg.data.get("document_mask", False)) if args.document_mask is None else args.document_mask
    bundle = build_data(cfg, seq_len=seq_len, seed=cfg.seed)
    total = np.zeros(seq_len)
    for x, y, *doc_ids in bundle.val_batches(args.batch_size, args.batches, return_doc_ids=mask):
        total += token_losses(model, x, y, device, cfg.trainer.precision, *doc_ids).sum(0).numpy()
    position_loss = total / (args.batch_size * args.batches)
    buckets = bucket_means(position_loss, args.buckets)

    name = run_name(args, path) + ("_docmask" if mask and not args.name else "")
    rows = [(f"[{b['start']:,}, {b['end']:,})", f"{b['loss']:.4f}") for b in buckets]
    print_table(f"loss by position: {name} ({bundle.fingerprint})", ["positions", "mean loss"], rows)
    stem = args.out_dir / f"loss_by_position_{name}"
    write_json(stem.with_suffix(".json"), {
        "checkpoint": str(path), "data": bundle.fingerprint, "seq_len": seq_len,
        "windows": args.batch_size * args.batches, "attention": cfg.attention.name, "precision": cfg.trainer.precision,
        "model": cfg.model.name, "document_mask": mask, "buckets": buckets, "environment": environment(device),
    })
    write_text(stem.with_suffix(".md"), f"Loss by position, {name}, {bundle.fingerprint}, "
               f"{args.batch_size * args.batches} windows of {seq_len:,} tokens, "
               f"{'with' if mask else 'without'} the document mask\n\n"
               + markdown_table(["positions", "mean loss"], rows))
    fig, axes = new_figure(figsize=(7, 4))
    ax = axes[0][0]
    ax.plot([(b["start"] + b["end"] - 1) / 2 for b in buckets], [b["loss"] for b in buckets], marker="o")
    ax.set_xlabel("token position in window")
    ax.set_ylabel("mean validation loss (nats)")
    ax.set_title(f"{name}: loss by position ({cfg.model.name}, {bundle.fingerprint.split('/')[0]})", fontsize=9)
    ax.grid(alpha=0.3)
    save_figure(fig, stem.with_suffix(".png"))
    print(f"wrote {stem}.{{json,md,png}}")


if __name__ == "__main__":
    run_cli(main)
