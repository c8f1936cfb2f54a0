"""End-to-end runs of train.py on a tiny model: outputs, falling loss, NaN stop, bad input, wandb."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import HAS_CUDA
from tests.trainrun import (REPO, cache_dir, losses, run_in_process, run_subprocess, subprocess_env,  # noqa: F401
                            tiny_overrides, train_command)   # (cache_dir is a fixture)
from training.process import exits
from training.run.store import CheckpointStore, load_checkpoint


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_dir):
    """One 40-step run shared by the output checks below."""
    run_dir = tmp_path_factory.mktemp("run")
    status = run_in_process(tiny_overrides(run_dir, cache_dir, steps=40, **{
        "trainer.eval_every": 20, "trainer.ckpt_every": 10, "trainer.keep_ckpts": 2, "trainer.log_every": 5,
        "optim.lr": 3e-3}))
    assert status == 0
    return run_dir


def test_tiny_run_lowers_the_loss(trained):
    rows = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert all({"step", "loss", "lr", "tokens", "tokens_per_s", "grad_norm"} <= r.keys() for r in rows)
    assert "mfu" not in rows[0]  # CPU: no peak to divide by
    assert [r["step"] for r in rows if "val_loss" in r] == [20, 40]
    assert rows[-1]["tokens"] == 40 * 4 * 64
    # bytes start near ln(257) = 5.55; forty steps of a tiny model must get well below that
    assert rows[0]["loss"] > rows[-1]["loss"] + 1.0
    assert rows[-1]["val_loss"] < 4.5


def test_run_dir_holds_resolved_config_and_last_checkpoints(trained):
    cfg = OmegaConf.load(trained / "config.yaml")
    assert cfg.attention.name == "sdpa" and cfg.device == "cpu" and cfg.trainer.precision == "fp32"
    assert cfg.run.data_fingerprint.startswith("stdlib") and cfg.run.num_params > 0
    assert [p.name for p in CheckpointStore(trained).list()] == ["step_00000030.pt", "step_00000040.pt"]
    assert not list((trained / "checkpoints").glob("*.tmp"))
    state = load_checkpoint(trained / "checkpoints" / "step_00000040.pt")
    assert state["step"] == 40 and state["tokens"] == 40 * 4 * 64
    assert not any(k.startswith("_orig_mod.") for k in state["model"])
    assert {"python", "numpy", "torch", "cuda"} <= state["rng"].keys()
    assert state["sampler"] and state["config"]["run"]["data_fingerprint"] == cfg.run.data_fingerprint


def test_load_model_for_eval_reproduces_the_logged_val_loss(trained):
    from training.builders import build_data
    from training.builders import load_model_for_eval
    from training.loop.evaluate import evaluate_loss

    model, cfg, tokenizer = load_model_for_eval(trained / "checkpoints" / "step_00000040.pt", device="cpu")
    assert not model.training and tokenizer.decode(tokenizer.encode("def f(): pass")) == "def f(): pass"
    batches = build_data(cfg, seq_len=cfg.trainer.seq_len, seed=cfg.seed).val_batches(cfg.trainer.batch_size,
                                                                                     cfg.trainer.eval_batches)
    logged = json.loads((trained / "metrics.jsonl").read_text().splitlines()[-1])["val_loss"]
    assert evaluate_loss(model, batches, torch.device("cpu"), "fp32") == logged


def test_nan_loss_stops_without_overwriting_the_good_checkpoint(tmp_path, cache_dir, capsys):
    # lr=1e4 without clipping blows the weights up within a few steps, after the step-2 checkpoint
    status = run_in_process(tiny_overrides(tmp_path, cache_dir, steps=40, **{
        "optim.lr": 1e4, "optim.min_lr": 0, "optim.warmup_steps": 0, "optim.grad_clip": 0,
        "trainer.ckpt_every": 2, "trainer.keep_ckpts": 50}))
    assert status == 1
    assert "NaN/inf" in capsys.readouterr().err
    rows = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())]
    ckpts = CheckpointStore(tmp_path).list()
    assert ckpts and len(rows) < 40
    for path in ckpts:
        state = load_checkpoint(path)
        assert all(torch.isfinite(v).all() for v in state["model"].values()), path


BAD_INPUT = [
    ({"model.d_model": 66}, "model.d_model=66 is not divisible by model.n_head=4"),
    ({"model.max_seq_len": 32}, "trainer.seq_len=64: exceeds model.max_seq_len=32"),
    ({"trainer.batch_size": 0}, "trainer.batch_size=0: must be a positive integer"),
    ({"trainer.grad_accum": -1}, "trainer.grad_accum=-1: must be a positive integer"),
    ({"trainer.max_steps": 0}, "trainer.max_steps=0: must be a positive integer"),
    ({"optim.min_lr": 1.0}, "optim.min_lr=1.0: must lie in [0, optim.lr="),
    ({"attention.name": "bogus"}, "attention 'bogus' is not registered"),
    ({"attention.kernel": "cudnn"}, "attention.kernel='cudnn': expected one of auto, triton, gluon"),
    ({"attention": "sdpa", "attention.kernel": "gluon"}, "attention.kernel=gluon chooses attention=flash's kernels"),
    ({"device": "tpu"}, "device='tpu': expected one of auto, cpu, cuda"),
    ({"logger.name": "tensorboard"}, "logger.name='tensorboard': expected one of none, wandb"),
    ({"data": "files", "data.max_bytes": None, "data.paths": "[/nonexistent/corpus]"}, "/nonexistent/corpus does not exist"),
    ({"data.name": "files"}, "unknown config key 'data.max_bytes'"),   # stdlib's keys under files' name
    ({"+trainer.foo": 1}, "unknown config key 'trainer.foo'"),        # appended past Hydra, refused by the check
    ({"resume": "/nonexistent/step_00000004.pt"}, "checkpoint /nonexistent/step_00000004.pt does not exist"),
]


@pytest.mark.parametrize("override,message", BAD_INPUT, ids=[next(iter(o)) for o, _ in BAD_INPUT])
def test_bad_input_is_one_line_before_any_step(tmp_path, cache_dir, capsys, override, message):
    assert run_in_process(tiny_overrides(tmp_path / "run", cache_dir, **override)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1], err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.skipif(HAS_CUDA, reason="checks the error for a machine without CUDA")
def test_cuda_requested_without_cuda(tmp_path, cache_dir, capsys):
    assert run_in_process(tiny_overrides(tmp_path, cache_dir, device="cuda")) == 2
    assert "device='cuda' but torch sees no CUDA device" in capsys.readouterr().err


def test_unknown_config_key_from_the_command_line(tmp_path, cache_dir):
    result = run_subprocess(tiny_overrides(tmp_path, cache_dir, **{"trainer.bogus": 1}))
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == ["error: unknown config key 'trainer.bogus' (`python train.py --cfg job` prints every valid key)"]


def test_wandb_offline_run_resumes_the_same_wandb_run(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb_overrides = {"logger": "wandb", "logger.mode": "offline", "trainer.ckpt_every": 2}
    assert run_in_process(tiny_overrides(tmp_path, cache_dir, steps=2, **wandb_overrides)) == 0
    first = load_checkpoint(tmp_path / "checkpoints" / "step_00000002.pt")["wandb_id"]
    assert first and list((tmp_path / "wandb").glob(f"offline-run-*-{first}"))
    assert run_in_process(tiny_overrides(tmp_path, cache_dir, steps=4, resume="auto", allow_changes="[trainer.max_steps]",
                                         **wandb_overrides)) == 0
    assert load_checkpoint(tmp_path / "checkpoints" / "step_00000004.pt")["wandb_id"] == first
    assert len(losses(tmp_path)) == 4 and not math.isnan(losses(tmp_path)[-1][1])


def test_wandb_settings_defer_to_wandbs_environment(monkeypatch):
    """Unset config values leave WANDB_PROJECT / WANDB_ENTITY / WANDB_MODE to wandb; set ones win."""
    from omegaconf import OmegaConf

    from training.loop.loggers import wandb_settings
    for var in ("WANDB_PROJECT", "WANDB_ENTITY", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    unset = OmegaConf.create({"project": None, "entity": None, "mode": None})
    assert wandb_settings(unset) == {"project": "flashtrain", "mode": "offline"}
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("WANDB_PROJECT", "mine")
    assert wandb_settings(unset) == {}  # wandb.init reads its own variables
    assert wandb_settings(OmegaConf.create({"project": "p", "entity": "e", "mode": "online"})) == \
        {"project": "p", "entity": "e", "mode": "online"}


def test_resume_auto_without_run_dir_is_refused(tmp_path, cache_dir):
    """Without run.dir every run gets a fresh folder: resume=auto would silently start from step 0."""
    overrides = [o for o in tiny_overrides(tmp_path, cache_dir) if not o.startswith("run.dir=")]
    proc = run_subprocess([*overrides, "resume=auto", f"hydra.run.dir={tmp_path / 'hydra'}"])  # not in the checkout
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: resume=auto needs run.dir=")


def test_a_refused_run_leaves_no_empty_default_folder(tmp_path, cache_dir):
    """Without run.dir Hydra makes outputs/<date>/<time> before the run is checked; a refusal takes
    the empty folders back (a folder holding anything stays)."""
    overrides = [o for o in tiny_overrides(tmp_path, cache_dir) if not o.startswith(("run.dir=", "trainer.batch_size="))]
    (tmp_path / "work" / "outputs" / "kept").mkdir(parents=True)
    proc = subprocess.run(train_command([*overrides, "trainer.batch_size=0"]), cwd=tmp_path / "work",
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "trainer.batch_size=0" in proc.stderr
    assert sorted(p.relative_to(tmp_path / "work") for p in (tmp_path / "work").rglob("*")) == [Path("outputs"), Path("outputs/kept")]


def test_no_progress_bar_frames_when_stderr_is_not_a_terminal(tmp_path, cache_dir):
    proc = run_subprocess(tiny_overrides(tmp_path, cache_dir, steps=3, **{"trainer.progress": True}))
    assert proc.returncode == 0, proc.stderr
    assert "step/s" not in proc.stderr and "s/step" not in proc.stderr and "\r" not in proc.stderr


def test_multirun_reports_a_failed_job_and_runs_the_rest(tmp_path, cache_dir):
    """A bad value in any job refuses the sweep before its first job trains; a job that fails once
    running (here: a window longer than the corpus) does not end the sweep, and the exit status
    still says one failed."""
    overrides = [o for o in tiny_overrides(tmp_path, cache_dir, steps=2) if not o.startswith(("run.dir=",
                                                                                              "trainer.batch_size=",
                                                                                              "trainer.seq_len=",
                                                                                              "data.max_bytes="))]
    overrides.append("data.max_bytes=300000")   # ~0.3M tokens: a window of 900,000 fits the model, not the corpus
    sweep = f"hydra.sweep.dir={tmp_path}/sweep"
    proc = run_subprocess(["-m", *overrides, "trainer.seq_len=64", "trainer.batch_size=4,0", sweep])
    assert proc.returncode == 2 and not (tmp_path / "sweep").exists()
    assert proc.stderr.strip().splitlines()[-1] == ("error: trainer.batch_size=0: must be a positive integer (the "
                                                    "sweep's job with trainer.batch_size=0; no job has run)")
    proc = run_subprocess(["-m", *overrides, "trainer.batch_size=4", "trainer.seq_len=900000,64", sweep])
    assert proc.returncode == 2
    assert "job 0 failed (exit status 2)" in proc.stdout + proc.stderr
    assert (tmp_path / "sweep" / "1" / "metrics.jsonl").is_file()  # job 1 ran after job 0 failed


def test_a_flag_between_overrides_is_one_line(tmp_path):
    """Hydra's parser takes the overrides before a flag and fails on those after it, printing its
    whole usage; the line says where flags go. A flag after the last override still works."""
    proc = subprocess.run(train_command(["model=tiny", "-m", "trainer.batch_size=2,1"]), cwd=tmp_path,
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: -m stands between overrides: flags go first (python train.py -m key=value ...)")
    assert not (tmp_path / "outputs").exists()
    proc = subprocess.run(train_command(["model=tiny", "--cfg", "job"]), cwd=tmp_path, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "n_layer: 4" in proc.stdout, proc.stderr


def test_run_dir_holds_hydras_files_too(tmp_path, cache_dir):
    """One run, one folder: with run.dir set, Hydra's .hydra/ and train.log land there as well."""
    proc = run_subprocess(tiny_overrides(tmp_path / "run", cache_dir, steps=1))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "run" / ".hydra" / "overrides.yaml").is_file() and (tmp_path / "run" / "train.log").is_file()
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def test_help_says_what_the_tool_does_without_importing_torch():
    """`--help` answers at once: the tool, the groups, the exit statuses, and no torch import."""
    proc = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "train.py"), "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    assert "flashtrain: train a GPT" in proc.stdout and exits.help_text() in proc.stdout   # the one table
    assert "attention: auto, flash, naive, sdpa" in proc.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "torch" not in imported and "triton" not in imported


