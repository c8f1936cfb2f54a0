"""Loss parity of two attention implementations: train.py twice from one seed, curves compared.

    python scripts/bench/compare_attention_losses.py trainer.max_steps=300 trainer.seq_len=64 trainer.batch_size=1 \
        trainer.eval_batches=4 logger=none      # naive vs flash: ~12 min on 2 CPU cores
    python scripts/bench/compare_attention_losses.py --attention sdpa,flash --name loss_parity_h200 ...

Issue 3's end-to-end check: an exact kernel must train like the formula it replaces. Both runs get
the same Hydra overrides (so the same seed, data order and initial weights) and differ only in
`attention=`; every step is logged (trainer.log_every=1 unless overridden) and the per-step train
losses are compared. Without CUDA both runs get TRITON_INTERPRET=1, so attention=flash runs our
Triton kernel in the interpreter (float32); the naive run sees the same environment.

Writes <out>/<name>.json (both series, val losses, differences, metadata), .md (summary) and .png
(curves overlaid, and |difference| per step). Exits non-zero if a run fails. `--redraw x.json` redoes
the .md and .png from a saved result, without training.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/, for _common (which puts the repo root first)
import _common  # noqa: F401  (puts the repo root on sys.path)
import torch
from omegaconf import OmegaConf

from _common import (REPO_ROOT, add_out_argument, attention_list, device_slug, environment, markdown_table, new_figure, run_cli, save_figure,
                     write_json, write_text)
from training.run.metrics import MetricsFile

DEFAULT_OVERRIDES = ("trainer.log_every=1", "trainer.progress=false")  # unless the command line sets them
RESERVED_KEYS = ("attention", "run.dir")  # the script sets these per run
EARLY_STEPS = 10  # the window where chaotic growth of rounding differences has not yet started


def run_overrides(overrides: list[str]) -> list[str]:
    """The overrides both runs share: the command line's, plus the defaults it does not set."""
    from training.config import merge_overrides, override_key

    keys = {override_key(o) for o in overrides}
    for key in RESERVED_KEYS:
        if key in keys:
            raise ValueError(f"override {key}=... is set by the script per run; remove it")
    return merge_overrides(list(DEFAULT_OVERRIDES), overrides)


