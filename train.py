"""Train a GPT: `python train.py [group=option ...] [key=value ...]`, or on several GPUs
`torchrun --nproc_per_node=N train.py ...` (see docs/parallel.md).

Its exit statuses are training/process/exits.py's table (`python train.py --help` prints it).
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Callable

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from training.config import check_sweep, composed_variants, hydra_callbacks, plain
from training.config.errors import exit_on_config_error
from training.config.errors import report_error as report
from training.process.exits import INTERRUPTED, help_text
from training.process.signals import exit_at_once_on_ctrl_c, ignore_ctrl_c_as_python_exits


FAILED_JOBS: list[int] = []  # exit statuses of the failed jobs of a multirun (-m)
SWEEP_DIR: list[str] = []    # a multirun's folder, for the table printed when it ends
ALLOW_CALLBACKS = "FLASHTRAIN_ALLOW_HYDRA_CALLBACKS"   # =1: run the hydra.callbacks a config names


def train(cfg: DictConfig, outcome: dict | None = None, on_start: Callable[[], Callable | None] | None = None) -> int:
    """Set up (bad input -> one line on stderr, exit status 2), then train; `outcome` receives the
    final validation loss. `on_start` runs on rank 0 once the run is accepted (train.py keeps
    Hydra's files then); it may return a function to run when the run ends."""
    from training.parallel.distributed import RankError, close_distributed  # torch: imported only once a run starts,
    from training.process.faults import fault_line                         # so `--help` answers at once
    from training.loop.trainer import Trainer

    trainer, finish = None, None
    try:
        try:
            trainer = Trainer(cfg)
        except (ValueError, FileNotFoundError, OmegaConfBaseException) as e:  # CheckpointError is a ValueError
            return report(str(e), every_rank=isinstance(e, RankError))
        except Exception as e:  # noqa: BLE001 (the machine's faults in one line; anything else is a bug)
            line = fault_line(e)
            if line is None:
                raise
            return report(line, every_rank=True)
        with trainer.lock:
            if trainer.step >= cfg.trainer.max_steps:
                try:
                    trainer.export_missing_weights()
                except OSError as e:
                    return report(fault_line(e) or str(e), every_rank=True)
                if trainer.plan.is_main:
                    print(f"nothing to do: {trainer.resumed_from} is at step {trainer.step}, trainer.max_steps="
                          f"{cfg.trainer.max_steps} is reached; raise trainer.max_steps to train further",
                          file=sys.stderr)
                return 0
            if on_start is not None and trainer.plan.is_main:
                finish = on_start()
            status = trainer.fit()
            if outcome is not None:
                outcome["val_loss"] = trainer.val_loss
            return status
    except KeyboardInterrupt:  # a second Ctrl-C (or one before the loop): one line, not a traceback; ends a sweep too
        note = trainer.note() if trainer is not None and hasattr(trainer, "start") else "nothing was trained yet"
        print(f"error: interrupted: stopped at once, without saving; {note}", file=sys.stderr)
        raise SystemExit(INTERRUPTED) from None
    finally:
        if finish is not None:
            finish()
        trainer = None      # let go of the model (DDP/FSDP hold the group) before leaving the group,
        close_distributed()  # which collects it first (see its docstring)


@hydra.main(config_path="configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> float | None:
    """One run; returns its final validation loss (what Hydra's sweepers, e.g. Optuna, minimise).
    In a multirun a failed job is reported and the sweep goes on; the process exits non-zero at the end."""
    outcome: dict = {}
    if HydraConfig.get().mode == RunMode.MULTIRUN and not SWEEP_DIR:
        SWEEP_DIR.append(HydraConfig.get().sweep.dir)
    hydra_cfg, task_yaml = HydraConfig.get(), OmegaConf.to_yaml(cfg)
    status = train(plain(cfg), outcome, on_start=lambda: keep_hydra_files(hydra_cfg, task_yaml))
    if status and HydraConfig.get().mode == RunMode.MULTIRUN:
        FAILED_JOBS.append(status)
        logging.getLogger("train").error("job %d failed (exit status %d); the sweep goes on",
                                         HydraConfig.get().job.num, status)
        return None
    if status:
        from training.run.report import in_default_folder

        if in_default_folder():   # a refused run leaves no empty outputs/<date>/<time> behind
            drop_empty(Path(hydra_cfg.runtime.output_dir).resolve(), Path.cwd().resolve())
        sys.exit(status)
    return outcome.get("val_loss")


def drop_empty(folder: Path, stop: Path) -> None:
    """Remove `folder`, then its parents below `stop`, while each is empty (nothing outside `stop`)."""
    while stop in folder.parents:
        try:
            folder.rmdir()   # only an empty folder goes
        except OSError:
            return
        folder = folder.parent


def keep_hydra_files(hydra_cfg: DictConfig, task_yaml: str) -> Callable[[], None]:
    """What Hydra writes itself into its output dir (configs/train.yaml turns that off: it would
    happen before the run is checked, and a refused run must not touch an existing run's files),
    written once the run is accepted: .hydra/{config,hydra,overrides}.yaml and the log file.
    Returns what detaches the log file when the run ends."""
    from training.run.files import open_append, write_text

    out = Path(hydra_cfg.runtime.output_dir)
    (out / ".hydra").mkdir(parents=True, exist_ok=True)
    write_text(out / ".hydra" / "config.yaml", task_yaml)
    write_text(out / ".hydra" / "hydra.yaml", OmegaConf.to_yaml({"hydra": hydra_cfg}))
    write_text(out / ".hydra" / "overrides.yaml", OmegaConf.to_yaml(list(hydra_cfg.overrides.task)))
    root = logging.getLogger()
    handler = logging.StreamHandler(open_append(out / f"{hydra_cfg.job.name}.log"))
    handler.setFormatter(root.handlers[0].formatter if root.handlers else logging.Formatter(LOG_FORMAT))
    root.addHandler(handler)

    def detach() -> None:
        root.removeHandler(handler)
        handler.close()
        handler.stream.close()
    return detach


LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"   # Hydra's own


def check_before_hydra(argv: list[str]) -> None:
    """What must be refused before Hydra starts (it creates run.dir and instantiates callbacks
    first): a key given twice, a run.dir that cannot be a folder, and hydra.callbacks from a config (code)."""
    from training.config import repeated_override

    repeated = repeated_override(argv)
    if repeated:
        sys.exit(report(repeated))
    overrides = [i for i, a in enumerate(argv) if "=" in a and not a.startswith("-")]
    between = next((a for i, a in enumerate(argv) if a.startswith("-") and overrides and overrides[0] < i < overrides[-1]), None)
    if between is not None:   # Hydra's parser takes the overrides before it and fails on those after, printing its usage
        sys.exit(report(f"{between} stands between overrides: flags go first (python train.py {between} key=value ...)"))
    for value in (a.split("=", 1)[1] for a in argv if a.startswith("run.dir=")):
        folder = Path(value).expanduser()
        if not value.strip():
            sys.exit(report("run.dir='': expected a folder for the run"))
        if folder.exists() and not folder.is_dir():
            sys.exit(report(f"run.dir={value} is not a folder"))
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            sys.exit(report(f"run.dir={value} cannot be created ({e.strerror or e})"))
    flags = [a for a in argv if a.startswith("-") and a not in ("-m", "--multirun")]
    if flags:  # --help, --cfg, another config (-cn, -cp): not a run of ours
        return
    multirun, allowed = bool({"-m", "--multirun"} & set(argv)), os.environ.get(ALLOW_CALLBACKS) == "1"
    if allowed and not multirun:
        return
    configs = composed_variants([a for a in argv if "=" in a])   # each job (each value, past 32), composed once
    names = [] if allowed else hydra_callbacks(configs)
    if names:
        sys.exit(report(f"hydra.callbacks ({', '.join(names)}) would run code named in a config file before "
                        f"training starts; flashtrain runs them only with {ALLOW_CALLBACKS}=1 (docs/training.md, 'Configs are code')"))
    bad = check_sweep(configs) if multirun else None   # every job's values, before the first job trains
    if bad:
        sys.exit(report(bad))


def one_folder_per_run(argv: list[str]) -> list[str]:
    """`run.dir=X` also makes X Hydra's output dir (its .hydra/ and train.log), so one run has one
    folder; an explicit hydra.run.dir=..., or a multirun (-m, one folder per job), is left alone."""
    run_dir = [a.split("=", 1)[1] for a in argv if a.startswith("run.dir=")]
    if run_dir and not any(a.startswith("hydra.run.dir=") for a in argv) and not {"-m", "--multirun"} & set(argv):
        return [*argv, f"hydra.run.dir={run_dir[-1]}"]
    return argv


if __name__ == "__main__":
    ignore_ctrl_c_as_python_exits()
    OmegaConf.register_new_resolver("exit_statuses", help_text)   # configs/train.yaml's --help lists them
    try:
        sys.argv = one_folder_per_run(sys.argv)
        with exit_on_config_error():  # Hydra's composition errors (unknown key, group typo): one line, exit 2
            check_before_hydra(sys.argv[1:])
            main()
        if SWEEP_DIR:
            from training.run.report import sweep_summary
            print(sweep_summary(SWEEP_DIR[0]), flush=True)
        if FAILED_JOBS:
            sys.exit(max(FAILED_JOBS))
    except KeyboardInterrupt:  # one train() did not turn into its line: in its clean-up, or in Hydra's code around it
        exit_at_once_on_ctrl_c()
        print("error: interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED)
    finally:
        exit_at_once_on_ctrl_c()   # the run has ended and said how; a further Ctrl-C: status 130 at once
