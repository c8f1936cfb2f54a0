"""Checkpoint files: atomic save, pruning, validation on load, and one-line errors for corrupt
or mismatched checkpoints handed to train.py."""
from __future__ import annotations

import logging

import pytest
import torch

from tests.trainrun import cache_dir, finished_run, run_in_process, tiny_overrides  # noqa: F401 (fixtures)
from training.run.store import CheckpointError, CheckpointStore, load_checkpoint, restore_model, save_checkpoint


def state(step: int, **extra) -> dict:
    return {"step": step, "tokens": step * 10, "model": {"w": torch.full((2, 3), float(step))},
            "optimizer": {}, "rng": {"torch": torch.get_rng_state()}, "sampler": {"position": step},
            "config": {"model": {"d_model": 3}}, "wandb_id": None, **extra}


def test_save_is_atomic_and_round_trips(tmp_path):
    path = save_checkpoint(CheckpointStore(tmp_path).path(7), state(7))
    assert path.name == "step_00000007.pt" and [p.name for p in path.parent.iterdir()] == [path.name]
    loaded = load_checkpoint(path)
    assert loaded["step"] == 7 and torch.equal(loaded["model"]["w"], torch.full((2, 3), 7.0))


def test_save_refuses_an_incomplete_state(tmp_path):
    with pytest.raises(ValueError, match="lacks sampler"):
        save_checkpoint(tmp_path / "x.pt", {k: v for k, v in state(1).items() if k != "sampler"})


def test_prune_keeps_the_newest_and_drops_temp_files(tmp_path):
    for step in (2, 10, 4, 8):
        save_checkpoint(CheckpointStore(tmp_path).path(step), state(step))
    stale = tmp_path / "checkpoints" / "step_00000012.pt.tmp"
    stale.write_bytes(b"half a checkpoint")
    CheckpointStore(tmp_path).prune(keep=2)
    assert [p.name for p in CheckpointStore(tmp_path).list()] == ["step_00000008.pt", "step_00000010.pt"]
    assert not stale.exists()


def test_latest_skips_unusable_files_with_a_warning_naming_them(tmp_path, caplog):
    for step in (1, 2, 3):
        save_checkpoint(CheckpointStore(tmp_path).path(step), state(step))
    newest = CheckpointStore(tmp_path).path(3)
    newest.write_bytes(newest.read_bytes()[:100])
    torch.save({"not": "ours"}, CheckpointStore(tmp_path).path(2))
    with caplog.at_level(logging.WARNING):
        path, loaded = CheckpointStore(tmp_path).latest()
    assert path == CheckpointStore(tmp_path).path(1) and loaded["step"] == 1
    assert "step_00000003.pt is unreadable" in caplog.text
    assert "step_00000002.pt is not a flashtrain checkpoint: lacks format_version, step" in caplog.text
    assert CheckpointStore(tmp_path / "nothing").latest() is None


def test_weights_only_load_refuses_pickled_code(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save(state(1, sampler=logging.getLogger("x")), path)  # an arbitrary object needs unpickling code
    with pytest.raises(CheckpointError, match=rf"checkpoint {path} is unreadable"):
        load_checkpoint(path)


def test_restore_model_names_the_mismatch(tmp_path):
    model = torch.nn.Linear(4, 3, bias=False)  # weight (3, 4) against the saved (2, 3)
    with pytest.raises(CheckpointError, match=r"ckpt\.pt does not match the model: weight has shape \(2, 3\)"
                                              r".*\(3, 4\) in model.*\(and 1 more\); config: model\.d_model=3 "
                                              r"in checkpoint, 4 now"):
        restore_model(model, state(1, model={"w": torch.zeros(2, 3), "weight": torch.zeros(2, 3)}),
                      tmp_path / "ckpt.pt", {"d_model": 4})


@pytest.mark.parametrize("change,message", [
    ({"model.d_model": 128}, "was trained with another model config: model.d_model=64 in checkpoint, 128 now"),
    ({"data.max_bytes": 1_000_000}, "was trained on data stdlib"),
    ({"data.windows": "fixed"}, ": its data position is in moving windows (its run had data.windows=moving) but "
                                "this run has data.windows=fixed: pass data.windows=moving to continue it exactly"),
    ({"optim.decay_embeddings": False}, "decays 9 parameter tensors, this run 8: optim.decay_embeddings differs "
                                        "from the checkpoint's run"),
], ids=["model-shape", "data", "windows", "decay-groups"])
def test_train_refuses_a_mismatched_checkpoint(tmp_path, cache_dir, finished_run, capsys, change, message):
    ckpt = finished_run / "checkpoints" / "step_00000004.pt"
    assert run_in_process(tiny_overrides(tmp_path, cache_dir, resume=str(ckpt), **change)) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: checkpoint {ckpt}") and message in err, err


def test_train_refuses_a_corrupt_checkpoint_path(tmp_path, cache_dir, finished_run, capsys):
    ckpt = tmp_path / "step_00000004.pt"
    ckpt.write_bytes((finished_run / "checkpoints" / "step_00000004.pt").read_bytes()[:-1000])
    assert run_in_process(tiny_overrides(tmp_path / "run", cache_dir, resume=str(ckpt))) == 2
    assert f"error: checkpoint {ckpt} is unreadable (incomplete or corrupt)" in capsys.readouterr().err


def test_fresh_run_refuses_a_run_dir_with_checkpoints(finished_run, cache_dir, capsys):
    assert run_in_process(tiny_overrides(finished_run, cache_dir, steps=4)) == 2
    assert "already holds checkpoints: pass resume=auto" in capsys.readouterr().err