def train(attention: str, overrides: list[str], run_dir: Path) -> float:
    """One train.py run in a fresh interpreter; returns its wall time in seconds."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not torch.cuda.is_available():
        env.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported: hence a subprocess
    command = [sys.executable, str(REPO_ROOT / "train.py"), f"attention={attention}", f"run.dir={run_dir}",
               *overrides]
    print("+", " ".join(command[1:]), flush=True)
    start = time.perf_counter()
    status = subprocess.run(command, cwd=REPO_ROOT, env=env).returncode
    if status:
        raise SystemExit(f"error: attention={attention} run failed with exit status {status} (see {run_dir})")
    return time.perf_counter() - start


def read_series(run_dir: Path) -> dict:
    """Per logged step: train loss; per eval step: val loss (from the run's metrics.jsonl)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise ValueError(f"{path} does not exist")
    rows = MetricsFile.read(path)
    return {"steps": [r["step"] for r in rows], "loss": [r["loss"] for r in rows],
            "val_loss": {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}}


def abs_diff_stats(diffs: list[float]) -> dict:
    return {"steps": len(diffs), "max_abs_diff": max(diffs), "mean_abs_diff": sum(diffs) / len(diffs)}


def compare(base: dict, other: dict, early_steps: int = EARLY_STEPS) -> dict:
    """Absolute differences of the train loss step by step (over the first `early_steps` logged
    steps and over all), and of the val loss at each eval step."""
    if base["steps"] != other["steps"]:
        raise ValueError(f"the runs logged different steps: {base['steps'][:5]}... vs {other['steps'][:5]}...")
    if not base["steps"]:
        raise ValueError("the runs logged no steps")
    diffs = [abs(a - b) for a, b in zip(base["loss"], other["loss"])]
    return {
        "abs_diff": diffs,
        "identical_steps": sum(d == 0 for d in diffs),
        "early": abs_diff_stats(diffs[:early_steps]),
        "all": abs_diff_stats(diffs),
        "final_abs_diff": diffs[-1],
        "val_abs_diff": {step: abs(base["val_loss"][step] - other["val_loss"][step])
                         for step in base["val_loss"] if step in other["val_loss"]},
    }


def summary_markdown(result: dict) -> str:
    base, other = result["attention"]
    series, diff, env = result["series"], result["comparison"], result["environment"]
    rows = [(name, f"{series[name]['loss'][-1]:.6f}",
             ", ".join(f"{step}: {loss:.6f}" for step, loss in series[name]["val_loss"].items()),
             f"{result['wall_s'][name]:.0f}") for name in (base, other)]
    diff_rows = [(f"first {diff[window]['steps']} steps" if window == "early" else f"all {diff[window]['steps']} steps",
                  f"{diff[window]['max_abs_diff']:.3g}", f"{diff[window]['mean_abs_diff']:.3g}")
                 for window in ("early", "all")]
    diff_rows.append((f"final step ({series[base]['steps'][-1]})", f"{diff['final_abs_diff']:.3g}", ""))
    diff_rows += [(f"val loss, step {step}", f"{d:.3g}", "") for step, d in diff["val_abs_diff"].items()]
    return (f"# Loss parity: attention={base} vs attention={other}\n\n"
            f"Same seed and overrides, one run each ({env['device']}, torch {env['torch']}, triton {env['triton']}, "
            f"commit {env['git_commit']}, {env['date']}).\n\n"
            f"Overrides: `{' '.join(result['overrides'])}`\n\n"
            + markdown_table(["attention", "final train loss", "val loss by step", "wall s"], rows)
            + "\n|train loss difference| per step (and val loss at each eval):\n\n"
            + markdown_table(["over", "max", "mean"], diff_rows)
            + f"\n{diff['identical_steps']} of {diff['all']['steps']} steps had bit-identical losses.\n")


def draw(result: dict, path: Path) -> None:
    """Top: both loss curves (val losses as markers); bottom: |difference| per step, log scale."""
    fig, axes = new_figure(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    curves, gap = axes[0][0], axes[1][0]
    for name, style in zip(result["attention"], ("-", "--")):
        series = result["series"][name]
        line, = curves.plot(series["steps"], series["loss"], style, lw=1, label=f"{name} (train)")
        val = series["val_loss"]
        curves.plot([int(step) for step in val], list(val.values()), "o", color=line.get_color(), mfc="none",
                    label=f"{name} (val)")  # int(): a saved JSON (--redraw) has the steps as str keys
    curves.set_ylabel("loss (nats)")
    curves.set_title(f"attention={' vs '.join(result['attention'])}, seed {result['seed']}", fontsize=9)
    curves.legend(fontsize=8)
    steps, diffs = result["series"][result["attention"][0]]["steps"], result["comparison"]["abs_diff"]
    gap.plot(steps, [d if d > 0 else math.nan for d in diffs], ".-", ms=3, lw=0.8, color="black")
    if any(d > 0 for d in diffs):
        gap.set_yscale("log")
    gap.set_xlabel("step")
    gap.set_ylabel("|train loss diff|")
    gap.set_title("bit-identical steps (diff 0) are not drawn", fontsize=8)
    for ax in (curves, gap):
        ax.grid(alpha=0.3)
    save_figure(fig, path)


def build_result(attention: list[str], overrides: list[str], run_dirs: dict, wall_s: dict) -> dict:
    """Everything the outputs show, read back from the two run folders."""
    cfg = OmegaConf.load(run_dirs[attention[0]] / "config.yaml")
    series = {name: read_series(run_dirs[name]) for name in attention}
    return {"attention": attention, "overrides": overrides, "seed": cfg.seed, "model": cfg.model.name,
            "run_dirs": {k: str(v) for k, v in run_dirs.items()}, "wall_s": wall_s, "series": series,
            "comparison": compare(*(series[name] for name in attention)),
            "environment": environment(torch.device(cfg.device))}


def write_outputs(result: dict, stem: Path) -> None:
    write_json(stem.with_suffix(".json"), result)
    write_text(stem.with_suffix(".md"), summary_markdown(result))
    draw(result, stem.with_suffix(".png"))


def main(argv: list[str]) -> None:
    parser = _common.argument_parser(__doc__)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both runs, as for train.py")
    parser.add_argument("--attention", type=attention_list, default=["naive", "flash"], metavar="BASE,OTHER",
                        help="the two implementations compared (default naive,flash)")
    parser.add_argument("--work", type=Path, help="folder for the two run dirs (default outputs/loss_parity/<time>)")
    add_out_argument(parser, "compare_attention_losses")
    parser.add_argument("--name", type=_common.file_stem, help="file stem of the results (default loss_parity_<device>)")
    parser.add_argument("--redraw", type=Path, metavar="JSON", help="only rewrite the .md and .png beside a saved JSON")
    args = parser.parse_intermixed_args(argv)
    if len(args.attention) != 2 or len(set(args.attention)) != 2:
        raise ValueError(f"--attention {','.join(args.attention)}: name two different implementations, BASE,OTHER")
    if args.redraw:
        result = json.loads(args.redraw.read_text())
        write_text(args.redraw.with_suffix(".md"), summary_markdown(result))
        draw(result, args.redraw.with_suffix(".png"))
        return

    overrides = run_overrides(args.overrides)
    work = args.work or REPO_ROOT / "outputs" / "loss_parity" / datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    run_dirs = {name: work / name for name in args.attention}
    for run_dir in run_dirs.values():
        if run_dir.exists():
            raise SystemExit(f"error: {run_dir} already exists; pick another --work")
    wall_s = {name: train(name, overrides, run_dir) for name, run_dir in run_dirs.items()}

    result = build_result(args.attention, overrides, run_dirs, wall_s)
    stem = args.out / (args.name or f"loss_parity_{device_slug(torch.device(result['environment']['device_type']))}")
    write_outputs(result, stem)
    diff = result["comparison"]
    print(f"max |train loss diff|: first {diff['early']['steps']} steps {diff['early']['max_abs_diff']:.3g}, "
          f"all {diff['all']['steps']} steps {diff['all']['max_abs_diff']:.3g}")
    print(f"wrote {stem}.json, .md, .png")


if __name__ == "__main__":
    run_cli(main)
