"""What a run says: where it is and how to resume it first, a summary last, outputs/latest, and a
log without progress frames, blank lines or tracebacks when output is not a terminal."""
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.trainrun import REPO, cache_dir, run_in_process, subprocess_env, tiny_overrides  # noqa: F401
from training.run.report import duration, point_latest, resume_command


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "train"]


def test_a_run_announces_itself_and_ends_with_a_summary(tmp_path, cache_dir, caplog):
    caplog.set_level(logging.INFO, logger="train")
    run_dir = tmp_path / "run"
    assert run_in_process(tiny_overrides(run_dir, cache_dir, steps=4, **{"trainer.eval_every": 2})) == 0
    lines = messages(caplog)
    assert lines[0] == f"run folder: {run_dir}"
    assert lines[1].startswith("resume with: python ") and lines[1].endswith(f"run.dir={run_dir} resume=auto")
    done, files, sample = lines[-3:]
    assert done.startswith("done: 4 steps, 1,024 tokens in ") and " | train loss " in done, done
    rows = [r for r in (run_dir / "metrics.jsonl").read_text().splitlines() if "val_loss" in r]
    assert len(rows) == 2 and " | val loss " in done and "(best " in done and "at step " in done
    assert files == (f"checkpoint: {run_dir}/checkpoints/step_00000004.pt | weights: {run_dir}/model.safetensors")
    assert sample.startswith("sample: python ") and f"generate.py {run_dir} --prompt 'def '" in sample

    caplog.clear()   # a resumed run counts its own steps and keeps the best val of the whole run
    assert run_in_process(tiny_overrides(run_dir, cache_dir, steps=6, resume="auto", allow_changes="[trainer.max_steps]",
                                         **{"trainer.eval_every": 2})) == 0
    done = messages(caplog)[-3]
    assert done.startswith("done: steps 4 -> 6 (2 this run), 1,536 tokens in "), done


def test_a_run_stopped_between_logged_steps_ends_with_its_last_steps_loss(tmp_path, cache_dir, caplog, monkeypatch):
    """The summary read the last row of metrics.jsonl: a stop at step 5 of a run logging every 4th
    step ended with step 4's loss."""
    import training.loop.trainer
    from tests.trainrun import losses

    assert run_in_process(tiny_overrides(tmp_path / "every", cache_dir, steps=12)) == 0
    step_5 = losses(tmp_path / "every")[4]
    assert step_5[0] == 5

    def stop_at_the_fifth_boundary(self):
        self.polls = getattr(self, "polls", 0) + 1
        self.signum = signal.SIGTERM if self.polls == 5 else None
        return self.signum is not None

    monkeypatch.setattr(training.parallel.distributed.AgreedStop, "poll", stop_at_the_fifth_boundary)
    caplog.set_level(logging.INFO, logger="train")
    run_dir = tmp_path / "run"
    assert run_in_process(tiny_overrides(run_dir, cache_dir, steps=12, **{"trainer.log_every": 4})) == 143
    assert [r[0] for r in losses(run_dir)] == [4]   # step 5 was not logged
    stopped = next(line for line in messages(caplog) if line.startswith("stopped at step 5 of 12"))
    assert f" | train loss {step_5[1]:.4f}" in stopped and f"{losses(run_dir)[0][1]:.4f}" not in stopped, stopped


def test_the_resume_command_repeats_the_overrides_and_quotes_them(monkeypatch):
    command = resume_command("runs/a", 1, ["model=gpt2-small", "run.dir=old", "resume=auto", "hydra.run.dir=x",
                                           "data.paths=[~/my corpus]"])
    assert command.startswith("python ") and command.endswith(
        " model=gpt2-small 'data.paths=[~/my corpus]' run.dir=runs/a resume=auto")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")   # torchrun's, on one node
    assert resume_command("runs/a", 2, []).startswith("torchrun --standalone --nproc_per_node=2 ")
    assert [duration(s) for s in (8.25, 75, 3725)] == ["8.2s", "1m 15s", "1h 02m"]


def test_latest_is_a_link_replaced_in_one_rename_and_never_a_folder_written_through(tmp_path):
    outputs = tmp_path / "outputs"
    first, second = outputs / "2026-12-01" / "10-00-00", outputs / "2026-12-01" / "11-00-00"
    first.mkdir(parents=True), second.mkdir(parents=True)
    link = outputs / "latest"
    assert point_latest(link, first) and os.readlink(link) == "2026-12-01/10-00-00"
    assert point_latest(link, second) and link.resolve() == second.resolve()
    elsewhere = tmp_path / "runs" / "a"
    elsewhere.mkdir(parents=True)
    assert point_latest(link, elsewhere) and os.readlink(link) == str(elsewhere.resolve())
    assert sorted(p.name for p in outputs.iterdir()) == ["2026-12-01", "latest"]   # no temporary link left
    link.unlink()
    link.mkdir()                                  # a real folder of that name is not ours to replace
    (link / "keep").write_text("mine")
    assert not point_latest(link, first) and (link / "keep").read_text() == "mine"


