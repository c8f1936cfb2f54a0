"""Issue 25, item 4: every fault the issue saw ends in one line naming it (exit status 2), leaves
no partial file, and never touches an existing run's files; links in run.dir are never followed.

The full disk is a real one, a small tmpfs mounted in a private mount namespace (`unshare`:
nothing stays mounted, no root needed where user namespaces are allowed; skipped with the reason
where they are not); the file-size limit is RLIMIT_FSIZE in the child process."""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.trainrun import cache_dir, finished_run  # noqa: F401 (fixtures)
from tests.trainrun import REPO, run_in_process, run_subprocess, subprocess_env, tiny_overrides, train_command
from training.run.store import CheckpointStore, load_checkpoint


def one_error(stderr: str) -> str:
    """The run's single error line (the token cache's progress lines aside)."""
    lines = [line for line in stderr.strip().splitlines() if not line.startswith("tokenizing")]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != ".lock"}


# --------------------------------------------------------------------------- a full disk (tmpfs)

def _can_mount_tmpfs(where: Path) -> str:
    if shutil.which("unshare") is None:
        return "no unshare"
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            f"mount -t tmpfs -o size=64k tmpfs {where}"], capture_output=True, text=True)
    return "" if probe.returncode == 0 else f"cannot mount a tmpfs here: {probe.stderr.strip()}"


def on_small_disk(disk: Path, size: int, script: str) -> subprocess.CompletedProcess:
    """`script` (sh) run with a `size`-byte tmpfs mounted at `disk` ($DISK), privately: it is gone after."""
    disk.mkdir(exist_ok=True)
    reason = _can_mount_tmpfs(disk)
    if reason:
        pytest.skip(reason)
    env = dict(subprocess_env(), DISK=str(disk), PY=sys.executable, TRAIN=str(REPO / "train.py"))
    return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                           f"mount -t tmpfs -o size={size} tmpfs {disk} && {script}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def sizes(finished_run) -> tuple[int, int]:
    """(checkpoint, weights) bytes of the tiny run."""
    return CheckpointStore(finished_run).path(4).stat().st_size, (finished_run / "model.safetensors").stat().st_size


def _command(overrides: list[str]) -> str:
    return " ".join(f"'{a}'" for a in ["$PY", "$TRAIN", *overrides]).replace("'$PY'", '"$PY"').replace("'$TRAIN'", '"$TRAIN"')


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_is_one_line_and_resume_continues_once_there_is_space(
        tmp_path, cache_dir, finished_run):
    ckpt, _ = sizes(finished_run)
    disk = tmp_path / "disk"
    run = tiny_overrides(disk / "run", cache_dir, steps=12, **{"trainer.ckpt_every": 2, "trainer.keep_ckpts": 10})
    again = tiny_overrides(disk / "run", cache_dir, steps=12, resume="auto",
                           **{"trainer.ckpt_every": 2, "trainer.keep_ckpts": 1})
    result = on_small_disk(disk, int(2.6 * ckpt) + 256 * 1024, f"""
        {_command(run)} >/dev/null 2>$DISK/err1; echo "status1=$?"; ls -a $DISK/run/checkpoints; cat $DISK/err1 >&2
        rm $DISK/run/checkpoints/step_00000002.pt
        {_command(again)} >/dev/null 2>&1; echo "status2=$?"; ls $DISK/run/checkpoints; wc -l < $DISK/run/metrics.jsonl""")
    out = result.stdout.split()
    assert "status1=2" in out, result.stdout + result.stderr
    first_listing = out[out.index("status1=2") + 1:out.index("status2=0")]
    assert sorted(first_listing) == [".", "..", "step_00000002.pt", "step_00000004.pt"]  # no .tmp left
    err = one_error(result.stderr)
    assert "could not write checkpoint" in err and "No space left on device" in err and "step_00000004.pt" in err, err
    assert out[-2:] == ["step_00000012.pt", "12"], result.stdout  # resumed from step 4 and finished


def test_a_failed_export_is_written_by_the_next_run(tmp_path, cache_dir, capsys, monkeypatch):
    """The same without a mount: the rerun used to say `nothing to do` and leave no weights."""
    import safetensors.torch

    def no_space(*args, **kwargs):
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    overrides = tiny_overrides(tmp_path, cache_dir, steps=4)
    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", no_space)
        assert run_in_process(overrides) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: could not write {tmp_path / 'model.safetensors'} (No space left on device)"), err
    assert not list(tmp_path.glob("model.safetensors*"))
    assert run_in_process(overrides + ["resume=auto"]) == 0
    assert (tmp_path / "model.safetensors").is_file()


