"""Issue 15, "Never lose a run": pruning keeps the newest usable checkpoint, checksums catch
flipped bytes, one live run per run.dir, whole-model-config and data checks on resume, a full
disk during a save. Each test fails on the code before the fix."""
from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
import torch

import training.run.store as checkpoint
from tests.trainrun import cache_dir, finished_run  # noqa: F401 (fixtures)
from tests.trainrun import REPO, losses, run_in_process, subprocess_env, tiny_overrides, train_command
from training.run.lock import RunDirLock
from training.run.store import CheckpointError, CheckpointStore, load_checkpoint, save_checkpoint


def state(step: int) -> dict:
    return {"step": step, "tokens": step * 10, "model": {"w": torch.arange(4096, dtype=torch.float32) + step},
            "optimizer": {}, "rng": {"torch": torch.get_rng_state()}, "sampler": {"position": step},
            "config": {"model": {"d_model": 3}}, "wandb_id": None}


def flip_tensor_bytes(path: Path, n: int = 64) -> None:
    """Invert `n` bytes in the middle of the largest tensor's data, leaving the zip structure intact."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = int.from_bytes(raw[info.header_offset + 26:info.header_offset + 28], "little"), \
        int.from_bytes(raw[info.header_offset + 28:info.header_offset + 30], "little")
    start = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
    raw[start:start + n] = bytes(b ^ 0xFF for b in raw[start:start + n])
    path.write_bytes(bytes(raw))


# --------------------------------------------------------------------------- checksums (item 4)

def test_flipped_tensor_bytes_fail_the_checksum_and_resume_skips_the_file(tmp_path, caplog):
    for step in (1, 2):
        save_checkpoint(CheckpointStore(tmp_path).path(step), state(step))
    newest = CheckpointStore(tmp_path).path(2)
    flip_tensor_bytes(newest)
    with pytest.raises(CheckpointError, match=rf"checkpoint {newest} is corrupt: its contents do not match"):
        load_checkpoint(newest)
    checkpoint._verified.clear()
    with caplog.at_level(logging.WARNING):
        path, loaded = CheckpointStore(tmp_path).latest()
    assert path == CheckpointStore(tmp_path).path(1) and loaded["step"] == 1
    assert "step_00000002.pt is corrupt" in caplog.text


def test_checksum_covers_plain_values_too(tmp_path):
    path = save_checkpoint(CheckpointStore(tmp_path).path(3), state(3))
    loaded = load_checkpoint(path)
    assert loaded["checksum"] == checkpoint.state_checksum(loaded)
    assert checkpoint.state_checksum({**loaded, "step": 4}) != loaded["checksum"]


# --------------------------------------------------------------------------- pruning (item 1)

def test_prune_never_counts_an_unusable_checkpoint_as_kept(tmp_path, caplog):
    for step in (10, 12, 16, 20):
        save_checkpoint(CheckpointStore(tmp_path).path(step), state(step))
    corrupt = CheckpointStore(tmp_path).path(20)
    corrupt.write_bytes(corrupt.read_bytes()[:5000])
    CheckpointStore(tmp_path).prune(keep=1)
    names = [p.name for p in CheckpointStore(tmp_path).list()]
    assert names == ["step_00000016.pt", "step_00000020.pt"]  # the usable newest survives; 20 kept as evidence
    assert "step_00000020.pt is unusable" in caplog.text
    assert CheckpointStore(tmp_path).latest()[0] == CheckpointStore(tmp_path).path(16)


def test_resume_after_a_corrupt_newest_checkpoint_keeps_its_own_checkpoints(tmp_path, cache_dir):
    """The issue's reproduction, with the kill at step 17 replaced by a run that ends at 16."""
    base = tiny_overrides(tmp_path, cache_dir, steps=20, **{"trainer.ckpt_every": 10})
    assert run_in_process(base) == 0
    step20 = CheckpointStore(tmp_path).path(20)
    step20.write_bytes(step20.read_bytes()[:5000])
    again = tiny_overrides(tmp_path, cache_dir, steps=16, resume="auto", allow_changes="[trainer.max_steps]",
                           **{"trainer.ckpt_every": 4, "trainer.keep_ckpts": 1})
    assert run_in_process(again) == 0
    assert [p.name for p in CheckpointStore(tmp_path).list()] == ["step_00000016.pt", "step_00000020.pt"]
    up_to_16 = losses(tmp_path)
    assert [r[0] for r in up_to_16] == list(range(1, 17))
    assert run_in_process(tiny_overrides(tmp_path, cache_dir, steps=20, resume="auto", allow_changes="[trainer.max_steps]",
                                         **{"trainer.ckpt_every": 4, "trainer.keep_ckpts": 1})) == 0
    assert losses(tmp_path)[:16] == up_to_16  # resumed from step 16 (a restart from 0 rewrites 11-16)


