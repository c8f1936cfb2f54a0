"""Resume to the bit on the GPU, and what `trainer.deterministic` costs, measured in one call.

    python scripts/bench/check_gpu_resume.py --out benchmarks/resume           # H200: gpt2-small, T = 1K, ~2-3 min
    python scripts/bench/check_gpu_resume.py --out benchmarks/resume --default-resume  # also kill/resume without it (+1 min)
    python scripts/bench/check_gpu_resume.py --out /tmp/x --steps 12 --ckpt-every 4 --kill-at 8 \\
        device=cpu model=tiny trainer.seq_len=64 trainer.batch_size=4 data.max_bytes=2000000

Every run is `python train.py` itself (a subprocess, logger=none, offline corpus), `--steps`
optimizer steps of gpt2-small (with its 50,304-row head, over the byte tokenizer's ids) with
checkpoints every `--ckpt-every` steps:

1. `deterministic`: trainer.deterministic=true, uninterrupted: the reference losses, and tokens/s;
2. `killed + resumed`: the same command with resume=auto, SIGKILLed once `--kill-at` steps are
   logged (between two checkpoints), then the same command again: it resumes from the last
   checkpoint, and every logged value (loss, gradient norm, learning rate, final val_loss) is
   compared with run 1 bit for bit;
3. `default`: trainer.deterministic=false, uninterrupted: tokens/s without the switch, so the
   cost is measured in the same call on the same GPU (steady state: the rows after `--warmup`);
4. with `--default-resume`, run 2 again without the switch, compared with run 3: how far apart a
   resumed run lands by default.

Results: `<out>/<name>.json` and `.md` (default name `resume_<gpu>`), with the date, GPU,
torch/triton versions and commit. Trailing `key=value` arguments override the training config.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/, for _common (which puts the repo root first)
import _common  # noqa: F401  (puts the repo root on sys.path)
import torch

from _common import (REPO_ROOT, add_out_argument, argument_parser, device_slug, environment, markdown_table, run_cli,
                     write_json, write_text)

GPT2 = ["model=gpt2-small", "trainer.seq_len=1024", "trainer.batch_size=16",
        "trainer.compile=false", "logger=none", "trainer.progress=false", "trainer.log_every=1",
        "trainer.eval_every=0", "trainer.eval_batches=2", "data.max_bytes=8000000"]
COMPARED = ("loss", "grad_norm", "lr", "val_loss")   # every logged value but the timings


def train_command(run_dir: Path, cache: Path, args, deterministic: bool, resume: bool) -> list[str]:
    from training.config import merge_overrides

    return [sys.executable, str(REPO_ROOT / "train.py"), *merge_overrides(
        GPT2, [f"run.dir={run_dir}", f"data.cache_dir={cache}", f"trainer.max_steps={args.steps}",
               f"trainer.ckpt_every={args.ckpt_every}", f"trainer.deterministic={str(deterministic).lower()}",
               *(["resume=auto"] if resume else [])], args.overrides)]


def child_env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("CUBLAS_WORKSPACE_CONFIG", None)  # train.py sets it when, and only when, asked to be deterministic
    return env


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def finish(returncode: int, stderr: str, what: str) -> None:
    if returncode:
        tail = stderr.strip().splitlines()[-3:]
        raise SystemExit(f"error: {what}: train.py exited {returncode}: {' | '.join(tail)}")


def uninterrupted(run_dir: Path, cache: Path, args, deterministic: bool) -> dict:
    began = time.perf_counter()
    proc = subprocess.run(train_command(run_dir, cache, args, deterministic, resume=False), cwd=REPO_ROOT,
                          env=child_env(), capture_output=True, text=True)
    finish(proc.returncode, proc.stderr, f"the {'deterministic' if deterministic else 'default'} run")
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # gpt2-small's are 1.5 GB each
    return {"rows": rows_of(run_dir), "wall_s": time.perf_counter() - began}


def killed_and_resumed(run_dir: Path, cache: Path, args, deterministic: bool) -> dict:
    """Start, SIGKILL once `kill_at` rows are logged, run the same command again to the end."""
    command = train_command(run_dir, cache, args, deterministic, resume=True)
    began = time.perf_counter()
    run_dir.mkdir(parents=True)
    stderr = run_dir.parent / f"{run_dir.name}.stderr"
    with open(stderr, "w") as err:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, env=child_env(), stdout=subprocess.DEVNULL, stderr=err)
        metrics = run_dir / "metrics.jsonl"
        while proc.poll() is None and (not metrics.exists() or len(metrics.read_text().splitlines()) < args.kill_at):
            time.sleep(0.005)
        if proc.poll() is not None:
            finish(proc.returncode, stderr.read_text(), "the run to kill")
            raise SystemExit(f"error: the run ended before {args.kill_at} steps were logged: raise --steps")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    killed_at = len(metrics.read_text().splitlines())
    again = subprocess.run(command, cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True)
    finish(again.returncode, again.stderr, "the resumed run")
    lineage = [json.loads(line) for line in (run_dir / "lineage.jsonl").read_text().splitlines()]
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return {"rows": rows_of(run_dir), "wall_s": time.perf_counter() - began, "killed_after_step": killed_at,
            "resumed_from_step": lineage[-1]["step"]}


def compare(reference: list[dict], other: list[dict]) -> dict:
    """Step by step: whether every compared value is the same float, and the largest loss gap."""
    ref = {r["step"]: r for r in reference}
    steps = []
    for row in other:
        base = ref.get(row["step"], {})
        same = all(row.get(k) == base.get(k) for k in COMPARED)
        steps.append({"step": row["step"], "loss": row["loss"], "reference_loss": base.get("loss"), "identical": same})
    gaps = [abs(s["loss"] - s["reference_loss"]) for s in steps if s["reference_loss"] is not None]
    return {"steps_compared": len(steps), "identical_steps": sum(s["identical"] for s in steps),
            "same_steps_logged": [r["step"] for r in other] == [r["step"] for r in reference],
            "max_abs_loss_diff": max(gaps) if gaps else math.nan, "per_step": steps}


def steady_tokens_per_s(rows: list[dict], warmup: int) -> float:
    rates = sorted(r["tokens_per_s"] for r in rows if r["step"] > warmup)
    return rates[len(rates) // 2] if rates else math.nan


def main(argv: list[str]) -> None:
    parser = argument_parser(__doc__)
    add_out_argument(parser, "check_gpu_resume")
    parser.add_argument("--name", type=_common.file_stem, default=None, help="result file name without extension (default resume_<gpu>)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    parser.add_argument("--ckpt-every", type=int, default=20, help="checkpoint interval (the resume point)")
    parser.add_argument("--kill-at", type=int, default=30, help="SIGKILL once this many steps are logged")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the tokens/s median")
    parser.add_argument("--default-resume", action="store_true",
                        help="also kill and resume without trainer.deterministic")
    parser.add_argument("overrides", nargs="*", help="training config overrides (key=value)")
    args = parser.parse_args(argv)
    for name in ("steps", "ckpt_every", "kill_at"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be a positive integer")
    if not args.ckpt_every < args.kill_at < args.steps or args.kill_at % args.ckpt_every == 0:
        raise ValueError(f"--kill-at {args.kill_at} must fall between two checkpoints (--ckpt-every "
                         f"{args.ckpt_every}) before --steps {args.steps}")
    if args.warmup >= args.steps:
        raise ValueError(f"--warmup {args.warmup} must be below --steps {args.steps}")
    if not torch.cuda.is_available() and "device=cpu" not in args.overrides:   # gpt2-small for hours, otherwise
        raise ValueError("no CUDA device: this check measures GPU runs; device=cpu runs its plumbing on the CPU")
    device = torch.device("cuda" if torch.cuda.is_available() and "device=cpu" not in args.overrides else "cpu")
    name = args.name or f"resume_{device_slug(device)}"
    args.out.mkdir(parents=True, exist_ok=True)  # before any work: an unwritable --out fails now

    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="check_gpu_resume-") as tmp:
        work, cache = Path(tmp), Path(tmp) / "cache"
        runs = {"deterministic": uninterrupted(work / "deterministic", cache, args, deterministic=True)}
        runs["deterministic_resumed"] = killed_and_resumed(work / "deterministic_resumed", cache, args, True)
        runs["default"] = uninterrupted(work / "default", cache, args, deterministic=False)
        if args.default_resume:
            runs["default_resumed"] = killed_and_resumed(work / "default_resumed", cache, args, False)
    det, default = (steady_tokens_per_s(runs[k]["rows"], args.warmup) for k in ("deterministic", "default"))
    result = {
        "meta": {**environment(device), "overrides": GPT2 + args.overrides, "steps": args.steps,
                 "ckpt_every": args.ckpt_every, "kill_at": args.kill_at, "warmup": args.warmup,
                 "wall_s": time.perf_counter() - began},
        "resume": {"deterministic": {**compare(runs["deterministic"]["rows"], runs["deterministic_resumed"]["rows"]),
                                     "killed_after_step": runs["deterministic_resumed"]["killed_after_step"],
                                     "resumed_from_step": runs["deterministic_resumed"]["resumed_from_step"]}},
        "throughput": {"deterministic_tokens_per_s": det, "default_tokens_per_s": default,
                       "deterministic_over_default": det / default if default else math.nan},
        "runs": {k: {"wall_s": v["wall_s"], "rows": v["rows"]} for k, v in runs.items()},
    }
    if args.default_resume:
        result["resume"]["default"] = {**compare(runs["default"]["rows"], runs["default_resumed"]["rows"]),
                                       "killed_after_step": runs["default_resumed"]["killed_after_step"],
                                       "resumed_from_step": runs["default_resumed"]["resumed_from_step"]}
    write_json(args.out / f"{name}.json", result)
    write_text(args.out / f"{name}.md", markdown(result))
    check = result["resume"]["deterministic"]
    print(f"trainer.deterministic=true: {check['identical_steps']}/{check['steps_compared']} steps bit-identical "
          f"after kill -9 at step {check['killed_after_step']} and resume from step {check['resumed_from_step']}; "
          f"tokens/s {det:,.0f} vs {default:,.0f} without it ({result['throughput']['deterministic_over_default']:.3f}x)"
          f" -> {args.out / name}.json")


def markdown(result: dict) -> str:
    meta, tp = result["meta"], result["throughput"]
    lines = [f"# Resume to the bit on {meta['device']}, and the cost of `trainer.deterministic`", "",
             f"`python scripts/bench/check_gpu_resume.py` on {meta['date']}: torch {meta['torch']}, triton {meta['triton']}, "
             f"commit {meta['git_commit']}. Each run is train.py with `{' '.join(meta['overrides'])}`, "
             f"{meta['steps']} steps, a checkpoint every {meta['ckpt_every']}.", "",
             "## kill -9 and resume=auto against an uninterrupted run", ""]
    rows = []
    for label, key in (("trainer.deterministic=true", "deterministic"), ("default (false)", "default")):
        if key in result["resume"]:
            r = result["resume"][key]
            rows.append([label, r["killed_after_step"], r["resumed_from_step"],
                         f"{r['identical_steps']}/{r['steps_compared']}", f"{r['max_abs_loss_diff']:.3g}"])
    lines.append(markdown_table(["run", "killed after step", "resumed from", "steps bit-identical (loss, grad norm, "
                                 "lr, val_loss)", "max abs loss diff"], rows))
    lines += ["## Throughput (steady state, median tokens/s after the warm-up steps)", "",
              markdown_table(["trainer.deterministic", "tokens/s", "relative"],
                             [["true", f"{tp['deterministic_tokens_per_s']:,.0f}",
                               f"{tp['deterministic_over_default']:.3f}x"],
                              ["false (default)", f"{tp['default_tokens_per_s']:,.0f}", "1.000x"]]),
              "## Per step (trainer.deterministic=true)", ""]
    per_step = result["resume"]["deterministic"]["per_step"]
    lines.append(markdown_table(["step", "uninterrupted loss", "killed + resumed loss", "identical"],
                                [[s["step"], repr(s["reference_loss"]), repr(s["loss"]), "yes" if s["identical"] else "NO"]
                                 for s in per_step]))
    return "\n".join(lines)


if __name__ == "__main__":
    run_cli(main)