# --------------------------------------------------------------------------- a file-size limit

def limited(max_bytes: int):
    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))  # Python ignores SIGXFSZ: EFBIG
    return preexec


@pytest.mark.slow
def test_a_file_size_limit_during_torch_save_is_one_line_without_a_partial_file(tmp_path, cache_dir, finished_run):
    """torch.save reported it as `RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos`."""
    ckpt, _ = sizes(finished_run)
    result = subprocess.run(train_command(tiny_overrides(tmp_path, cache_dir, steps=4)), cwd=REPO, env=subprocess_env(),
                            capture_output=True, text=True, timeout=120, preexec_fn=limited(ckpt // 2))
    assert result.returncode == 2, result.stderr
    err = one_error(result.stderr)
    assert err.startswith(f"error: could not write checkpoint {CheckpointStore(tmp_path).path(4)} (File too large)"), err
    assert err.endswith("no checkpoint was saved yet"), err
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_a_full_disk_while_building_the_token_cache_is_one_line_and_leaves_no_partial_build(tmp_path, capsys,
                                                                                             monkeypatch):
    import data.cache

    def no_space(path, *args, **kwargs):
        path.mkdir(parents=True)
        (path / "tokens.bin").write_bytes(b"\0" * 100)
        raise OSError(28, "No space left on device", str(path / "tokens.bin"))

    monkeypatch.setattr(data.cache, "build", no_space)
    assert run_in_process(tiny_overrides(tmp_path / "run", tmp_path / "cache", steps=1)) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: No space left on device: ") and err.endswith(
        "tokens.bin (free some space, or raise the file-size limit, and rerun)"), err
    assert list((tmp_path / "cache" / "tokens").iterdir()) == []  # the partial build is removed


# --------------------------------------------------------------------------- memory

def test_host_out_of_memory_is_one_line_with_the_knob_to_turn(tmp_path, cache_dir, capsys):
    """A real allocation failure: naive attention's 90K x 90K scores (130 GB), refused by malloc."""
    if Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1":
        pytest.skip("vm.overcommit_memory=1: the allocation would succeed and the OOM killer would act instead")
    assert run_in_process(tiny_overrides(tmp_path, cache_dir, steps=1, attention="naive", **{
        "trainer.seq_len": 90_000, "trainer.batch_size": 1, "trainer.eval_batches": 1})) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: out of host (CPU) memory (") and "lower trainer.batch_size" in err, err
    assert err.endswith("no checkpoint was saved yet"), err


def test_cuda_out_of_memory_names_the_knobs():
    from training.process.faults import fault_line

    line = fault_line(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                             "capacity of 139.81 GiB of which 1.02 GiB is free."))
    assert line == ("CUDA out of memory (Tried to allocate 2.00 GiB): lower trainer.batch_size (raise "
                    "trainer.grad_accum to keep the global batch) or trainer.seq_len, or set "
                    "model.activation_checkpointing=full")
    assert fault_line(RuntimeError("some bug")) is None  # anything else stays a traceback


# --------------------------------------------------------------------------- bad values and paths

@pytest.mark.parametrize("override,message", [
    ({"seed": -1}, "seed=-1: must be an integer in [0, 9223372036854775807]"),
    ({"seed": 1180591620717411303424}, "seed=1180591620717411303424: must be an integer in [0, 9223372036854775807]"),
    ({"optim.lr": "inf"}, "optim.lr=inf: must be a finite number > 0"),
    ({"trainer.deterministic": "true", "attention.deterministic": "false"},
     "trainer.deterministic=True: needs attention.deterministic=true"),
    ({"data": "stdlib-passkey", "data.passkey.key_digits": 100}, "data.passkey.key_digits=100: must be an integer in [1, 18]"),
    ({"trainer.passkey_probe": "abc"}, "trainer.passkey_probe='abc': must be a list of integers"),
], ids=["seed-negative", "seed-huge", "lr-inf", "deterministic-atomic-attention", "key-digits-past-int64", "probe-not-a-list"])
def test_values_out_of_range_are_one_line(tmp_path, cache_dir, capsys, override, message):
    assert run_in_process(tiny_overrides(tmp_path / "run", cache_dir, **override)) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: {message}")


def run_files(run_dir: Path) -> list[str]:
    """What a run wrote into its folder (the lock aside)."""
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.name != ".lock") if run_dir.exists() else []


