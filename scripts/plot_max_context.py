"""Longest training step against the number of GPUs, from scripts/max_context.py's JSON results.

    python scripts/plot_max_context.py benchmarks/max_context/max_context_h200.json \\
        benchmarks/max_context/max_context_h200_x2_cp2.json

Each file is one max_context.py run (one GPU, or N under torchrun with trainer.context_parallel);
its GPU count is the number of GPUs one sequence was split over, the run's recorded
trainer.context_parallel (1 for one GPU and for files from before context parallelism).
Every (attention, memory features) pair that two or more GPU counts share is drawn as a line,
with a dashed line for linear scaling from its smallest count; a search that reached its cap is
a hollow marker labelled '≥'. Writes <out>/max_context_gpus.png (--out DIR; default
outputs/plot_max_context/, `--out benchmarks/max_context` for the committed plot) and prints the
points.
"""
from __future__ import annotations

import json
from pathlib import Path

import _common  # noqa: F401  (puts the repo root on sys.path)
from _common import add_out_argument, new_figure, require_output_file, run_cli, save_figure, tokens_axis, tokens_label


def points(paths: list[Path]) -> dict[tuple[str, str], dict[int, tuple[int, bool]]]:
    """(impl, features) -> {GPU count: (max length, capped)} over the completed searches."""
    series: dict[tuple[str, str], dict[int, tuple[int, bool]]] = {}
    for path in paths:
        report = json.loads(path.read_text())
        gpus = report["settings"].get("context_parallel", 1)
        for r in report["results"]:
            if r.get("error") is None and r.get("max_length"):
                series.setdefault((r["impl"], r["features"]), {})[gpus] = (r["max_length"], r["capped"])
    return series


def plot(series: dict, out: Path, title: str) -> None:
    fig, axes = new_figure(1, 1, figsize=(7, 4.5))
    ax = axes[0][0]
    for (impl, features), by_gpus in series.items():
        counts = sorted(by_gpus)
        lengths = [by_gpus[n][0] for n in counts]
        line, = ax.plot(counts, lengths, label=f"{impl}, {features}")
        for n, (length, capped) in sorted(by_gpus.items()):
            ax.plot([n], [length], marker="o", color=line.get_color(), markerfacecolor="none" if capped else None)
            ax.annotate(("≥ " if capped else "") + tokens_label(length), (n, length), textcoords="offset points",
                        xytext=(6, -10), fontsize=8)
        ax.plot(counts, [lengths[0] * n / counts[0] for n in counts], ls="--", lw=1, color=line.get_color(),
                alpha=0.5)
    gpu_counts = sorted({n for by_gpus in series.values() for n in by_gpus})
    ax.set_xscale("log", base=2)
    ax.set_xticks(gpu_counts, [str(n) for n in gpu_counts])
    tokens_axis(ax, "y")
    ax.set(xlabel="GPUs one sequence is split over (trainer.context_parallel)", ylabel="longest sequence (tokens)", title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(title="dashed: linear in GPUs", fontsize=8)
    save_figure(fig, out)


def main(argv: list[str]) -> None:
    parser = _common.argument_parser(__doc__)
    parser.add_argument("results", nargs="+", type=Path, help="max_context.py JSON files (one per GPU count)")
    add_out_argument(parser, "plot_max_context")
    args = parser.parse_args(argv)
    args.out = args.out / "max_context_gpus.png"
    require_output_file(args.out, "--out")
    for path in args.results:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such results file")
    series = {key: by_gpus for key, by_gpus in points(args.results).items() if len(by_gpus) > 1}
    if not series:
        raise ValueError("no (attention, features) pair was measured at two or more GPU counts in these files")
    first = json.loads(args.results[0].read_text())
    plot(series, args.out, f"{first['model']['name']}: longest training step, {first['metadata']['device']}")
    for (impl, features), by_gpus in series.items():
        cells = ", ".join(f"{n} GPU{'s' if n > 1 else ''}: {'≥ ' if c else ''}{length:,}"
                          for n, (length, c) in sorted(by_gpus.items()))
        print(f"{impl}, {features}: {cells}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run_cli(main)
