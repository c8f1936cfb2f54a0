"""Compare training runs: a table of what differs and what each reached, and their loss curves.

    python scripts/compare_runs.py multirun/2026-12-01/10-00-00          # every job of a sweep (-m)
    python scripts/compare_runs.py outputs/latest runs/a runs/b --name ab

Each argument is a run folder (its config.yaml and metrics.jsonl) or a folder of run folders (a
sweep). The table has the config keys whose values differ between the runs, the steps and tokens
reached, the last train and validation loss, the best validation loss and its step, and the median
tokens/s; it is printed and written to <out>/<name>.md and .json (with every run's config and
metrics rows). <out>/<name>.png draws train and validation loss against tokens seen, one colour per
run, labelled by what differs. Finished, interrupted and
running runs alike (what metrics.jsonl holds so far). --out defaults to outputs/compare_runs/.
"""
from __future__ import annotations

from pathlib import Path

import _common  # noqa: F401  (puts the repo root on sys.path)
from _common import (add_out_argument, argument_parser, environment, file_stem, markdown_table, new_figure,
                     print_table, run_cli, save_figure, write_json, write_text)

STYLES = ("-", "--", ":", "-.")   # with the colour: runs whose curves coincide stay visible


def decimal_tokens(value: float, _=None) -> str:
    """An axis tick: 20000 -> '20K', 1.5e6 -> '1.5M'."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:g}{unit}"
    return f"{value:g}"


def plot(runs, keys: list[str], path: Path, title: str) -> None:
    from matplotlib.ticker import FuncFormatter

    from training.run.records import run_label

    fig, axes = new_figure(1, 2, figsize=(13, 4.8))
    for i, run in enumerate(runs):
        style = dict(color=f"C{i % 10}", ls=STYLES[i // 10 % len(STYLES) if len(runs) > 10 else i % len(STYLES)],
                     label=run_label(run, keys))
        train = [(r["tokens"], r["loss"]) for r in run.rows]
        val = [(r["tokens"], r["val_loss"]) for r in run.val_rows()]
        if train:
            axes[0][0].plot(*zip(*train), **style)
        if val:
            axes[0][1].plot(*zip(*val), marker="o", ms=3, **style)
    for ax, what in zip(axes[0], ("train loss", "validation loss")):
        ax.set(xlabel="tokens seen", ylabel=what, title=what)
        ax.xaxis.set_major_formatter(FuncFormatter(decimal_tokens))
        ax.grid(True, alpha=0.3)
        if not ax.lines:
            ax.text(0.5, 0.5, "no validation rows yet" if "val" in what else "no rows",
                    ha="center", va="center", transform=ax.transAxes)
    # One legend for both panels, below them (inside either it covered the curves of a sweep).
    handles: dict = {}
    for line in (line for ax in axes[0] for line in ax.lines):   # a run's train curve, else its validation one
        handles.setdefault(line.get_label(), line)
    if handles:
        fig.legend(handles.values(), handles.keys(), loc="upper center", bbox_to_anchor=(0.5, 0.0), fontsize=8,
                   ncol=min(3 if max(map(len, handles)) <= 60 else 1, len(handles)), frameon=False)
    fig.suptitle(title)
    save_figure(fig, path)


def main(argv: list[str]) -> dict:
    parser = argument_parser(__doc__)
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN", help="run folders, or a sweep's folder")
    add_out_argument(parser, "compare_runs")
    parser.add_argument("--name", default="compare", type=file_stem,
                        help="file stem of the .md and .png (default compare)")
    args = parser.parse_args(argv)

    from training.run.records import LABEL_KEYS, comparison, differing_keys, find_runs

    runs = find_runs(args.runs)
    root = args.runs[0] if len(args.runs) == 1 and not (args.runs[0] / "metrics.jsonl").exists() else None
    headers, rows = comparison(runs, root)
    keys = differing_keys(runs)
    stem = args.out / args.name
    title = f"{len(runs)} run(s): " + (", ".join(keys) if keys else "no config differences")
    print_table(title, headers, rows)
    import torch

    meta = environment(torch.device("cpu"))   # of this comparison; each run's own device is in its config
    write_json(stem.with_suffix(".json"), {"environment": meta, "headers": headers, "rows": rows,
                                           "runs": [{"path": str(r.path), "config": r.config, "metrics": r.rows}
                                                    for r in runs]})
    write_text(stem.with_suffix(".md"), f"# {title}\n\nRuns: {', '.join(str(p) for p in args.runs)}. Compared "
               f"{meta['date']} at commit {meta['git_commit']} (`{meta['command']}`).\n\n"
               + markdown_table(headers, rows))
    plot(runs, keys, stem.with_suffix(".png"), title if len(keys) <= LABEL_KEYS else
         f"{len(runs)} run(s): {len(keys)} config keys differ ({stem.name}.md lists them)")
    print(f"wrote {stem}.md, .json, .png")
    return {"headers": headers, "rows": rows, "keys": keys}


if __name__ == "__main__":
    run_cli(main)