def test_cpu_threads_are_chosen_for_the_machine_and_said_at_start(tmp_path, cache_dir, caplog, monkeypatch):
    """torch's default, a thread per core, ran 20x slower on a busy 2-core machine than one thread."""
    from training.process.device import cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr("os.getloadavg", lambda: (2.6, 1.0, 1.0))
    assert cpu_threads(None) == (1, "4 cores, 2.6 of them busy with other work (load average); "
                                    "trainer.cpu_threads=N sets it")
    assert cpu_threads(None, local_processes=2)[0] == 1 and cpu_threads(None, resumed=3)[0] == 3
    monkeypatch.setattr("os.getloadavg", lambda: (0.2, 1.0, 1.0))
    assert cpu_threads(None)[0] == 4 and cpu_threads(None, local_processes=2)[0] == 2
    assert cpu_threads(3, resumed=2) == (3, "trainer.cpu_threads")
    with pytest.raises(ValueError, match=r"trainer.cpu_threads=5: this process may use 4 cores; set at most 4"):
        cpu_threads(5)   # more threads than cores only wait on each other
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpu_threads(None, resumed=3) == (2, "OMP_NUM_THREADS=2")

    threads = torch.get_num_threads()
    try:
        caplog.set_level("INFO")
        assert run_in_process(tiny_overrides(tmp_path, cache_dir, steps=1)) == 0
        assert "CPU threads: 2 (OMP_NUM_THREADS=2)" in caplog.text and torch.get_num_threads() == 2
        assert OmegaConf.load(tmp_path / "config.yaml").trainer.cpu_threads == 2   # the checkpoints record it too
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert run_in_process(tiny_overrides(tmp_path, cache_dir, steps=2, resume="auto",
                                             allow_changes="[trainer.max_steps]")) == 0
        assert "CPU threads: 2 (as the run it continues; trainer.cpu_threads=N sets another)" in caplog.text
    finally:
        torch.set_num_threads(threads)
