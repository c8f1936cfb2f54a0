"""Config composition outside `train.py` (scripts, tests) and validation of the loop's own keys.

Each component validates its own config with a reason; this module owns `trainer`, `device`,
`resume` and `seed`. The optimizer validates `optim` (training.optim), the logger `logger`
(training.loggers), the model and data packages their own groups.
"""
from __future__ import annotations

import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

PRECISIONS = ("auto", "bf16", "fp32")
DEVICES = ("auto", "cpu", "cuda")
PARALLEL = ("ddp", "fsdp")   # training.distributed implements them


def compose(overrides: list[str] | None = None, config_name: str = "train") -> DictConfig:
    """The same config `python train.py <overrides>` would see, through Hydra's compose API.

    `run.dir` interpolates Hydra's runtime output dir, which only exists under `@hydra.main`:
    pass `run.dir=...` when the config is used to run something.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()  # tests and scripts may compose repeatedly
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []))


def config_error_line(exc: BaseException) -> str:
    """One line for a Hydra composition error; a group typo keeps Hydra's list of valid options."""
    unknown = re.match(r"Could not override '([^']+)'\.\s+To append to your config use", str(exc))
    if unknown:  # Hydra's hint to append with `+` would make a key no code reads
        return f"unknown config key '{unknown.group(1)}' (`python train.py --cfg job` prints every valid key)"
    text = str(exc).split("Config search path:")[0]
    line = ""
    for raw in text.splitlines():
        item = raw.strip()
        if not item:
            continue
        if raw.startswith("\t"):  # Hydra lists the options of a group one per tab-indented line
            line += (" " if line.endswith(":") else ", ") + item
        else:
            line += ("; " if line else "") + item
    return line or type(exc).__name__


@contextmanager
def exit_on_config_error():
    """Around `@hydra.main`: composition errors (unknown key, group typo, bad override syntax)
    happen before the task function runs; report them in one line and exit 2 like any bad input.

    Hydra prints those itself (several lines, exit 1) unless HYDRA_FULL_ERROR=1 makes it raise;
    a user who set HYDRA_FULL_ERROR=1 gets Hydra's full traceback as usual.
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    user_wants_traceback = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    except (HydraException, OmegaConfBaseException) as exc:
        if user_wants_traceback:
            raise
        print(f"error: {config_error_line(exc)}", file=sys.stderr)
        sys.exit(2)


def is_number(value) -> bool:
    """int or float, not bool (YAML `true` is an int to isinstance)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _require(ok: bool, key: str, value, reason: str) -> None:
    if not ok:
        raise ValueError(f"{key}={value!r}: {reason}")


def _positive_int(cfg: DictConfig, group: str, key: str) -> None:
    value = cfg[key]
    _require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
             f"{group}.{key}", value, "must be a positive integer")


def _non_negative_int(cfg: DictConfig, group: str, key: str) -> None:
    value = cfg[key]
    _require(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
             f"{group}.{key}", value, "must be an integer >= 0 (0 disables)")


def validate_trainer(trainer: DictConfig) -> None:
    """Raise ValueError naming the first bad `trainer.*` value."""
    for key in ("max_steps", "seq_len", "batch_size", "grad_accum", "eval_batches", "keep_ckpts",
                "log_every", "context_parallel"):
        _positive_int(trainer, "trainer", key)
    for key in ("eval_every", "ckpt_every"):
        _non_negative_int(trainer, "trainer", key)
    _require(trainer.precision in PRECISIONS, "trainer.precision", trainer.precision,
             f"expected one of {', '.join(PRECISIONS)}")
    for key in ("compile", "progress"):
        _require(isinstance(trainer[key], bool), f"trainer.{key}", trainer[key], "must be true or false")
    _require(trainer.parallel in PARALLEL, "trainer.parallel", trainer.parallel, f"expected one of {', '.join(PARALLEL)}")
    _require(isinstance(trainer.dist_timeout_s, (int, float)) and not isinstance(trainer.dist_timeout_s, bool)
             and trainer.dist_timeout_s > 0, "trainer.dist_timeout_s", trainer.dist_timeout_s,
             "must be a positive number of seconds")
    peak = trainer.peak_flops
    _require(peak is None or (is_number(peak) and peak > 0), "trainer.peak_flops", peak,
             "must be null (look the GPU up) or a positive FLOP/s figure")


def validate_run(cfg: DictConfig) -> None:
    """Top-level keys plus the cross-group checks no single group can make."""
    _require(cfg.device in DEVICES, "device", cfg.device, f"expected one of {', '.join(DEVICES)}")
    _require(isinstance(cfg.seed, int) and not isinstance(cfg.seed, bool), "seed", cfg.seed,
             "must be an integer")
    _require(cfg.resume is None or (isinstance(cfg.resume, str) and cfg.resume != ""), "resume",
             cfg.resume, "expected null, auto or a checkpoint path")
    validate_trainer(cfg.trainer)
    validate_model(cfg.model, cfg.trainer.seq_len)


def validate_model(model: DictConfig, seq_len: int) -> None:
    """The model group's types and values (before the data is built), and its fit to seq_len.

    A learned position table larger than the training length is refused: its extra rows are
    never trained, and the tiny preset's RoPE-sized max_seq_len would make it 134M parameters.
    A table imported with model.init_from (GPT-2's) was trained whole and is kept at its size.
    """
    from model.config import GPTConfig

    GPTConfig.from_cfg(model, vocab_size=1)  # the tokenizer's size is checked again once it is known
    max_len = model.get("max_seq_len")
    _require(max_len is None or seq_len <= max_len, "trainer.seq_len", seq_len,
             f"exceeds model.max_seq_len={max_len} of model '{model.get('name')}'")
    _require(model.get("pos_emb") != "learned" or model.get("init_from") or max_len <= seq_len, "model.max_seq_len",
             max_len,
             f"with model.pos_emb=learned this is the size of the position table, larger than "
             f"trainer.seq_len={seq_len} needs (rows past it are never trained): pass model.max_seq_len={seq_len}")