def test_resume_auto_refuses_when_every_checkpoint_is_unusable_and_keeps_the_metrics(tmp_path, cache_dir, capsys):
    overrides = tiny_overrides(tmp_path, cache_dir, steps=8, **{"trainer.keep_ckpts": 2})
    assert run_in_process(overrides) == 0
    metrics = (tmp_path / "metrics.jsonl").read_text()
    for path in CheckpointStore(tmp_path).list():
        path.write_bytes(path.read_bytes()[:3000])
    assert run_in_process(overrides + ["resume=auto"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: resume=auto: none of the 2 checkpoint(s)") and "move them aside" in err, err
    assert (tmp_path / "metrics.jsonl").read_text() == metrics


# --------------------------------------------------------------------------- a full disk

def test_full_disk_during_save_is_one_line_and_leaves_older_checkpoints(tmp_path, cache_dir, capsys, monkeypatch):
    real_save = torch.save

    def save_until_step_8(obj, f, *args, **kwargs):
        if obj["step"] == 8:
            f.write(b"partial checkpoint bytes")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", save_until_step_8)
    assert run_in_process(tiny_overrides(tmp_path, cache_dir, steps=12)) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("tokenizing")]
    assert len(err) == 1 and err[0].startswith("error: could not write checkpoint ") and "No space left" in err[0], err
    assert "the last good checkpoint is" in err[0] and "step_00000004.pt" in err[0]
    ckpt_dir = tmp_path / "checkpoints"
    assert [p.name for p in ckpt_dir.iterdir()] == ["step_00000004.pt"]  # no .tmp left behind
    assert load_checkpoint(ckpt_dir / "step_00000004.pt")["step"] == 4


# --------------------------------------------------------------------------- one run per run.dir (item 2)

def test_a_second_run_on_a_locked_run_dir_refuses_naming_the_holder(tmp_path, cache_dir, capsys):
    with RunDirLock(tmp_path):
        assert run_in_process(tiny_overrides(tmp_path, cache_dir, resume="auto")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: run.dir={tmp_path} is in use by another run (pid {os.getpid()}): wait for it to "
                       f"finish or choose another run.dir"), err
    assert not (tmp_path / "metrics.jsonl").exists()
    assert run_in_process(tiny_overrides(tmp_path, cache_dir, steps=2)) == 0  # released with the holder


def test_kill_9_leaves_no_stale_lock_and_a_live_run_is_not_disturbed(tmp_path, cache_dir, capsys):
    overrides = tiny_overrides(tmp_path, cache_dir, steps=400, resume="auto", **{"trainer.ckpt_every": 2})
    proc = subprocess.Popen(train_command(overrides), cwd=REPO, env=subprocess_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not CheckpointStore(tmp_path).list() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.poll() is None
        assert run_in_process(overrides + ["optim.lr=0.5"]) == 2
        assert f"is in use by another run (pid {proc.pid})" in capsys.readouterr().err
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert run_in_process(tiny_overrides(tmp_path, cache_dir, steps=2, resume="auto",
                                         allow_changes="[trainer.max_steps]")) == 0


# --------------------------------------------------------------------------- model config on resume (item 3)

@pytest.mark.parametrize("change,diff", [
    ({"model.n_head": 8, "model.n_kv_head": 4}, "model.n_head=4 in checkpoint, 8 now; model.n_kv_head=2 in checkpoint, 4 now"),
    ({"model.norm": "layernorm"}, "model.norm='rmsnorm' in checkpoint, 'layernorm' now"),
    ({"model.rope_theta": 500000.0}, "model.rope_theta=10000.0 in checkpoint, 500000.0 now"),
    ({"model.tie_embeddings": False}, "model.tie_embeddings=True in checkpoint, False now"),
], ids=["heads", "norm", "rope_theta", "tie_embeddings"])
def test_resume_refuses_a_shape_preserving_model_change(tmp_path, cache_dir, finished_run, capsys, change, diff):
    ckpt = CheckpointStore(finished_run).path(4)
    config_before = (finished_run / "config.yaml").read_text()
    assert run_in_process(tiny_overrides(finished_run, cache_dir, steps=8, resume="auto", **change)) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"error: checkpoint {ckpt} was trained with another model config: {diff} (pass the "
                   f"checkpoint's values, or start a new run.dir)"), err
    assert (finished_run / "config.yaml").read_text() == config_before


def test_memory_features_may_change_on_resume(tmp_path, cache_dir, finished_run):
    ckpt = CheckpointStore(finished_run).path(4)
    assert run_in_process(tiny_overrides(tmp_path, cache_dir, steps=5, resume=str(ckpt), **{
        "model.activation_checkpointing": "full", "model.loss_chunk_size": 16})) == 0


# --------------------------------------------------------------------------- data changes (item 5)

def corpus(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(4):
        (folder / f"doc{i}.txt").write_text(("def f%d(x):\n    return x * %d\n" % (i, i)) * 400)
    return folder


def files_overrides(run_dir, cache_dir, data_dir, steps=4, **extra):
    return tiny_overrides(run_dir, cache_dir, steps=steps, **{
        "data": "files", "data.paths": f"[{data_dir}]", "data.val_fraction": 0.25, **extra})[:]


def _drop_max_bytes(overrides):
    return [o for o in overrides if not o.startswith("data.max_bytes=")]


def edit_keeping_size_and_mtime(path: Path) -> None:
    st = path.stat()
    text = path.read_text()
    path.write_text(text.replace("return", "yield!", 1))  # same length
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_fingerprint_follows_content_not_mtime(tmp_path):
    from data.sources import build_source
    from omegaconf import OmegaConf

    data_dir = corpus(tmp_path / "corpus")
    cfg = OmegaConf.create({"name": "files", "paths": [str(data_dir)], "text_field": "text",
                            "text_extensions": [".txt"]})
    before = build_source(cfg, tmp_path / "cache").fingerprint
    os.utime(data_dir / "doc1.txt")  # touch: same bytes
    assert build_source(cfg, tmp_path / "cache").fingerprint == before
    edit_keeping_size_and_mtime(data_dir / "doc1.txt")  # what cp -p / rsync -a leave
    assert build_source(cfg, tmp_path / "cache").fingerprint != before


def test_jsonl_edit_with_mtime_restored_is_not_read_from_a_stale_datasets_cache(tmp_path):
    from data.sources import build_source
    from omegaconf import OmegaConf

    records = tmp_path / "r.jsonl"
    records.write_text("".join(json.dumps({"text": f"record {i} aaaa"}) + "\n" for i in range(3)))
    cfg = OmegaConf.create({"name": "files", "paths": [str(records)], "text_field": "text"})
    assert [t for _, t in build_source(cfg, tmp_path / "cache").documents()][0] == "record 0 aaaa"
    st = records.stat()
    records.write_text(records.read_text().replace("aaaa", "bbbb"))
    os.utime(records, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert [t for _, t in build_source(cfg, tmp_path / "cache").documents()][0] == "record 0 bbbb"


def test_changed_data_refuses_with_a_way_forward_and_allow_changed_records_it(tmp_path, cache_dir, capsys):
    data_dir = corpus(tmp_path / "corpus")
    run_dir = tmp_path / "run"
    overrides = _drop_max_bytes(files_overrides(run_dir, cache_dir, data_dir))
    assert run_in_process(overrides) == 0
    os.utime(data_dir / "doc0.txt")  # a touch alone changes nothing
    assert run_in_process(_drop_max_bytes(files_overrides(run_dir, cache_dir, data_dir, steps=6, resume="auto",
                                                          allow_changes="[trainer.max_steps]"))) == 0
    edit_keeping_size_and_mtime(data_dir / "doc2.txt")
    resume = _drop_max_bytes(files_overrides(run_dir, cache_dir, data_dir, steps=8, resume="auto",
                                             allow_changes="[trainer.max_steps]"))
    assert run_in_process(resume) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "was trained on data files-" in err and "pass data.allow_changed=true" in err, err
    assert run_in_process(resume + ["data.allow_changed=true"]) == 0
    changes = [json.loads(line) for line in (run_dir / "data_changes.jsonl").read_text().splitlines()]
    assert len(changes) == 1 and changes[0]["step"] == 6 and changes[0]["from"] != changes[0]["to"]
    assert [r[0] for r in losses(run_dir)][-1] == 8


def test_another_tokenizer_is_refused_even_where_changed_data_is_allowed(tmp_path, cache_dir, capsys):
    """A checkpoint's token ids mean its tokenizer's text: a resume that tokenizes otherwise (here
    bytes -> a BPE whose padded vocabulary has the same rows) is refused in one line naming both,
    data.allow_changed or not, before the corpus is tokenized with the new one."""
    data_dir = corpus(tmp_path / "corpus")
    run_dir = tmp_path / "run"
    assert run_in_process(_drop_max_bytes(files_overrides(run_dir, cache_dir, data_dir))) == 0
    resume = _drop_max_bytes(files_overrides(run_dir, cache_dir, data_dir, steps=6, resume="auto",
                                             allow_changes="[trainer.max_steps]"))
    for extra in ([], ["data.allow_changed=true"]):
        assert run_in_process(resume + ["tokenizer=bpe", "tokenizer.vocab_size=300", *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "was trained with tokenizer bytes, this run's is bpe" in err and "does not cover it" in err, err
        assert [d.name for d in (cache_dir / "tokens").iterdir() if "bpe" in d.name] == []   # nothing tokenized
    assert run_in_process(resume) == 0   # the same tokenizer resumes


def test_checkpoints_from_before_checksums_still_load(tmp_path):
    path = CheckpointStore(tmp_path).path(5)
    path.parent.mkdir(parents=True)
    torch.save({"format_version": 1, **state(5)}, path)  # what the previous release wrote
    assert load_checkpoint(path)["step"] == 5
    save_checkpoint(CheckpointStore(tmp_path).path(6), state(6))
    CheckpointStore(tmp_path).prune(keep=2)
    assert [p.name for p in CheckpointStore(tmp_path).list()] == ["step_00000005.pt", "step_00000006.pt"]
