"""Train a GPT: `python train.py [group=option ...] [key=value ...]`, or on several GPUs
`torchrun --nproc_per_node=N train.py ...` (see README.md).

Exit status: 0 finished; 1 the loss went NaN/inf (no checkpoint written after it); 2 bad input
(config key or value, data path, folder, checkpoint, a run.dir in use), reported in one line before
any step runs, or a write error such as a full disk during training (older checkpoints kept); 130 (Ctrl-C)
or 143 (SIGTERM) stopped at a step boundary after saving a checkpoint: rerun with resume=auto (a second
Ctrl-C stops at once, without saving, also 130, in one line).
"""
from __future__ import annotations

import logging
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from training.config import exit_on_config_error, plain


FAILED_JOBS: list[int] = []  # exit statuses of the failed jobs of a multirun (-m)
SWEEP_DIR: list[str] = []    # a multirun's folder, for the table printed when it ends


def train(cfg: DictConfig, outcome: dict | None = None) -> int:
    """Set up (bad input -> one line on stderr, exit status 2), then train; `outcome` receives the
    final validation loss."""
    from training.distributed import close_distributed  # torch: imported only once a run starts,
    from training.trainer import Trainer                # so `--help` answers at once

    trainer = None
    try:
        try:
            trainer = Trainer(cfg)
        except (ValueError, FileNotFoundError, OmegaConfBaseException) as e:  # CheckpointError is a ValueError
            print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
            return 2
        with trainer.lock:
            if trainer.step >= cfg.trainer.max_steps:
                if trainer.env.is_main:
                    print(f"nothing to do: {trainer.resumed_from} is at step {trainer.step}, trainer.max_steps="
                          f"{cfg.trainer.max_steps} is reached; raise trainer.max_steps to train further",
                          file=sys.stderr)
                return 0
            status = trainer.fit()
            if outcome is not None:
                outcome["val_loss"] = trainer.val_loss
            return status
    except KeyboardInterrupt:  # a second Ctrl-C (or one before the loop): one line, not a traceback; ends a sweep too
        from training.checkpoint import last_checkpoint_note
        note = last_checkpoint_note(trainer.run_dir) if trainer is not None else "nothing was trained yet"
        print(f"error: interrupted: stopped at once, without saving; {note}", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        trainer = None      # let go of the model (DDP/FSDP hold the group) before leaving the group,
        close_distributed()  # which collects it first (see its docstring)


@hydra.main(config_path="configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> float | None:
    """One run; returns its final validation loss (what Hydra's sweepers, e.g. Optuna, minimise).
    In a multirun a failed job is reported and the sweep goes on; the process exits non-zero at the end."""
    outcome: dict = {}
    if HydraConfig.get().mode == RunMode.MULTIRUN and not SWEEP_DIR:
        SWEEP_DIR.append(HydraConfig.get().sweep.dir)
    status = train(plain(cfg), outcome)
    if status and HydraConfig.get().mode == RunMode.MULTIRUN:
        FAILED_JOBS.append(status)
        logging.getLogger("train").error("job %d failed (exit status %d); the sweep goes on",
                                         HydraConfig.get().job.num, status)
        return None
    if status:
        sys.exit(status)
    return outcome.get("val_loss")


def one_folder_per_run(argv: list[str]) -> list[str]:
    """`run.dir=X` also makes X Hydra's output dir (its .hydra/ and train.log), so one run has one
    folder; an explicit hydra.run.dir=..., or a multirun (-m, one folder per job), is left alone."""
    run_dir = [a.split("=", 1)[1] for a in argv if a.startswith("run.dir=")]
    if run_dir and not any(a.startswith("hydra.run.dir=") for a in argv) and not {"-m", "--multirun"} & set(argv):
        return [*argv, f"hydra.run.dir={run_dir[-1]}"]
    return argv


if __name__ == "__main__":
    sys.argv = one_folder_per_run(sys.argv)
    with exit_on_config_error():  # Hydra's composition errors (unknown key, group typo): one line, exit 2
        main()
    if SWEEP_DIR:
        from training.summary import sweep_summary
        print(sweep_summary(SWEEP_DIR[0]), flush=True)
    if FAILED_JOBS:
        sys.exit(max(FAILED_JOBS))
