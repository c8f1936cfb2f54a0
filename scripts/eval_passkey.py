"""Passkey retrieval accuracy of a checkpoint over a grid of prompt lengths x key depths.

    python scripts/eval_passkey.py runs/a --lengths 1024 4096 16384 --depths 0 0.25 0.5 0.75 1 --trials 10
    python scripts/eval_passkey.py runs/b --attention naive --beside outputs/eval/passkey_a.json

Each trial builds a prompt (data/passkey.py: filler, the key at the given depth, a question)
with the checkpoint's tokenizer and scores it teacher-forced: the trial counts as correct when
the model's most likely next token is right at every position of the key, which is exactly
when greedy decoding would write the key. Writes <out>/passkey_<name>.{json,md,png}. The JSON also
keeps each cell's share of answer tokens ranked first and every wrong answer beside its key, and the
Markdown counts the wrong answers by kind: a copy of the key garbled in one digit or in more, or no
number of the key's length at all (a near miss and a failed retrieval fail a cell alike), and where the
one-digit slips' wrong digit came from (the key's neighbouring digit, another of its digits, or none of
them, beside chance: a copy landing one token off, or noise), and pools the cells by the key's distance
from the question ((1 - depth) x length) in bands that double. Last, the wrong answers in all with
their 95% interval, and how many cells would fall under 0.95 by chance alone at that rate.

A length the model cannot take is a "does not fit" cell, never a zero: one whose sequence is
longer than the model's model.max_seq_len, or one whose forward pass runs out of memory (on a GPU,
the device's; on a CPU only under --memory-budget-mb, which counts the live tensors of each
forward against that many MiB in all, as scripts/max_context.py does). The JSON then has null
accuracy and the reason; for each length that fitted, the forward's peak memory (on a GPU, or
under a CPU budget). Lengths past the run's trainer.seq_len are marked in the table and the plot.
The JSON is rewritten after each length: a run stopped part-way keeps what it measured (the
lengths it did not reach are "not run").
--precision fp32 runs the forwards in float32 instead of the run's trainer.precision (bf16 on a GPU):
a wrong answer that fp32 gets right was decided by a margin smaller than bf16's rounding.
--beside RESULT.json puts an earlier result of this tool (another run's grid: flash's beside
naive's) in the heatmap as a panel to the left of this run's and in the Markdown as a second table.
"""
from __future__ import annotations

import math

import _common  # noqa: F401  (puts the repo root on sys.path)
import numpy as np

from _common import (environment, human_bytes, markdown_table, new_figure, print_table, require_positive, run_cli,
                     save_figure, write_json, write_text)
from _eval import add_beside_argument, add_checkpoint_args, load_for_eval, memory_meter, read_beside, run_name
from _memory import is_oom, release_memory
from training.config.schema import MAX_KEY_DIGITS
from training.loop.evaluate import answer_predictions, passkey_ids, shortest_passkey_prompt


DOES_NOT_FIT = "does not fit"
NOT_RUN = "not run"


def prompt_lengths(asked: list[int] | None, tokenizer, key_digits: int, cfg) -> list[int]:
    """The lengths to test: each must hold a whole prompt (filler can shrink to nothing, the key
    sentence and question cannot); the default is the powers of two from 256 (or the shortest
    prompt) below the run's seq_len, and the seq_len itself."""
    shortest = shortest_passkey_prompt(tokenizer, key_digits)
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
    return asked


def length_column(model, trials: list[tuple[list[int], list[int]]], meter, device, precision: str,
                  max_seq_len: int) -> tuple[list[list[int]] | None, str | None, int | None]:
    """(each trial's teacher-forced predictions of its answer tokens, None, peak bytes) for one
    length, or (None, why, None) when the length does not fit: a sequence past model.max_seq_len, or
    a forward that ran out of memory (the column stops at the first; memory does not depend on where
    the key sits)."""
    longest = max(len(p) + len(a) - 1 for p, a in trials)
    if longest > max_seq_len:
        return None, f"{longest:,} tokens exceed model.max_seq_len={max_seq_len:,}", None
    predictions, peak, why = [], None, None
    for ids in trials:
        try:
            with meter() as m:
                predictions.append(answer_predictions(model, ids, device, precision))
            peak = max(peak or 0, m.peak) if m.peak is not None else peak
        except Exception as exc:  # noqa: BLE001 (only running out of memory is a result; the rest re-raised)
            if not is_oom(exc):
                raise
            why = f"out of memory on the {_common.device_name(device)}" if device.type == "cuda" else \
                "out of memory under --memory-budget-mb"
        if why is not None:
            break
    release_memory(device)   # the exception, and the tensors its frames held, are gone by now
    return (None, why, None) if why else (predictions, None, peak)


