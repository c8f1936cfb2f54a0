"""What a run tells its user: where it is and how to continue it (first), what it reached and what
to run next (last), and `outputs/latest`, a link to the newest run.

    run folder: outputs/2026-12-01/07-16-20 (outputs/latest points here)
    resume with: python train.py trainer.max_steps=500 run.dir=outputs/2026-12-01/07-16-20 resume=auto
    ...
    done: 500 steps, 1,024,000 tokens in 3m 41s | train loss 1.6021 | val loss 1.6484 (best 1.6484 at step 500)
    checkpoint: outputs/2026-12-01/07-16-20/checkpoints/step_00000500.pt | weights: .../model.safetensors
    sample: python scripts/generate.py outputs/2026-12-01/07-16-20 --prompt "def " --max-new-tokens 200

The resume command repeats the run's own overrides (Hydra's), so a resume sees the same config.
`outputs/latest` (`run.latest`) points at the newest run whose folder Hydra chose (no `run.dir=`,
not a sweep job). It is a symbolic link replaced atomically (a temporary link renamed
over it): nothing is ever written through it, and a real file or folder of that name is left
alone. Where links cannot be made (Windows without the privilege) the run says so and goes on.
"""
from __future__ import annotations

import logging
import os
import shlex
import sys
import time
from pathlib import Path

from training.run.records import read_run

log = logging.getLogger("train")
REPO = Path(__file__).resolve().parents[2]


def shown(path: str | Path) -> str:
    """A path as the user would type it from here: relative under the current folder, else absolute."""
    path = Path(path)
    absolute = path if path.is_absolute() else Path.cwd() / path
    try:
        return str(absolute.relative_to(Path.cwd()))
    except ValueError:
        return str(absolute)


def hydra_overrides() -> list[str] | None:
    """This job's command-line overrides (a sweep job: its own values), or None outside train.py."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return list(HydraConfig.get().overrides.task)


def in_default_folder() -> bool:
    """A single `python train.py` run that let Hydra choose its folder (no run.dir=, not a sweep job):
    the runs `outputs/latest` is for (a run.dir you chose you know already)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.RUN:
        return False
    return not any(o.lstrip("+~").startswith("run.dir=") for o in HydraConfig.get().overrides.task)


def launcher(world_size: int) -> str:
    """How this run was started: python, or torchrun with as many processes."""
    script = sys.argv[0] if Path(sys.argv[0]).name == "train.py" else shown(REPO / "train.py")
    if world_size <= 1:
        return f"python {script}"
    if os.environ.get("LOCAL_WORLD_SIZE") == str(world_size):
        return f"torchrun --standalone --nproc_per_node={world_size} {script}"
    return f"torchrun <your rendezvous flags> {script}"


def resume_command(run_dir: str | Path, world_size: int = 1, overrides: list[str] | None = None) -> str:
    """The command that continues the run in `run_dir` with the same overrides."""
    kept = [o for o in (overrides or []) if not o.lstrip("+~").startswith(("run.dir=", "resume=", "hydra."))]
    return " ".join([launcher(world_size), *map(shlex.quote, kept), shlex.quote(f"run.dir={shown(run_dir)}"),
                     "resume=auto"])


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    return f"{minutes // 60}h {minutes % 60:02d}m"


def point_latest(link: str | Path, run_dir: Path) -> bool:
    """Make `link` a symbolic link to `run_dir` (relative when the run lies beside it), replacing
    an older link in one rename; never follows or replaces anything that is not a link."""
    link = Path(link)
    if link.exists() and not link.is_symlink():
        log.warning("run.latest=%s exists and is not a link: left alone", link)
        return False
    target = run_dir.resolve()
    try:
        link.parent.mkdir(parents=True, exist_ok=True)
        base = link.parent.resolve()
        relative = target.is_relative_to(base)
        tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        os.symlink(target.relative_to(base) if relative else target, tmp, target_is_directory=True)
        os.replace(tmp, link)
    except OSError as e:
        log.warning("could not point %s at the run (%s): use the run folder's path", link, e.strerror or e)
        return False
    return True


class RunReport:
    """Created when the loop starts (it announces the run); `finish` prints the summary."""

    def __init__(self, cfg, run_dir: Path, world_size: int = 1, start_step: int = 0):
        self.run_dir, self.world_size, self.start_step = run_dir, world_size, start_step
        self.prompt = "def " if cfg.data.name == "stdlib" else "The "   # the default corpus is Python source
        self.started = time.perf_counter()
        self.command = resume_command(run_dir, world_size, hydra_overrides())
        latest = cfg.run.get("latest")
        linked = bool(latest) and in_default_folder() and point_latest(latest, run_dir)
        log.info("run folder: %s%s", shown(run_dir), f" ({shown(latest)} points here)" if linked else "")
        log.info("resume with: %s", self.command)

    def finish(self, step: int, max_steps: int, tokens: int, exit_code: int = 0,
               last_loss: float | None = None) -> list[str]:
        """Log the run's last lines (also returned): a stopped run says how to continue it. The
        train loss is `last_loss`, the last step's (a stop between two logged steps ends past
        the last row of metrics.jsonl), else the last logged one."""
        from training.run.store import CheckpointStore
        from training.run.files import WEIGHTS

        run = read_run(self.run_dir)
        took = duration(time.perf_counter() - self.started)
        ran = step - self.start_step
        what = (f"{step:,} steps" if not self.start_step else f"steps {self.start_step:,} -> {step:,} ({ran:,} this run)")
        best = run.best_val
        train_loss = last_loss if last_loss is not None else run.final_loss
        losses = "".join([f" | train loss {train_loss:.4f}" if train_loss is not None else "",
                          f" | val loss {run.final_val:.4f}" if run.final_val is not None else "",
                          f" (best {best[0]:.4f} at step {best[1]:,})" if best else ""])
        checkpoint, weights = CheckpointStore(self.run_dir).path(step), self.run_dir / WEIGHTS
        files = " | ".join([f"checkpoint: {shown(checkpoint)}"] * checkpoint.is_file()
                           + [f"weights: {shown(weights)}"] * (weights.is_file() and step >= max_steps))
        if exit_code:
            lines = [f"stopped at step {step:,} of {max_steps:,}: {what}, {tokens:,} tokens in {took}{losses}",
                     files, f"continue with: {self.command}"]
        else:
            lines = [f"done: {what}, {tokens:,} tokens in {took}{losses}", files,
                     f"sample: python {shown(REPO / 'scripts' / 'generate.py')} {shlex.quote(shown(self.run_dir))} "
                     f"--prompt {shlex.quote(self.prompt)} --max-new-tokens 200"]
        for line in filter(None, lines):
            log.info("%s", line)
        return lines


def sweep_summary(sweep_dir: str | Path) -> str:
    """The table train.py prints when a sweep (-m) ends: one row per job that logged anything."""
    from training.run.records import comparison, find_runs, text_table

    sweep_dir = Path(sweep_dir)
    try:
        runs = [r for r in find_runs([sweep_dir]) if r.rows]
    except ValueError:
        runs = []
    if not runs:
        return f"sweep {shown(sweep_dir)}: no job logged a step"
    headers, rows = comparison(runs, root=sweep_dir)
    return (f"sweep {shown(sweep_dir)}: {len(runs)} job(s)\n{text_table(headers, rows)}\n"
            f"curves: python {shown(REPO / 'scripts' / 'compare_runs.py')} {shlex.quote(shown(sweep_dir))}")
