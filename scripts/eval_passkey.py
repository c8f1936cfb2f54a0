"""Passkey retrieval accuracy of a checkpoint over a grid of prompt lengths x key depths.

    python scripts/eval_passkey.py runs/a --lengths 1024 4096 16384 --depths 0 0.25 0.5 0.75 1 --trials 10

Each trial builds a prompt (data/passkey.py: filler, the key at the given depth, a question)
with the checkpoint's tokenizer and scores it teacher-forced: the trial counts as correct when
the model's most likely next token is right at every position of the key, which is exactly
when greedy decoding would write the key. Writes <out>/passkey_<name>.{json,md,png}.
"""
from __future__ import annotations

import sys

import _common  # noqa: F401  (puts the repo root on sys.path)
import numpy as np
import torch

from _common import (environment, markdown_table, new_figure, print_table, require_positive, run_cli, save_figure,
                     write_json, write_text)
from _eval import add_checkpoint_args, load_for_eval, run_name


@torch.no_grad()
def passkey_correct(model, tokenizer, length: int, depth: float, key: str, device, precision: str) -> bool:
    from data.passkey import passkey_prompt
    from training.process.device import autocast

    prompt, answer = passkey_prompt(length, depth, key, lambda text: len(tokenizer.encode(text)))
    prompt_ids, answer_ids = tokenizer.encode(prompt), tokenizer.encode(answer)
    ids = torch.tensor([prompt_ids + answer_ids], device=device)
    with autocast(device, precision):
        logits = model(ids[:, :-1])
    predicted = logits[0, len(prompt_ids) - 1 :].argmax(-1)
    return bool((predicted == ids[0, len(prompt_ids) :]).all())


MAX_KEY_DIGITS = 18  # keys are drawn as int64


def prompt_lengths(asked: list[int] | None, tokenizer, key_digits: int, cfg) -> list[int]:
    """The lengths to test: each must hold a whole prompt (filler can shrink to nothing, the key
    sentence and question cannot) and fit the model; the default is the powers of two from 256
    (or the shortest prompt) below the run's seq_len, and the seq_len itself."""
    from data.passkey import passkey_prompt

    prompt, answer = passkey_prompt(0, 0.0, "9" * key_digits, lambda text: len(tokenizer.encode(text)))
    shortest = len(tokenizer.encode(prompt)) + len(tokenizer.encode(answer))
    longest = int(cfg.model.max_seq_len)
    if asked is None:
        seq_len = int(cfg.trainer.seq_len)
        lengths = sorted({n for n in (2**k for k in range(31)) if max(256, shortest) <= n < seq_len} | {seq_len})
        if seq_len < shortest:
            raise ValueError(f"the run's trainer.seq_len={seq_len} is shorter than the shortest passkey prompt "
                             f"({shortest} tokens of this tokenizer); pass --lengths")
        return lengths
    for n in asked:
        if n < shortest:
            raise ValueError(f"--lengths {n}: a passkey prompt with a {key_digits}-digit key needs at least "
                             f"{shortest} tokens of this tokenizer")
        if n > longest:
            raise ValueError(f"--lengths {n}: longer than the model's max_seq_len={longest}")
    return asked


def main(argv: list[str]) -> None:
    parser = _common.argument_parser(__doc__)
    add_checkpoint_args(parser)
    parser.add_argument("--lengths", type=int, nargs="+", default=None,
                        help="prompt lengths in tokens (default: powers of two from 256 below the run's seq_len, and the seq_len)")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--key-digits", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    require_positive(args, "lengths", "trials", "key_digits")
    if args.key_digits > MAX_KEY_DIGITS:
        raise ValueError(f"--key-digits {args.key_digits}: at most {MAX_KEY_DIGITS}")
    if any(not 0 <= d <= 1 for d in args.depths):
        raise ValueError(f"--depths {args.depths}: each depth must be in [0, 1]")

    from data.passkey import random_key

    model, cfg, tokenizer, device, path = load_for_eval(args)
    lengths = prompt_lengths(args.lengths, tokenizer, args.key_digits, cfg)
    rng = np.random.default_rng(args.seed)
    accuracy = np.zeros((len(args.depths), len(lengths)))
    for j, length in enumerate(lengths):
        for i, depth in enumerate(args.depths):
            keys = [random_key(rng, args.key_digits) for _ in range(args.trials)]
            hits = [passkey_correct(model, tokenizer, length, depth, k, device, cfg.trainer.precision) for k in keys]
            accuracy[i, j] = np.mean(hits)

    name = run_name(args, path)
    headers = ["depth \\ length", *(f"{n:,}" for n in lengths)]
    rows = [(f"{d:g}", *(f"{a:.2f}" for a in accuracy[i])) for i, d in enumerate(args.depths)]
    print_table(f"passkey accuracy: {name}", headers, rows)
    stem = args.out_dir / f"passkey_{name}"
    write_json(stem.with_suffix(".json"), {
        "checkpoint": str(path), "lengths": lengths, "depths": args.depths, "trials": args.trials,
        "key_digits": args.key_digits, "seed": args.seed, "accuracy": accuracy.tolist(),
        "tokenizer": tokenizer.fingerprint, "attention": cfg.attention.name, "model": cfg.model.name,
        "environment": environment(device),
    })
    write_text(stem.with_suffix(".md"), f"Passkey accuracy, {name}, {args.trials} trials per cell\n\n"
               + markdown_table(headers, rows))
    fig, axes = new_figure(figsize=(1.2 * len(lengths) + 2, 0.6 * len(args.depths) + 1.5))
    ax = axes[0][0]
    image = ax.imshow(accuracy, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [f"{n:,}" for n in lengths])
    ax.set_yticks(range(len(args.depths)), [f"{d:g}" for d in args.depths])
    for (i, j), a in np.ndenumerate(accuracy):
        ax.text(j, i, f"{a:.1f}", ha="center", va="center", fontsize=8)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("key depth")
    ax.set_title(f"{name}: passkey retrieval ({cfg.model.name})", fontsize=9)
    fig.colorbar(image, ax=ax, label="accuracy")
    save_figure(fig, stem.with_suffix(".png"))
    print(f"wrote {stem}.{{json,md,png}}")


if __name__ == "__main__":
    run_cli(main)