MISS_KINDS = ("one digit wrong", "several digits wrong", "not the key's length of digits")


def miss_kind(key: str, predicted: str) -> str:
    """What a wrong answer was (one of MISS_KINDS): a number of the key's length off in one digit or
    in more (the copy found a key but garbled it), or no such number at all. `predicted` is the
    teacher-forced best token at each answer position, decoded."""
    text = predicted.strip()
    if len(text) == len(key) and text.isdigit():
        return MISS_KINDS[0] if sum(a != b for a, b in zip(text, key)) == 1 else MISS_KINDS[1]
    return MISS_KINDS[2]


# Where a one-digit slip's wrong digit came from, told in this order: the key's digit just before the
# slipped one, the one just after it, another of the key's digits, or a digit the key does not hold.
SLIP_SOURCES = ("the digit before", "the digit after", "another digit of the key", "not in the key")


def slip_source(key: str, predicted: str) -> tuple[str, list[float]]:
    """Where a one-digit-wrong answer's wrong digit came from (one of SLIP_SOURCES), and each source's
    chance for a wrong digit drawn at random from the other nine: the yardstick that tells a copy
    landing one token off (the first two far above chance) from noise in one digit."""
    said = predicted.strip()
    i = next(k for k, (a, b) in enumerate(zip(said, key)) if a != b)

    def source(digit: str) -> str:
        if i > 0 and key[i - 1] == digit:
            return SLIP_SOURCES[0]
        if i + 1 < len(key) and key[i + 1] == digit:
            return SLIP_SOURCES[1]
        return SLIP_SOURCES[2] if digit in key else SLIP_SOURCES[3]

    others = [d for d in "0123456789" if d != key[i]]
    return source(said[i]), [sum(source(d) == s for d in others) / len(others) for s in SLIP_SOURCES]


def record_length(result: dict, j: int, keys: list[tuple[int, str]], trials, predictions, tokenizer) -> None:
    """One length's cells into `result`: accuracy (every answer token ranked first), the share of
    answer tokens ranked first (partial copies show there), and each wrong trial with what it said.
    keys[t] is trial t's (depth row, key)."""
    for i in range(len(result["depths"])):
        rows = [(answer, predicted) for (row, _), (_, answer), predicted in zip(keys, trials, predictions) if row == i]
        result["accuracy"][i][j] = float(np.mean([predicted == answer for answer, predicted in rows]))
        result["answer_tokens_right"][i][j] = float(np.mean([np.mean([a == b for a, b in zip(answer, predicted)])
                                                             for answer, predicted in rows]))
    for (i, key), (_, answer), predicted in zip(keys, trials, predictions):
        if predicted != answer:
            said = tokenizer.decode(predicted)
            miss = {"length": result["lengths"][j], "depth": result["depths"][i], "key": key, "predicted": said,
                    "kind": miss_kind(key, said)}
            if miss["kind"] == MISS_KINDS[0]:
                miss["slip"] = slip_source(key, said)[0]
            result["misses"].append(miss)


def misses_markdown(result: dict) -> str:
    """How the wrong answers went wrong, per measured length: a garbled copy of the key, or none."""
    if "misses" not in result:   # a result from before the misses were kept
        return ""
    rows = []
    for j, n in enumerate(result["lengths"]):
        if result["accuracy"][0][j] is None:
            continue
        here = [m for m in result["misses"] if m["length"] == n]
        example = next((f"{m['key']} -> {m['predicted'].strip()!r}" for m in here), "-")
        rows.append((f"{n:,}", f"{len(here)} of {len(result['depths']) * result['trials']}",
                     *(str(sum(m["kind"] == kind for m in here)) for kind in MISS_KINDS), example))
    return ("\n\nThe wrong answers (the answer token the model ranks first at each position, teacher-forced, "
            "decoded):\n\n" + markdown_table(["length", "wrong", *MISS_KINDS, "e.g. key -> said"], rows)
            + slips_markdown(result["misses"]))


