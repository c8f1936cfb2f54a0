"""Interrupt a real `python train.py` and resume it: the losses must match an uninterrupted run
bit for bit (CPU, float32), whether it was SIGKILLed, SIGTERMed or Ctrl-C'd, and resume=auto
must step over a checkpoint that was cut short."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.trainrun import cache_dir  # noqa: F401 (a fixture)
from tests.trainrun import REPO, losses, run_in_process, run_subprocess, subprocess_env, tiny_overrides, train_command
from training.run.store import CheckpointStore, load_checkpoint

STEPS = 100  # long enough (about a second) that the interrupt reliably lands mid-run
# A corpus of 77 steps an epoch (621 windows of 64 tokens, 8 a step): the resumed runs cross into
# epoch 1, whose moving windows start at another offset.
EPOCHS = {"data.max_bytes": 20_000, "trainer.batch_size": 8}


def run_on_one_thread(overrides: list[str]) -> int:
    """An uninterrupted run in this process (no Python and torch to start up, as a subprocess has): on one
    thread, as the interrupted subprocesses run (OMP_NUM_THREADS=1), so the same computation to
    the bit. This process's thread count is put back afterwards."""
    threads = torch.get_num_threads()
    try:
        return run_in_process([*overrides, "trainer.cpu_threads=1"])
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir):
    """The uninterrupted run every interrupted one is compared with."""
    run_dir = tmp_path_factory.mktemp("reference")
    assert run_on_one_thread(tiny_overrides(run_dir, cache_dir, steps=STEPS, **EPOCHS, **{"trainer.ckpt_every": 5})) == 0
    rows = losses(run_dir)
    assert [r[0] for r in rows] == list(range(1, STEPS + 1))
    return rows


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def start_and_signal(overrides: list[str], run_dir: Path, sig: int, after_steps: int, env: dict | None = None,
                     as_timeout: bool = False, start_s: float = 120) -> int:
    """Start train.py, send `sig` once `after_steps` rows are logged (within `start_s`), return its exit
    status. `env` on top of the tests' environment; `as_timeout`: sent as `timeout` sends it, to the
    process and then to its process group (of its own)."""
    proc = subprocess.Popen(train_command(overrides), cwd=REPO, env={**subprocess_env(), **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=as_timeout)
    deadline = time.monotonic() + start_s
    while logged_steps(run_dir) < after_steps and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert proc.poll() is None, f"train.py ended before it could be interrupted: {proc.stderr.read()}"
    proc.send_signal(sig)
    if as_timeout:
        os.killpg(proc.pid, sig)
    proc.wait(timeout=60)
    return proc.returncode


def test_sigkill_then_resume_auto_is_bit_identical(tmp_path, cache_dir, reference):
    overrides = tiny_overrides(tmp_path, cache_dir, steps=STEPS, resume="auto", **EPOCHS, **{"trainer.ckpt_every": 5})
    assert start_and_signal(overrides, tmp_path, signal.SIGKILL, after_steps=12) == -signal.SIGKILL
    killed_at = logged_steps(tmp_path)
    assert 12 <= killed_at < STEPS
    result = run_subprocess(overrides)  # the same command again
    assert result.returncode == 0, result.stderr
    assert losses(tmp_path) == reference
    sampler = load_checkpoint(CheckpointStore(tmp_path).list()[-1])["sampler"]
    assert sampler["windows"] == "moving" and sampler["epoch"] == 1   # the default; across an epoch boundary


@pytest.mark.parametrize("sig,status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_graceful_stop_saves_then_resume_is_bit_identical(tmp_path, cache_dir, reference, sig, status):
    # no periodic checkpoints: the only one before the end is the one the signal makes
    overrides = tiny_overrides(tmp_path, cache_dir, steps=STEPS, resume="auto", **EPOCHS, **{"trainer.ckpt_every": 0})
    assert start_and_signal(overrides, tmp_path, sig, after_steps=7) == status
    saved = CheckpointStore(tmp_path).list()
    assert len(saved) == 1
    stopped_at = int(saved[0].stem.split("_")[1])
    assert 7 <= stopped_at < STEPS and logged_steps(tmp_path) == stopped_at
    result = run_subprocess(overrides)
    assert result.returncode == 0, result.stderr
    assert losses(tmp_path) == reference


# What LLVM does the first time Triton compiles a kernel in a process: its own handler on SIGTERM,
# at the C level, where Python's record of the handler does not see it. Here the signal's default
# action (the process ends) stands in for LLVM's, which on an H100 ended train.py without its
# checkpoint. It is put in place during step 3, and SIGTERM sent during step 5.
NATIVE_HANDLER_THEN_SIGTERM = """
import ctypes
from training.loop.trainer import Trainer
libc = ctypes.CDLL(None)
libc.signal.restype = ctypes.c_void_p
next_batch, calls = Trainer.next_batch, [0]
def patched(self):
    calls[0] += 1
    if calls[0] == 3:
        libc.signal(signal.SIGTERM, ctypes.c_void_p(0))   # SIG_DFL, behind Python's back
    if calls[0] == 5:
        os.kill(os.getpid(), signal.SIGTERM)
    return next_batch(self)
Trainer.next_batch = patched
"""


def test_sigterm_saves_after_native_code_replaced_the_handler(tmp_path, cache_dir):
    overrides = tiny_overrides(tmp_path, cache_dir, steps=20, **{"trainer.ckpt_every": 0})
    result = run_killed_at(overrides, NATIVE_HANDLER_THEN_SIGTERM)
    assert result.returncode == 143, result.stderr[-2000:]
    assert [p.name for p in CheckpointStore(tmp_path).list()] == ["step_00000005.pt"]
    assert "SIGTERM received: checkpoint saved at step 5" in result.stdout + result.stderr


# A run's first step on a GPU compiles our kernels, and LLVM's handlers went in then (its handler resets
# to the default action as it runs, so `timeout`'s second SIGTERM, to the process group, could end the
# run). Here the step compiles kernels for sm_90 instead, in an empty Triton cache, and checks that
# SIGTERM's C-level handler is the one it had before: without `let_llvm_register_first` it is LLVM's.
# It then sends SIGTERM twice, as `timeout` does. (Sent from the step's own thread, the two arrive one
# after the other, and on the CPU LLVM's handler passes each on to Python's too: the handler check is
# what would fail.)
FIRST_COMPILE_THEN_TWO_SIGTERMS = """
import ctypes
from training.loop.trainer import Trainer
libc = ctypes.CDLL(None)
class SigAction(ctypes.Structure):
    _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * 16), ("flags", ctypes.c_int),
                ("restorer", ctypes.c_void_p)]
def sigterm_action():
    action = SigAction()
    libc.sigaction(signal.SIGTERM, None, ctypes.byref(action))
    return action.handler, action.flags
next_batch, calls = Trainer.next_batch, [0]
def patched(self):
    calls[0] += 1
    if calls[0] == 1:
        from kernels.gluon.backward import compile_aux_for_sm90
        before = sigterm_action()
        compile_aux_for_sm90(64)
        print("SIGTERM's handler through the first compile:", "kept" if sigterm_action() == before else "replaced")
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
    return next_batch(self)
Trainer.next_batch = patched
"""


def test_sigterm_in_the_step_that_first_compiles_a_kernel_saves(tmp_path, cache_dir, monkeypatch):
    """The stop handlers go in after LLVM's (training/process/signals.py): a first compile
    mid-step leaves them in place, and two SIGTERMs in that step save it and exit 143."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))   # nothing compiled yet
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)              # compiled, not interpreted
    run = tmp_path / "run"
    result = run_killed_at(tiny_overrides(run, cache_dir, steps=20, **{"trainer.ckpt_every": 0}),
                           FIRST_COMPILE_THEN_TWO_SIGTERMS)
    output = result.stdout + result.stderr
    assert "SIGTERM's handler through the first compile: kept" in output, output[-2000:]
    assert result.returncode == 143, output[-2000:]
    assert [p.name for p in CheckpointStore(run).list()] == ["step_00000001.pt"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: Triton compiles through LLVM there")
def test_sigterm_saves_in_a_process_that_compiled_its_triton_kernels(tmp_path, cache_dir):
    """The case itself: our kernel in an empty Triton cache, so the run's first step compiles it, and
    SIGTERM sent as `timeout` sends it, to the process and then to its process group."""
    run = tmp_path / "run"
    overrides = tiny_overrides(run, cache_dir, steps=10_000, attention="flash", **{"trainer.ckpt_every": 0})
    assert start_and_signal(overrides, run, signal.SIGTERM, after_steps=3, env={"TRITON_CACHE_DIR": str(tmp_path / "triton")},
                            as_timeout=True, start_s=300) == 143   # the first steps compile and tune
    assert len(CheckpointStore(run).list()) == 1


# Attention dropout in our kernel (Triton's interpreter on the CPU, so a smaller model): its masks
# come from a seed each call draws from torch's generator, whose state checkpoints keep.
DROPOUT = {"attention": "flash", "model.attention_dropout": 0.2, "model.n_layer": 1, "model.d_model": 32,
           "model.n_head": 2, "model.n_kv_head": 1, "trainer.seq_len": 32, "trainer.batch_size": 2,
           "trainer.ckpt_every": 2}
DROPOUT_STEPS = 8


def test_sigkill_then_resume_is_bit_identical_with_attention_dropout(tmp_path, cache_dir):
    reference_dir = tmp_path / "reference"
    assert run_on_one_thread(tiny_overrides(reference_dir, cache_dir, steps=DROPOUT_STEPS, **DROPOUT)) == 0
    run_dir = tmp_path / "killed"
    overrides = tiny_overrides(run_dir, cache_dir, steps=DROPOUT_STEPS, resume="auto", **DROPOUT)
    assert start_and_signal(overrides, run_dir, signal.SIGKILL, after_steps=4) == -signal.SIGKILL
    assert 4 <= logged_steps(run_dir) < DROPOUT_STEPS
    result = run_subprocess(overrides)
    assert result.returncode == 0, result.stderr
    assert losses(run_dir) == losses(reference_dir)


def test_resume_auto_skips_truncated_and_garbage_checkpoints(tmp_path, cache_dir, caplog):
    overrides = tiny_overrides(tmp_path, cache_dir, steps=12, **{"trainer.keep_ckpts": 3})
    assert run_in_process(overrides) == 0
    uninterrupted = losses(tmp_path)
    ckpts = CheckpointStore(tmp_path).list()
    assert [p.name for p in ckpts] == ["step_00000004.pt", "step_00000008.pt", "step_00000012.pt"]
    newest = ckpts[-1].read_bytes()
    ckpts[-1].write_bytes(newest[: len(newest) // 2])  # a copy cut short mid-write
    ckpts[-2].write_bytes(b"\0garbage" * 100)
    assert run_in_process(overrides[:-1] + ["trainer.keep_ckpts=3", "resume=auto"]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("step_00000012.pt" in w and "unreadable" in w for w in warnings), warnings
    assert any("step_00000008.pt" in w and "unreadable" in w for w in warnings), warnings
    assert losses(tmp_path) == uninterrupted  # resumed from step 4, redid 5..12 identically
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))


def test_resume_from_an_explicit_checkpoint_path(tmp_path, cache_dir):
    overrides = tiny_overrides(tmp_path, cache_dir, steps=8)
    assert run_in_process(overrides) == 0
    uninterrupted = losses(tmp_path)
    assert run_in_process(overrides + [f"resume={tmp_path / 'checkpoints' / 'step_00000004.pt'}"]) == 0
    assert losses(tmp_path) == uninterrupted


# --------------------------------------------------------------------------- kill -9 at a chosen moment

def run_killed_at(overrides: list[str], patch: str) -> subprocess.CompletedProcess:
    """train.py with `patch` (Python run first, in the same process) SIGKILLing it at the moment it
    names: the window is reached every time, not by timing."""
    script = ("import os, runpy, signal, sys\n" + patch +
              f"sys.argv = ['train.py', *{overrides!r}]\n"
              "runpy.run_path('train.py', run_name='__main__')\n")
    return subprocess.run([sys.executable, "-c", script], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=120)


KILL_AT_THE_FIRST_CHECKPOINT_SET_ASIDE = """
replace = os.replace
def replace_then_die(src, dst, *args, **kwargs):
    if "superseded" in str(dst) and "checkpoints" in str(dst):   # metrics already cut, checkpoints not yet moved
        os.kill(os.getpid(), signal.SIGKILL)
    return replace(src, dst, *args, **kwargs)
os.replace = replace_then_die
"""


def test_a_rewind_killed_half_way_is_finished_by_the_next_start(tmp_path, cache_dir):
    """kill -9 after a rewind cut metrics.jsonl and before it moved the later checkpoints: resume=auto
    used to say there was nothing to do, under the metrics of the rewound run."""
    base = {"trainer.ckpt_every": 2, "trainer.keep_ckpts": 10}
    assert run_in_process(tiny_overrides(tmp_path, cache_dir, steps=8, **base)) == 0
    uninterrupted, ending = losses(tmp_path), (tmp_path / "model.safetensors").read_bytes()
    rewind = tiny_overrides(tmp_path, cache_dir, steps=8, resume=str(tmp_path / "checkpoints" / "step_00000004.pt"),
                            **base)
    assert run_killed_at(rewind, KILL_AT_THE_FIRST_CHECKPOINT_SET_ASIDE).returncode == -signal.SIGKILL
    assert run_in_process(tiny_overrides(tmp_path, cache_dir, steps=8, resume="auto", **base)) == 0
    assert losses(tmp_path) == uninterrupted   # rewound to 4 and trained 5..8 again, each row once
    rows = [json.loads(line) for line in (tmp_path / "lineage.jsonl").read_text().splitlines()]
    assert [(r["event"], r["step"]) for r in rows] == [("start", 0), ("rewind", 4), ("resume", 4)]
    aside = tmp_path / rows[1]["superseded"]
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == ["step_00000006.pt", "step_00000008.pt"]
    assert [json.loads(line)["step"] for line in (aside / "metrics.jsonl").read_text().splitlines()] == [5, 6, 7, 8]
    assert (aside / "model.safetensors").read_bytes() == ending and not (aside / "rewind.json").exists()


def test_a_run_stopped_before_its_first_checkpoint_restarts_with_the_same_command(tmp_path, cache_dir, capsys,
                                                                                  caplog, monkeypatch):
    """A file-size limit stopped the first save and said `rerun with resume=auto`; that rerun refused
    (metrics.jsonl but no checkpoint). Now it starts over from step 0, saying so, and keeps the rows
    it had logged aside."""
    import errno

    import torch

    assert run_in_process(tiny_overrides(tmp_path / "reference", cache_dir, steps=4)) == 0
    overrides = tiny_overrides(tmp_path / "run", cache_dir, steps=4, resume="auto")

    def too_large(*args, **kwargs):
        raise OSError(errno.EFBIG, "File too large")

    with monkeypatch.context() as m:
        m.setattr(torch, "save", too_large)
        assert run_in_process(overrides) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "raise the file-size limit (ulimit -f) and rerun with resume=auto; no checkpoint was saved yet")
    assert run_in_process(overrides) == 0
    assert "(the run stopped before its first was saved): starting over from step 0" in caplog.text
    run = tmp_path / "run"
    assert losses(run) == losses(tmp_path / "reference")
    rows = [json.loads(line) for line in (run / "lineage.jsonl").read_text().splitlines()]
    assert [(r["event"], r["step"]) for r in rows] == [("start", 0), ("restart", 0)]
    assert rows[0]["run_id"] == rows[1]["run_id"]
    kept = (run / rows[1]["superseded"] / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in kept] == [1, 2, 3, 4]


def test_resume_continue_refuses_a_folder_with_no_checkpoint_and_continues_like_auto(tmp_path, cache_dir, capsys):
    """resume=continue (a second stage's preset sets it): a run.dir with nothing to continue is refused
    in one line before any step, leaving nothing behind; with a checkpoint it continues the run from
    it, as auto does (here a first stage of 4 steps taken on to 8)."""
    run = tmp_path / "run"
    assert run_in_process(tiny_overrides(run, cache_dir, steps=8, resume="continue")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: resume=continue: run.dir={run} holds no checkpoint to continue"), err
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
    assert run_in_process(tiny_overrides(run, cache_dir, steps=4, **{"trainer.ckpt_every": 4})) == 0
    first = losses(run)
    assert run_in_process(tiny_overrides(run, cache_dir, steps=8, resume="continue",
                                         allow_changes="[trainer.max_steps]")) == 0
    assert losses(run)[:4] == first and [r[0] for r in losses(run)] == list(range(1, 9))
    rows = [json.loads(line) for line in (run / "lineage.jsonl").read_text().splitlines()]
    assert [(r["event"], r["step"]) for r in rows] == [("start", 0), ("resume", 4)]


KILL_IN_THE_FINAL_EXPORT = """
import safetensors.torch
def half_written_then_die(tensors, filename, *args, **kwargs):
    with open(filename, "wb") as f:
        f.write(b"\\0" * 100_000)
    os.kill(os.getpid(), signal.SIGKILL)
safetensors.torch.save_file = half_written_then_die
"""


def test_the_temp_file_of_a_killed_final_export_is_removed_by_the_next_start(tmp_path, cache_dir, monkeypatch):
    overrides = tiny_overrides(tmp_path, cache_dir, steps=4)
    assert run_killed_at(overrides, KILL_IN_THE_FINAL_EXPORT).returncode == -signal.SIGKILL
    assert (tmp_path / "model.safetensors.tmp").stat().st_size == 100_000
    from training.loop.trainer import Trainer

    seen = []
    start_run = Trainer._start_run
    monkeypatch.setattr(Trainer, "_start_run", lambda self: (seen.append(sorted(p.name for p in tmp_path.iterdir())),
                                                             start_run(self))[1])
    assert run_in_process(tiny_overrides(tmp_path, cache_dir, steps=6, resume="auto",
                                         allow_changes="[trainer.max_steps]")) == 0
    assert "model.safetensors.tmp" not in seen[0], seen   # gone when the next run starts, not at its end
    assert (tmp_path / "model.safetensors").is_file() and not list(tmp_path.glob("*.tmp"))
