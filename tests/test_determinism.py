"""Issue 25, item 3: `trainer.deterministic=true` makes every kernel of the step deterministic,
so kill -9 + resume=auto repeats an uninterrupted run to the bit on CUDA as on the CPU (the H200
measurement, with its cost, is scripts/bench/check_gpu_resume.py's, in benchmarks/)."""
from __future__ import annotations

import signal

import pytest
import torch

from conftest import requires_cuda
from tests.test_resume import start_and_signal
from tests.trainrun import cache_dir  # noqa: F401 (a fixture)
from tests.trainrun import losses, run_in_process, run_subprocess, tiny_overrides
from training.process.device import set_deterministic


@pytest.fixture
def restore_determinism():
    yield
    set_deterministic(False, torch.device("cpu"))


def test_the_switch_sets_cublas_before_cuda_starts_and_pytorchs_own_switches(monkeypatch, restore_determinism):
    import torch._inductor.config as inductor_config

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    set_deterministic(True, torch.device("cuda"))
    assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    assert not torch.is_deterministic_algorithms_warn_only_enabled()  # an op without a deterministic kernel raises
    import os
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and inductor_config.deterministic
    set_deterministic(False, torch.device("cpu"))
    assert not torch.are_deterministic_algorithms_enabled() and not inductor_config.deterministic


def test_too_late_for_cublas_is_one_line(monkeypatch, restore_determinism):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match="set CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment"):
        set_deterministic(True, torch.device("cuda"))


def test_an_op_without_a_deterministic_kernel_is_one_line():
    from training.process.faults import fault_line

    error = RuntimeError("index_add_cuda_ does not have a deterministic implementation, but you set "
                         "'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for this ...")
    assert fault_line(error) == ("trainer.deterministic=true, but index_add_cuda_ has no deterministic implementation "
                                 "on this device: use trainer.deterministic=false (or another attention)")


def test_a_deterministic_cpu_run_trains_like_the_default(tmp_path, cache_dir, restore_determinism):
    assert run_in_process(tiny_overrides(tmp_path / "a", cache_dir, steps=4)) == 0
    assert run_in_process(tiny_overrides(tmp_path / "b", cache_dir, steps=4, **{"trainer.deterministic": "true"})) == 0
    assert losses(tmp_path / "a") == losses(tmp_path / "b")


@requires_cuda
def test_kill_9_then_resume_on_the_gpu_is_bit_identical_with_the_switch(tmp_path, cache_dir):
    overrides = lambda run, **extra: tiny_overrides(run, cache_dir, steps=60, device="cuda", **{  # noqa: E731
        "trainer.ckpt_every": 20, "trainer.deterministic": "true", **extra})
    reference = run_subprocess(overrides(tmp_path / "ref"))
    assert reference.returncode == 0, reference.stderr
    run = tmp_path / "run"
    assert start_and_signal(overrides(run, resume="auto"), run, signal.SIGKILL, after_steps=30) == -signal.SIGKILL
    resumed = run_subprocess(overrides(run, resume="auto"))
    assert resumed.returncode == 0, resumed.stderr
    assert losses(run) == losses(tmp_path / "ref")