def slips_markdown(misses: list[dict]) -> str:
    """The grid's one-digit slips pooled by where the wrong digit came from, each beside what wrong
    digits drawn at random would give (computed from each miss's key and answer, so a result from
    before the slips were recorded reads the same)."""
    slips = [slip_source(m["key"], m["predicted"]) for m in misses if m["kind"] == MISS_KINDS[0]]
    if not slips:
        return ""
    counts = [f"{name} {sum(s == name for s, _ in slips)} ({sum(c[k] for _, c in slips):.1f})"
              for k, name in enumerate(SLIP_SOURCES)]
    return (f"\n\nThe {len(slips)} one-digit slips by where the wrong digit came from (in brackets, what as many "
            f"wrong digits drawn at random from the other nine would give): {', '.join(counts)}.")


TARGET = 0.95   # a cell meets the bar at this accuracy or more (the long-context recipe's target)


def wilson_interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of the proportion k / n (sound near 0 and 1, unlike p +- z se)."""
    p, z2 = k / n, z * z
    centre, half = p + z2 / (2 * n), z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return (centre - half) / (1 + z2 / n), (centre + half) / (1 + z2 / n)


def chance_under_target(rate: float, trials: int, target: float = TARGET) -> float:
    """The chance that a cell of `trials` prompts scores under `target` when every prompt is wrong
    with probability `rate`, independently: more than (1 - target) trials wrong."""
    allowed = math.floor((1 - target) * trials + 1e-9)
    return 1 - sum(math.comb(trials, k) * rate ** k * (1 - rate) ** (trials - k) for k in range(allowed + 1))


def rate_markdown(result: dict) -> str:
    """The grid's wrong answers in all, with their interval, and how many cells would fall under
    TARGET by chance alone at that rate: whether a recipe's failing cells are a few unlucky ones
    or a rate too high (from the cells' accuracies, so older results read the same way)."""
    cells = [a for row in result["accuracy"] for a in row if a is not None]
    if not cells:
        return ""
    n = len(cells) * result["trials"]
    wrong = round(sum((1 - a) * result["trials"] for a in cells))
    low, high = wilson_interval(wrong, n)
    under = sum(a < TARGET - 1e-9 for a in cells)
    chance = chance_under_target(wrong / n, result["trials"])
    return (f"\n\nIn all, {wrong:,} wrong of {n:,} ({wrong / n:.1%}, 95% interval {low:.1%}-{high:.1%}). "
            f"{under} of {len(cells)} cells are under {TARGET}; with every prompt wrong at that rate, "
            f"independently, {len(cells) * chance:.1f} would be ({chance:.1%} of cells of {result['trials']}).\n")


def by_distance(result: dict) -> list[dict]:
    """The measured cells pooled by how far back the key is, (1 - depth) x length tokens, in bands
    that double from half the shortest length ([0, n/2), [n/2, n), ... up to the longest length,
    the last band closed): a grid read by distance rather than by cell, where reaching back is what
    fails. Each band: its bounds, its cells and their mean accuracy (None where no cell fell in it)."""
    cells = [((1 - d) * n, a) for d, row in zip(result["depths"], result["accuracy"])
             for n, a in zip(result["lengths"], row) if a is not None]
    if not cells:
        return []
    edges = [0, 1 << max(0, (min(result["lengths"]) // 2).bit_length() - 1)]
    while edges[-1] < max(result["lengths"]):
        edges.append(2 * edges[-1])
    bands = []
    for k, (lo, hi) in enumerate(zip(edges, edges[1:])):
        last = k == len(edges) - 2
        here = [a for distance, a in cells if lo <= distance and (distance < hi or last)]
        bands.append({"from": lo, "to": hi, "cells": len(here), "accuracy": float(np.mean(here)) if here else None})
    return bands


def tokens_word(n: int) -> str:
    """1024 -> '1K', 1536 -> '1536': band bounds as the tables write them."""
    return f"{n // 1024}K" if n and n % 1024 == 0 else str(n)


def distance_markdown(result: dict) -> str:
    bands = by_distance(result)
    if not bands:
        return ""
    headers = ["key to question (tokens)", *(f"{tokens_word(b['from'])}-{tokens_word(b['to'])}" for b in bands)]
    rows = [("accuracy", *("-" if b["accuracy"] is None else f"{b['accuracy']:.2f}" for b in bands)),
            ("cells", *(str(b["cells"]) for b in bands))]
    return ("\n\nBy distance from the key to the question ((1 - depth) x length, the measured cells pooled):\n\n"
            + markdown_table(headers, rows))


def grid_table(result: dict) -> tuple[list[str], list[tuple]]:
    """(headers, rows) of a result's grid: depths down, lengths across; 'does not fit' columns
    stay in the table, and lengths past the run's training length are marked with '*'."""
    trained = result.get("trained_seq_len")
    headers = ["depth \\ length", *(f"{n:,}" + ("*" if trained and n > trained else "") for n in result["lengths"])]
    rows = [(f"{d:g}", *(cell_word(result, j) if a is None else f"{a:.2f}" for j, a in enumerate(accuracy)))
            for d, accuracy in zip(result["depths"], result["accuracy"])]
    return headers, rows


def cell_word(result: dict, j: int) -> str:
    """What a cell without an accuracy says: the length did not fit, or (a stopped run's JSON) it
    was never reached."""
    return DOES_NOT_FIT if result["why_not"][j] else NOT_RUN


def grid_markdown(result: dict) -> str:
    headers, rows = grid_table(result)
    precision = f" in {result['precision']}" if "precision" in result else ""   # older results: the run's
    notes = [f"{result['name']}: {result['attention']} attention{precision}, {result['model']}, trained at "
             f"{result['trained_seq_len']:,} tokens, {result['trials']} trials per cell"]
    if any(n > result["trained_seq_len"] for n in result["lengths"]):
        notes.append("* longer than the run's training length")
    for n, why in zip(result["lengths"], result["why_not"]):
        if why:
            notes.append(f"{n:,} tokens: does not fit ({why})")
    if result.get("measured", len(result["lengths"])) < len(result["lengths"]):
        notes.append(f"stopped after {result['measured']} of {len(result['lengths'])} lengths")
    peaks = [f"{n:,}: {human_bytes(p)}" for n, p in zip(result["lengths"], result["peak_memory_bytes"]) if p]
    if peaks:
        notes.append("peak memory of one forward: " + ", ".join(peaks))
    return "\n".join(f"{line}." for line in notes) + "\n\n" + markdown_table(headers, rows)


def draw_grid(ax, fig, result: dict) -> None:
    """One heatmap: accuracy per cell, grey 'does not fit' columns, a dashed line where the lengths
    pass the run's training length."""
    accuracy = np.array([[np.nan if a is None else a for a in row] for row in result["accuracy"]], dtype=float)
    lengths, depths = result["lengths"], result["depths"]
    cmap = __import__("matplotlib").colormaps["RdYlGn"].with_extremes(bad="0.85")
    image = ax.imshow(np.ma.masked_invalid(accuracy), vmin=0, vmax=1, cmap=cmap, aspect="auto")
    ax.set_xticks(range(len(lengths)), [f"{n:,}" for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    for (i, j), a in np.ndenumerate(accuracy):
        ax.text(j, i, cell_word(result, j).replace(" ", "\n", 1) if np.isnan(a) else f"{a:.2f}", ha="center",
                va="center", fontsize=6 if np.isnan(a) else 8)
    beyond = [j for j, n in enumerate(lengths) if n > result["trained_seq_len"]]
    if beyond:
        ax.axvline(beyond[0] - 0.5, color="k", ls="--", lw=1)
    ax.set_xlabel(f"prompt length (tokens); dashed: past the {result['trained_seq_len']:,} it trained at"
                  if beyond else "prompt length (tokens)", fontsize=8)
    ax.set_ylabel("key depth")
    ax.set_title(f"{result['name']}: {result['attention']}, {result['model']}, trained at "
                 f"{result['trained_seq_len']:,}", fontsize=9)
    fig.colorbar(image, ax=ax, label="accuracy")


def main(argv: list[str]) -> None:
    parser = _common.argument_parser(__doc__)
    add_checkpoint_args(parser)
    parser.add_argument("--lengths", type=int, nargs="+", default=None,
                        help="prompt lengths in tokens (default: powers of two from 256 below the run's seq_len, and the seq_len)")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--key-digits", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default=None,
                        help="the forwards' precision (default: the run's trainer.precision); fp32 says whether "
                             "bf16's rounding decides the answers a model gets wrong")
    parser.add_argument("--memory-budget-mb", type=float, default=None,
                        help="CPU only: MiB in all (the weights included) a forward's live tensors may take")
    add_beside_argument(parser, "passkey grid")
    args = parser.parse_args(argv)
    require_positive(args, "lengths", "trials", "key_digits")
    if args.key_digits > MAX_KEY_DIGITS:
        raise ValueError(f"--key-digits {args.key_digits}: at most {MAX_KEY_DIGITS}")
    if any(not 0 <= d <= 1 for d in args.depths):
        raise ValueError(f"--depths {args.depths}: each depth must be in [0, 1]")
    if args.memory_budget_mb is not None and not args.memory_budget_mb > 0:
        raise ValueError(f"--memory-budget-mb {args.memory_budget_mb:g}: must be a number > 0")
    beside = read_beside(args.beside, "eval_passkey.py", ("lengths", "depths", "accuracy", "why_not", "trained_seq_len"))

    from data.passkey import random_key

    model, cfg, tokenizer, device, path = load_for_eval(args)
    meter = memory_meter(args, model, device)
    lengths = prompt_lengths(args.lengths, tokenizer, args.key_digits, cfg)
    name = run_name(args, path)
    precision = args.precision or cfg.trainer.precision
    result = {
        "name": name, "checkpoint": str(path), "lengths": lengths, "depths": args.depths, "trials": args.trials,
        "key_digits": args.key_digits, "seed": args.seed, "accuracy": [[None] * len(lengths) for _ in args.depths],
        "answer_tokens_right": [[None] * len(lengths) for _ in args.depths], "misses": [],
        "why_not": [None] * len(lengths), "peak_memory_bytes": [None] * len(lengths), "measured": 0,
        "trained_seq_len": int(cfg.trainer.seq_len), "tokenizer": tokenizer.fingerprint,
        "attention": cfg.attention.name, "precision": precision, "model": cfg.model.name,
        "environment": environment(device),
    }
    if beside is not None:
        result["beside"] = beside
    stem = args.out_dir / f"passkey_{name}"
    rng = np.random.default_rng(args.seed)
    for j, length in enumerate(lengths):
        keys = [(i, random_key(rng, args.key_digits)) for i in range(len(args.depths)) for _ in range(args.trials)]
        trials = [passkey_ids(tokenizer, length, args.depths[i], key) for i, key in keys]
        predictions, result["why_not"][j], result["peak_memory_bytes"][j] = length_column(
            model, trials, meter, device, precision, int(cfg.model.max_seq_len))
        if predictions is not None:
            record_length(result, j, keys, trials, predictions, tokenizer)
        result["measured"] = j + 1
        result["by_distance"] = by_distance(result)
        write_json(stem.with_suffix(".json"), result)   # after each length: a stopped run keeps what it measured
    headers, rows = grid_table(result)
    print_table(f"passkey accuracy: {name}", headers, rows)
    text = (f"# Passkey retrieval: {name}\n\n" + grid_markdown(result) + distance_markdown(result)
            + misses_markdown(result) + rate_markdown(result))
    if beside is not None:
        text += (f"\n## Beside it: {beside['name']}\n\n" + grid_markdown(beside) + distance_markdown(beside)
                 + rate_markdown(beside))
    write_text(stem.with_suffix(".md"), text)
    panels = ([beside] if beside is not None else []) + [result]   # the earlier result on the left
    width = sum(1.2 * len(r["lengths"]) + 2.5 for r in panels)
    fig, axes = new_figure(1, len(panels), figsize=(width, 0.6 * max(len(r["depths"]) for r in panels) + 1.8))
    for ax, panel in zip(axes[0], panels):
        draw_grid(ax, fig, panel)
    save_figure(fig, stem.with_suffix(".png"))
    print(f"wrote {stem}.{{json,md,png}}")


if __name__ == "__main__":
    run_cli(main)
