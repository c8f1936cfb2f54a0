"""Where metrics go: `metrics.jsonl` always (training.run.metrics), Weights & Biases with
`logger=wandb`.

One row per logged step: step, loss, lr, tokens, tokens_per_s (mfu on CUDA, val_loss on eval
steps, and passkey_<length> there with trainer.passkey_probe).
"""
from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig

from training.run.files import METRICS
from training.run.metrics import MetricsFile

# What a null config value falls back to when wandb's own environment variable is unset too.
WANDB_FALLBACKS = {"project": ("WANDB_PROJECT", "flashtrain"), "mode": ("WANDB_MODE", "offline"),
                   "entity": ("WANDB_ENTITY", None)}


def wandb_settings(logger: DictConfig) -> dict:
    """project/entity/mode for wandb.init: a value set in the config wins; a null one is left to
    wandb's environment variable when that is set (wandb reads it itself), else our fallback."""
    settings = {}
    for key, (env_var, fallback) in WANDB_FALLBACKS.items():
        value = logger.get(key)
        if value is None and env_var not in os.environ:
            value = fallback
        if value is not None:
            settings[key] = value
    return settings


class WandbRun:
    """A wandb run; given the id stored in a checkpoint it continues that same run."""

    def __init__(self, logger: DictConfig, run_dir: Path, config: dict, run_id: str | None,
                 name: str | None) -> None:
        import wandb

        self._wandb = wandb
        settings = wandb_settings(logger)
        try:
            self.run = wandb.init(**settings, dir=str(run_dir), id=run_id, resume="allow", config=config, name=name,
                                  tags=list(logger.tags),
                                  settings=wandb.Settings(init_timeout=float(logger.get("init_timeout_s", 60.0))))
        except wandb.errors.Error as e:  # no network, no API key: before any step, in one line
            reason = " ".join(str(e).split())[:240] or type(e).__name__
            raise ValueError(f"logger=wandb could not start its {settings.get('mode', 'wandb')} run ({reason}): use "
                             f"logger.mode=offline (and `wandb sync` later), or check the network and "
                             f"WANDB_API_KEY") from None
        self.id = self.run.id

    def log(self, row: dict) -> None:
        self.run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def close(self, exit_code: int = 0) -> None:
        self.run.finish(exit_code=exit_code)


class Loggers:
    """The run's metric sinks behind one `log(row)`: wandb from the start (it is the one that can
    fail, no network, and then the run's files stay untouched), metrics.jsonl once `open_metrics`
    has cut it to the step the run starts from."""

    def __init__(self, cfg: DictConfig, run_dir: Path, config: dict, wandb_id: str | None) -> None:
        self.run_dir = run_dir
        self.wandb = (WandbRun(cfg.logger, run_dir, config, wandb_id, cfg.run.get("name"))
                      if cfg.logger.name == "wandb" else None)
        self.metrics: MetricsFile | None = None

    def open_metrics(self, resume_step: int | None) -> None:
        self.metrics = MetricsFile(self.run_dir / METRICS, resume_step)

    @property
    def wandb_id(self) -> str | None:
        return self.wandb.id if self.wandb else None

    def log(self, row: dict) -> None:
        self.metrics.log(row)
        if self.wandb:
            self.wandb.log(row)

    def close(self, exit_code: int = 0) -> None:
        if self.metrics:
            self.metrics.close()
        if self.wandb:
            self.wandb.close(exit_code)