def wait_for(path: Path, text: str, proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in {path}: {path.read_text() if path.exists() else ''}")


@pytest.mark.slow
def test_a_default_run_logged_to_files_points_latest_and_stops_in_one_line(tmp_path, cache_dir):
    """`python train.py` with its output redirected: the log opens with the run folder,
    outputs/latest points at it, stderr has no progress frame, and Ctrl-C twice ends in one line."""
    overrides = [o for o in tiny_overrides(tmp_path, cache_dir, steps=100_000, **{"trainer.progress": "true"})
                 if not o.startswith("run.dir=")]
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), *overrides],
                                cwd=tmp_path, env=subprocess_env(), stdout=stdout, stderr=stderr)
        try:
            wait_for(out, "step 3/", proc)
            proc.send_signal(signal.SIGINT)
            time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    log_lines = out.read_text().splitlines()
    first = next(i for i, line in enumerate(log_lines) if "[data." not in line)   # a cold token cache logs its tokenizing first
    assert "run folder: outputs/" in log_lines[first] and "(outputs/latest points here)" in log_lines[first], log_lines[:3]
    run_dir = tmp_path / log_lines[first].split("run folder: ")[1].split(" ")[0]
    assert (tmp_path / "outputs" / "latest").resolve() == run_dir.resolve()
    assert all(line.strip() for line in log_lines), "blank line in the log"
    errors = err.read_text()
    assert "\r" not in errors and "Traceback" not in errors, errors
    assert proc.returncode == 130, errors
    # the second Ctrl-C stopped at once (one line); or the first had already saved at the step boundary
    assert errors.strip() == "" or len(errors.strip().splitlines()) == 1, errors


def test_a_second_ctrl_c_during_a_save_is_still_the_interrupt():
    """A Ctrl-C that lands inside torch.save comes out as the zip writer's RuntimeError, with the
    KeyboardInterrupt as its context: the run must still end in the interrupt's one line."""
    from training.loop.trainer import _second_ctrl_c

    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1060032 vs 1059924")
    except RuntimeError as e:
        assert isinstance(_second_ctrl_c(e), KeyboardInterrupt)
    assert _second_ctrl_c(OSError(28, "No space left on device")) is None


def test_a_ctrl_c_after_the_run_has_ended_exits_130_at_once():
    """What the test above meets when the second Ctrl-C lands after train.py's last line: status
    130 with the output flushed, not death by SIGINT (-2) and not a traceback from atexit code."""
    script = ("import os, signal, sys, time\n"
              "from training.process.signals import exit_at_once_on_ctrl_c\n"
              "exit_at_once_on_ctrl_c()\n"
              "print('the run said how it ended')\n"
              "os.kill(os.getpid(), signal.SIGINT)\n"
              "time.sleep(30)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 130 and proc.stdout == "the run said how it ended\n" and proc.stderr == "", proc



def test_a_ctrl_c_in_the_last_moments_of_exit_leaves_the_status_alone():
    """After the last exit handler, Python takes the Ctrl-C handlers away (default action: death
    by the signal, status -2) before the process ends: from the handler that
    ignore_ctrl_c_as_python_exits registers on, a Ctrl-C is ignored and the status stays the one
    the process was exiting with (here 3; the handler of the test above would make it 130)."""
    script = ("import atexit, os, signal, sys\n"
              "from training.process.signals import exit_at_once_on_ctrl_c, ignore_ctrl_c_as_python_exits\n"
              "atexit.register(os.kill, os.getpid(), signal.SIGINT)   # runs after it: as late as Python code can\n"
              "ignore_ctrl_c_as_python_exits()\n"
              "exit_at_once_on_ctrl_c()\n"
              "sys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 3 and proc.stderr == "", proc

@pytest.mark.slow
def test_a_ctrl_c_in_train_pys_clean_up_is_one_line_and_130(tmp_path, cache_dir):
    """The window between the two above: a Ctrl-C after train() has handled its own, here in its
    clean-up (leaving the process group), ends in one line with 130, not a traceback and death by
    SIGINT (-2). The Ctrl-C is sent from inside that clean-up, so it lands there every time. The
    process starts with Ctrl-C's handler as at a terminal: a parent that ignores SIGINT (a script's
    background job) passes that on, and Python keeps it, so the window would not be reached."""
    script = ("import os, runpy, signal, sys\n"
              "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "import training.parallel.distributed\n"
              "training.parallel.distributed.close_distributed = lambda: os.kill(os.getpid(), signal.SIGINT)\n"
              f"sys.argv = ['train.py', *{tiny_overrides(tmp_path, cache_dir, steps=2)!r}]\n"
              "runpy.run_path('train.py', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=120)
    assert "step 2/2" in proc.stdout, proc.stdout + proc.stderr   # the run itself ended
    assert proc.returncode == 130 and proc.stderr.splitlines() == ["error: interrupted"], proc