def test_an_empty_data_file_is_named_by_its_path(tmp_path, cache_dir, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    overrides = [o for o in tiny_overrides(tmp_path / "run", cache_dir, steps=1) if not o.startswith("data.max_bytes")]
    assert run_in_process(overrides + ["data=files", f"data.paths=[{empty}]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"error: data.paths=['{empty}'] yielded no documents: every one is empty", err


def test_a_garbage_pretrained_tokenizer_is_one_line_naming_the_file(tmp_path, cache_dir, capsys):
    garbage = tmp_path / "tokenizer.json"
    garbage.write_text('{"model": "not a tokenizer"')
    overrides = tiny_overrides(tmp_path / "run", cache_dir, steps=1, tokenizer="pretrained",
                               **{"tokenizer.path": garbage})
    assert run_in_process(overrides) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: tokenizer file {garbage} is not a tokenizer.json the "
                                               "tokenizers library reads ("), err
    assert run_files(tmp_path / "run") == []


@pytest.mark.parametrize("line,cause", [('{"text": "c", oops}', "line 3: not valid JSON (Expecting property name"),
                                        ('["c"]', "line 3: a JSON list, not an object")], ids=["not-json", "a-list"])
def test_a_malformed_jsonl_corpus_is_one_line_naming_the_file_and_line(tmp_path, cache_dir, capsys, line, cause):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a"}\n{"text": "b"}\n' + line + '\n{"text": "d"}\n')
    overrides = [o for o in tiny_overrides(tmp_path / "run", tmp_path / "cache") if not o.startswith("data.max_bytes")]
    assert run_in_process(overrides + ["data=files", f"data.paths=[{corpus}]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {corpus}, {cause}"), err
    assert run_files(tmp_path / "run") == [] and not list((tmp_path / "cache").glob("tokens/*"))


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_fifo_or_a_device_as_data_path_is_one_line_instead_of_blocking(tmp_path, cache_dir, capsys, kind):
    path = tmp_path / "fifo" if kind == "fifo" else Path("/dev/zero")
    if kind == "fifo":
        os.mkfifo(path)
    overrides = [o for o in tiny_overrides(tmp_path / "run", cache_dir) if not o.startswith("data.max_bytes")]
    assert run_in_process(overrides + ["data=files", f"data.paths=[{path}]"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: data.paths: {path} is not a regular file or a folder (a FIFO, device or socket)")


def test_an_empty_token_cache_name_is_one_line_instead_of_writing_into_the_current_folder(tmp_path, cache_dir,
                                                                                            capsys, monkeypatch):
    monkeypatch.setenv("FLASHTRAIN_CACHE", "")
    assert run_in_process([o for o in tiny_overrides(tmp_path, cache_dir) if "cache_dir" not in o]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: data.cache_dir='': expected a folder for the token cache (FLASHTRAIN_CACHE is set to an empty string)")


@pytest.mark.parametrize("where", ["empty", "file", "under-a-file", "proc"])
def test_a_run_dir_that_cannot_be_a_folder_is_one_line_before_hydra_creates_it(tmp_path, capsys, where):
    """What train.py checks before Hydra runs (Hydra creates its output folder first, in a traceback)."""
    import train

    a_file = tmp_path / "a_file"
    a_file.write_text("")
    run_dir = {"empty": "", "file": a_file, "under-a-file": a_file / "run", "proc": "/proc/flashtrain-run"}[where]
    with pytest.raises(SystemExit) as stop:
        train.check_before_hydra([f"run.dir={run_dir}", "trainer.max_steps=1"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    expected = {"empty": "run.dir='': expected a folder for the run", "file": f"run.dir={a_file} is not a folder",
                "under-a-file": f"run.dir={run_dir} cannot be created (Not a directory)",
                "proc": f"run.dir={run_dir} cannot be created ("}[where]
    assert len(err) == 1 and err[0].startswith(f"error: {expected}"), err


@pytest.mark.slow
def test_a_read_only_run_dir_mount_is_one_line(tmp_path, cache_dir):
    """The read-only folder itself as run.dir: Hydra's log handler failed there (`Unable to configure handler`)."""
    from tests.test_exit_status import make_read_only, undo_read_only

    folder = make_read_only(tmp_path / "ro")
    try:
        result = run_subprocess(tiny_overrides(folder, cache_dir))
    finally:
        undo_read_only(folder)
    assert result.returncode == 2, result.stderr
    assert one_error(result.stderr).startswith(f"error: run.dir={folder} is not writable ("), result.stderr


def test_a_stale_world_size_is_one_line_at_once(tmp_path, cache_dir, capsys, monkeypatch):
    """The issue: a lone process waited 31-600 s for peers, then DistStoreError."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29977"}.items():
        monkeypatch.setenv(key, value)
    start = time.monotonic()
    assert run_in_process(tiny_overrides(tmp_path, cache_dir)) == 2
    assert time.monotonic() - start < 30
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "error: WORLD_SIZE=2 (RANK=0) is set, but this process was not started by torchrun")


@pytest.mark.slow
def test_wandb_online_without_a_network_is_one_line_within_its_timeout(tmp_path, cache_dir):
    env = dict(subprocess_env(), WANDB_API_KEY="x" * 40, WANDB_BASE_URL="http://127.0.0.1:9", WANDB_SILENT="true",
               WANDB_DIR=str(tmp_path / "wandb"))
    start = time.monotonic()
    result = subprocess.run(train_command(tiny_overrides(tmp_path / "run", cache_dir, logger="wandb", **{
        "logger.mode": "online", "logger.init_timeout_s": 5})), cwd=REPO, env=env, capture_output=True, text=True,
        timeout=180)
    assert result.returncode == 2, result.stderr[-3000:]
    assert time.monotonic() - start < 120
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith("error: logger=wandb could not start its online run ("), lines
    assert "logger.mode=offline" in lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# --------------------------------------------------------------------------- links and refused runs

def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_text("not yours\n")
    return path


@pytest.mark.parametrize("name", ["checkpoints/step_00000004.pt.tmp", "metrics.jsonl.tmp", "model.safetensors.tmp"])
def test_a_link_planted_at_a_temp_name_is_replaced_not_followed(tmp_path, cache_dir, name):
    run_dir, target = tmp_path / "run", victim(tmp_path)
    (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
    (run_dir / name).symlink_to(target)
    assert run_in_process(tiny_overrides(run_dir, cache_dir, steps=4)) == 0
    assert target.read_text() == "not yours\n"
    assert load_checkpoint(CheckpointStore(run_dir).path(4))["step"] == 4 and not (run_dir / name).exists()


@pytest.mark.parametrize("name", [".lock", "checkpoints", "lineage.jsonl", "train.log"])
def test_a_link_at_a_runs_own_name_is_refused_in_one_line(tmp_path, cache_dir, capsys, name):
    run_dir, target = tmp_path / "run", victim(tmp_path)
    run_dir.mkdir()
    (run_dir / name).symlink_to(target if name != "checkpoints" else tmp_path)
    assert run_in_process(tiny_overrides(run_dir, cache_dir, steps=2)) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: run.dir={run_dir}: {name} is a symbolic link"), err
    assert target.read_text() == "not yours\n"


@pytest.mark.slow
def test_a_refused_run_leaves_the_runs_hydra_files_and_log_alone(tmp_path, cache_dir):
    """The issue: a run refused after composition rewrote the existing run's .hydra/overrides.yaml."""
    run_dir = tmp_path / "run"
    assert run_subprocess(tiny_overrides(run_dir, cache_dir, steps=4)).returncode == 0
    before = snapshot(run_dir)
    assert {".hydra/overrides.yaml", "train.log"} <= set(before)
    result = run_subprocess(tiny_overrides(run_dir, cache_dir, steps=4, resume="auto", **{"optim.lr": 0.5}))
    assert result.returncode == 2 and "other training settings" in one_error(result.stderr)
    assert snapshot(run_dir) == before


# --------------------------------------------------------------------------- stopping

def test_a_second_ctrl_c_is_one_line_and_status_130(tmp_path, cache_dir, capsys, monkeypatch):
    from training.loop.step import TrainStep

    step, calls = TrainStep.__call__, []

    def interrupted_at_step_6(self, next_batch):
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt  # what the second SIGINT's handler raises
        return step(self, next_batch)

    monkeypatch.setattr(TrainStep, "__call__", interrupted_at_step_6)
    with pytest.raises(SystemExit) as stop:  # a sweep ends too
        run_in_process(tiny_overrides(tmp_path, cache_dir, steps=12))
    assert stop.value.code == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: interrupted: stopped at once, without saving; the last good checkpoint is "
        f"{CheckpointStore(tmp_path).path(4)}")
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]


def test_repeated_sigint_under_a_launcher_is_one_request_and_a_dead_launcher_a_stop(monkeypatch):
    import training.process.signals as signals

    alone = signals.StopRequest()
    alone._handle(signal.SIGINT, None)
    with pytest.raises(KeyboardInterrupt):
        alone._handle(signal.SIGINT, None)
    monkeypatch.setattr(signals, "LAUNCHER_PID", os.getppid())
    launched = signals.StopRequest()
    assert launched.signum is None  # the launcher is alive
    launched._handle(signal.SIGINT, None)
    launched._handle(signal.SIGINT, None)  # the terminal's and the launcher's copy of one Ctrl-C
    assert launched.exit_code == 130
    monkeypatch.setattr(signals, "LAUNCHER_PID", os.getppid() + 100_000)  # not our parent: it died, we were adopted
    orphan = signals.StopRequest()
    assert orphan.signum == signal.SIGHUP and orphan.exit_code == 129


# --------------------------------------------------------------------------- configs run code (item 6)

EVIL = """# @package _global_
hydra:
  callbacks:
    payload:
      _target_: os.makedirs
      _args_: [{marker}]
"""


def test_hydra_callbacks_from_a_config_are_refused_before_hydra_runs_them(tmp_path, capsys, monkeypatch):
    """The issue: a preset's hydra.callbacks ran torch.load(..., weights_only=False) (Hydra's own
    blocklist stops os.system and exec, not that)."""
    import train

    marker = tmp_path / "payload-ran"
    (tmp_path / "presets" / "experiment").mkdir(parents=True)
    (tmp_path / "presets" / "experiment" / "evil.yaml").write_text(EVIL.format(marker=marker))
    argv = [f"run.dir={tmp_path / 'run'}", f"hydra.searchpath=[file://{tmp_path / 'presets'}]", "experiment=evil"]
    monkeypatch.delenv(train.ALLOW_CALLBACKS, raising=False)
    with pytest.raises(SystemExit) as stop:
        train.check_before_hydra(argv)
    assert stop.value.code == 2 and not marker.exists()
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: hydra.callbacks (payload) would run code named in a config file before training starts; "
        f"flashtrain runs them only with {train.ALLOW_CALLBACKS}=1 (docs/training.md, 'Configs are code')"]
    monkeypatch.setenv(train.ALLOW_CALLBACKS, "1")
    train.check_before_hydra(argv)  # explicitly allowed: left to Hydra


def test_no_config_of_ours_names_hydra_callbacks():
    from training.config import CONFIG_DIR, composed_variants, hydra_callbacks

    presets = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))
    assert presets and hydra_callbacks(composed_variants([f"experiment={','.join(presets)}"])) == []  # each preset, as a sweep


# --------------------------------------------------------------------------- hand-edited run files, the tools' outputs

@pytest.mark.parametrize("name,line,problem", [
    ("metrics.jsonl", "[1, 2]", "a JSON list, not an object"),
    ("metrics.jsonl", '{"step": "3", "loss": 1.0, "tokens": 768}', "'step' is \"3\", not an integer"),
    ("lineage.jsonl", '{"note": "branched by hand"}', "no 'run_id'"),
], ids=["metrics-list", "metrics-step-text", "lineage-no-id"])
def test_a_hand_edited_run_file_line_is_one_line_naming_it_and_touches_nothing(tmp_path, cache_dir, finished_run,
                                                                               capsys, name, line, problem):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir, ignore=shutil.ignore_patterns(".lock"))
    rows = (run_dir / name).read_text().splitlines()
    (run_dir / name).write_text("\n".join([rows[0], line, *rows[1:]]) + "\n")
    before = snapshot(run_dir)
    assert run_in_process(tiny_overrides(run_dir, cache_dir, steps=8, resume="auto",
                                         allow_changes="[trainer.max_steps]")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {run_dir / name}, line 2: {problem} (a hand edit?); fix or remove that "
                              "line"), err
    assert snapshot(run_dir) == before


def tool_error(module, argv: list[str], monkeypatch, capsys) -> str:
    """A tool run as `python scripts/<tool>.py argv` runs it; its one error line (status 2)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from _common import run_cli

    monkeypatch.setattr(sys, "argv", [module.__file__, *argv])
    with pytest.raises(SystemExit) as exit_info:
        run_cli(module.main)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_compare_runs_on_damaged_metrics_or_a_config_that_is_not_yaml_is_one_line(tmp_path, finished_run,
                                                                                 monkeypatch, capsys):
    sys.path.insert(0, str(REPO / "scripts"))
    import compare_runs

    metrics, config = tmp_path / "metrics", tmp_path / "config"
    for run, name, text in ((metrics, "metrics.jsonl", '{"step": 1, "loss": 2.0, "tokens": 256}\n"a string"\n'),
                            (config, "config.yaml", "model: {n_layer: 2\ntrainer: [\n")):
        shutil.copytree(finished_run, run, ignore=shutil.ignore_patterns(".lock"))
        (run / name).write_text(text)
    out = tmp_path / "out"
    line = tool_error(compare_runs, [str(metrics), "--out", str(out)], monkeypatch, capsys)
    assert line.startswith(f"error: {metrics / 'metrics.jsonl'}, line 2: a JSON str, not an object"), line
    line = tool_error(compare_runs, [str(finished_run), str(config), "--out", str(out)], monkeypatch, capsys)
    assert line.startswith(f"error: {config / 'config.yaml'} is not a run's config (YAML mapping): "), line
    assert not out.exists()


TOOLS_ON_A_FULL_DISK = """
import contextlib, io, json, sys
sys.path.insert(0, sys.argv[1] + "/scripts")
from _common import run_cli
import compare_runs, export_hf, export_weights, generate
run, disk = sys.argv[2], sys.argv[3]
outcome = {}
for name, module, argv in [
        ("export_weights", export_weights, [run, disk + "/w.safetensors"]),
        ("export_weights_read_only", export_weights, [disk + "/ro/run"]),
        ("export_hf", export_hf, [run, disk + "/hf"]),
        ("generate", generate, [run, "--prompt", "def ", "--max-new-tokens", "4", "--jsonl", disk + "/g.jsonl"]),
        ("compare_runs", compare_runs, [run, "--out", disk + "/cmp"])]:
    sys.argv, err = [module.__file__, *argv], io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            run_cli(module.main)
            status = 0
        except SystemExit as e:
            status = e.code
    outcome[name] = [status, err.getvalue().strip().splitlines()]
print(json.dumps(outcome))
"""


@pytest.mark.slow
def test_the_tools_on_a_full_disk_or_a_read_only_folder_are_one_line_and_leave_nothing(tmp_path, finished_run):
    """A full 1 MiB tmpfs, and on it a copy of the run on a second one made read-only: every tool that writes
    fails for want of space (or of a writable folder) in one line, exit 2, and leaves nothing behind."""
    disk = tmp_path / "disk"
    script = tmp_path / "tools.py"
    script.write_text(TOOLS_ON_A_FULL_DISK)
    result = on_small_disk(disk, 1 << 20, f"""
        mkdir $DISK/ro && mount -t tmpfs -o size=8m tmpfs $DISK/ro && cp -r {finished_run} $DISK/ro/run \\
        && rm -f $DISK/ro/run/.lock && mount -o remount,ro $DISK/ro \\
        && (dd if=/dev/zero of=$DISK/fill bs=1k 2>/dev/null; true) && "$PY" {script} {REPO} {finished_run} $DISK \\
        && ls -A $DISK""")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    outcome, left = json.loads(lines[0]), sorted(lines[1:])
    assert left == ["fill", "ro"], left   # no partial file, no temp file, no half an export folder
    named = {"export_weights": "w.safetensors", "export_weights_read_only": "ro/run/model_step_00000004.safetensors",
             "export_hf": "hf/model.safetensors", "generate": "g.jsonl", "compare_runs": "cmp/compare.json"}
    assert set(outcome) == set(named)
    for name, (status, err) in outcome.items():
        assert status == 2 and len(err) == 1 and err[0].startswith("error: "), (name, err)
        reason = "Read-only file system" if name.endswith("read_only") else "No space left on device"
        assert reason in err[0] and f"{disk}/{named[name]}" in err[0], (name, err)
