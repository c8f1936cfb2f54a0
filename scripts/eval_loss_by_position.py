"""Mean validation loss per token-position bucket over long windows: does the model use far context?

    python scripts/eval_loss_by_position.py runs/a                        # its newest checkpoint
    python scripts/eval_loss_by_position.py runs/a/checkpoints/step_00000500.pt --seq-len 16384 --buckets 16
    python scripts/eval_loss_by_position.py runs/a --document-mask      # each token sees only its document
    python scripts/eval_loss_by_position.py runs/b --bucket-tokens 1024 --beside outputs/eval/loss_by_position_a.json

Windows come from the checkpoint's own data config (held-out documents, the same builders as
training) at --seq-len (default: the training length). A loss that keeps falling with position
means later tokens are predicted better thanks to earlier ones. --document-mask /
--no-document-mask (default: what the run trained with, data.document_mask) evaluates with or
without the document mask: with it, a token's context is only its own document's earlier tokens.
Buckets are --buckets equal parts of the window, or --bucket-tokens positions each (the last one
shorter where the window is not a multiple). --beside RESULT.json draws an earlier result of this
tool (another run's curve, over its own window length) on the same axes and in the same table; it
must have read the same held-out tokens (the results' `validation` digest: data.build.DataBundle),
which runs on `data=stdlib-passkey` with other passkey documents do.
Writes <out>/loss_by_position_<name>.{json,md,png} (<name>_docmask with the mask).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import _common  # noqa: F401  (puts the repo root on sys.path)
import numpy as np

from _common import (environment, markdown_table, new_figure, print_table, require_positive, run_cli, save_figure,
                     write_json, write_text)
from _eval import add_beside_argument, add_checkpoint_args, load_for_eval, read_beside, run_name, token_losses


def bucket_means(position_loss: np.ndarray, n_buckets: int | None = None, width: int | None = None) -> list[dict]:
    """Buckets over positions 0..T-1 of a (T,) mean-loss curve: `n_buckets` equal ones, or runs of
    `width` positions (the last one what is left)."""
    T = len(position_loss)
    edges = np.unique(np.r_[np.arange(0, T, width), T]) if width else np.linspace(0, T, n_buckets + 1).round().astype(int)
    return [{"start": int(a), "end": int(b), "loss": float(position_loss[a:b].mean())}
            for a, b in zip(edges[:-1], edges[1:]) if b > a]


def loss_table(results: list[dict]) -> tuple[list[str], list[list[str]]]:
    """One row per bucket of any of the results (by start, end), one column per result: '-' where
    a result has no such bucket (past its window)."""
    spans = sorted({(b["start"], b["end"]) for r in results for b in r["buckets"]})
    losses = [{(b["start"], b["end"]): b["loss"] for b in r["buckets"]} for r in results]
    rows = [[f"[{a:,}, {b:,})", *(f"{loss[(a, b)]:.4f}" if (a, b) in loss else "-" for loss in losses)]
            for a, b in spans]
    return ["positions", *(f"{r['name']} ({r['attention']}, trained at {r['trained_seq_len']:,})" for r in results)], rows


def main(argv: list[str]) -> None:
    parser = _common.argument_parser(__doc__)
    add_checkpoint_args(parser)
    parser.add_argument("--seq-len", type=int, default=None, help="window length (default: the run's trainer.seq_len)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--batches", type=int, default=8)
    buckets = parser.add_mutually_exclusive_group()   # one way to cut the window: both given, one was ignored
    buckets.add_argument("--buckets", type=int, default=None, help="equal parts of the window (default 16)")
    buckets.add_argument("--bucket-tokens", type=int, default=None,
                         help="positions per bucket instead of --buckets equal parts (e.g. 1024 for two runs of other lengths)")
    parser.add_argument("--document-mask", action=argparse.BooleanOptionalAction, default=None,
                        help="attend only within each document (default: the run's data.document_mask)")
    add_beside_argument(parser, "loss-by-position curve")
    args = parser.parse_args(argv)
    require_positive(args, "seq_len", "batch_size", "batches", "buckets", "bucket_tokens")
    if args.buckets is None and args.bucket_tokens is None:
        args.buckets = 16
    beside = read_beside(args.beside, "eval_loss_by_position.py", ("buckets", "validation", "attention", "trained_seq_len"))

    from training.builders import build_data

    model, cfg, _, device, path = load_for_eval(args)
    seq_len = args.seq_len or int(cfg.trainer.seq_len)
    if (args.bucket_tokens or 0) > seq_len or (args.bucket_tokens is None and args.buckets > seq_len):
        flag = f"--bucket-tokens {args.bucket_tokens}" if args.bucket_tokens else f"--buckets {args.buckets}"
        raise ValueError(f"{flag}: more than the {seq_len} positions of a window")
    mask = bool(cfg.data.get("document_mask", False)) if args.document_mask is None else args.document_mask
    bundle = build_data(cfg, seq_len=seq_len, seed=cfg.seed,
                        seq_len_from="--seq-len" if args.seq_len else "--seq-len (default: the run's trainer.seq_len)")
    digest = bundle.validation_digest()
    if beside is not None and beside["validation"] != digest:
        raise ValueError(f"--beside {args.beside}: {beside['name']} was evaluated on other held-out tokens "
                         f"(validation {beside['validation']}, this run's {digest}: another corpus, split or "
                         f"tokenizer), so the curves would not compare")
    total = np.zeros(seq_len)
    for x, y, *doc_ids in bundle.val_batches(args.batch_size, args.batches, return_doc_ids=mask):
        total += token_losses(model, x, y, device, cfg.trainer.precision, *doc_ids).sum(0).numpy()
    position_loss = total / (args.batch_size * args.batches)
    buckets = bucket_means(position_loss, args.buckets, args.bucket_tokens)

    name = run_name(args, path) + ("_docmask" if mask and not args.name else "")
    result = {
        "name": name, "checkpoint": str(path), "data": bundle.fingerprint, "validation": digest, "seq_len": seq_len,
        "trained_seq_len": int(cfg.trainer.seq_len), "windows": args.batch_size * args.batches,
        "attention": cfg.attention.name, "precision": cfg.trainer.precision, "model": cfg.model.name,
        "document_mask": mask, "buckets": buckets, "environment": environment(device),
    }
    if beside is not None:
        result["beside"] = beside
    curves = [result] + ([beside] if beside is not None else [])
    headers, rows = loss_table(curves)
    print_table(f"loss by position: {name} ({bundle.fingerprint})", headers, rows)
    stem = args.out_dir / f"loss_by_position_{name}"
    write_json(stem.with_suffix(".json"), result)
    windows = "; ".join(f"{r['name']}: {r['windows']} windows of {r['seq_len']:,} tokens" for r in curves)
    write_text(stem.with_suffix(".md"), f"Loss by position, {name}, {bundle.fingerprint} (held-out tokens {digest}), "
               f"{windows}, {'with' if mask else 'without'} the document mask\n\n" + markdown_table(headers, rows))
    plot_curves(result, stem.with_suffix(".png"))
    print(f"wrote {stem}.{{json,md,png}}")


def plot_curves(result: dict, path: Path) -> None:
    """A result's curve and the one beside it (if any) on one axes, from the result alone."""
    curves = [result] + ([result["beside"]] if result.get("beside") else [])
    headers, _ = loss_table(curves)
    fig, axes = new_figure(figsize=(7, 4))
    ax = axes[0][0]
    for curve, label in zip(curves, headers[1:]):
        ax.plot([(b["start"] + b["end"] - 1) / 2 for b in curve["buckets"]], [b["loss"] for b in curve["buckets"]],
                marker="o", ms=3, label=label)
    ax.set_xlabel("token position in window")
    ax.set_ylabel("mean validation loss (nats)")
    ax.set_title(f"loss by position ({result['model']}, {result['data'].split('/')[0]})", fontsize=9)
    ax.grid(alpha=0.3)
    # below the axes: inside, it hid the end of a short curve drawn beside a long one
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    save_figure(fig, path)


if __name__ == "__main__":
    run_cli(main)
