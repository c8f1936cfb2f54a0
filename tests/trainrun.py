"""Helpers for the training tests: tiny overrides, in-process and subprocess runs of train.py.

Not a test module itself (no `test_` prefix); the test_train*/test_resume*/test_checkpoint*
modules import it.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TOOLS = {p.stem: p for folder in ("", "bench", "kernel_dev") for p in sorted((REPO / "scripts" / folder).glob("*.py"))
         if not p.stem.startswith("_")}   # every tool by name: user tools, benchmarks, kernel development


def run_script(module, argv: list[str], monkeypatch, capsys) -> str:
    """A tool of scripts/ as `python scripts/<tool>.py argv` runs it, expected to refuse: returns its
    one stderr line (exit status 2). The caller has scripts/ on sys.path, as importing the tool needs."""
    from _common import run_cli

    monkeypatch.setattr(sys, "argv", [module.__file__, *argv])
    with pytest.raises(SystemExit) as exit_info:
        run_cli(module.main)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """A token cache in tmp, shared by the tiny runs (tests never touch the user's cache)."""
    return tmp_path_factory.mktemp("token-cache")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, cache_dir):
    """A finished 4-step tiny run (checkpoint at step 4) for tests that resume from it without changing it."""
    run_dir = tmp_path_factory.mktemp("run")
    assert run_in_process(tiny_overrides(run_dir, cache_dir, steps=4)) == 0
    return run_dir


def tiny_overrides(run_dir, cache_dir, steps: int = 12, **extra) -> list[str]:
    """A CPU run of a fraction of a second per step: 2 layers x 64, seq_len 64, 2 MB of corpus."""
    values = {
        "run.dir": str(run_dir), "data.cache_dir": str(cache_dir), "data.max_bytes": 2_000_000,
        "model.n_layer": 2, "model.d_model": 64, "model.n_head": 4, "model.n_kv_head": 2,
        "trainer.seq_len": 64, "trainer.batch_size": 4, "trainer.max_steps": steps,
        "trainer.log_every": 1, "trainer.eval_every": 0, "trainer.eval_batches": 2,
        "trainer.ckpt_every": 4, "trainer.progress": False, "optim.warmup_steps": 2,
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items() if v is not None]   # None: leave the key out


def run_in_process(overrides: list[str]) -> int:
    """train.py's work without a new interpreter: compose the same config, call train()."""
    import train
    from training.config import compose
    from training.config.errors import config_error_line, is_config_error

    try:
        cfg = compose(overrides)
    except Exception as exc:  # a composition error (unknown key, wrong type): train.py's one line, exit 2
        if not is_config_error(exc):
            raise
        print(f"error: {config_error_line(exc)}", file=sys.stderr)
        return 2
    return train.train(cfg)


def train_command(overrides: list[str]) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), *overrides]


def subprocess_env() -> dict:
    """One intra-op thread: a tiny model gains nothing from more, and on a busy 2-core machine
    spinning OpenMP workers slow it several-fold."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("WANDB_MODE", None)
    return env


def run_subprocess(overrides: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(train_command(overrides), cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=timeout)


def losses(run_dir) -> list[tuple]:
    """(step, loss, val_loss, lr, tokens, grad_norm) per logged row: everything but timings."""
    from training.run.metrics import MetricsFile

    return [(r["step"], r["loss"], r.get("val_loss"), r["lr"], r["tokens"], r["grad_norm"])
            for r in MetricsFile.read(Path(run_dir) / "metrics.jsonl")]
