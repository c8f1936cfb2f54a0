"""Train a GPT: `python train.py [group=option ...] [key=value ...]`, or on several GPUs
`torchrun --nproc_per_node=N train.py ...` (see README.md).

Exit status: 0 finished; 1 the loss went NaN/inf (no checkpoint written after it); 2 bad input
(config key or value, data path, folder, checkpoint, a run.dir in use), reported in one line before
any step runs, or a write error such as a full disk during training (older checkpoints kept); 130 (Ctrl-C)
or 143 (SIGTERM) stopped at a step boundary after saving a checkpoint: rerun with resume=auto.
"""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from training.config import exit_on_config_error
from training.distributed import close_distributed
from training.trainer import Trainer


def train(cfg: DictConfig) -> int:
    """Set up (bad input -> one line on stderr, exit status 2), then train."""
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
            return trainer.fit()
    finally:
        close_distributed()


@hydra.main(config_path="configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    status = train(cfg)
    if status:
        sys.exit(status)


if __name__ == "__main__":
    with exit_on_config_error():  # Hydra's composition errors (unknown key, group typo): one line, exit 2
        main()
