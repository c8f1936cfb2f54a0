"""Issue 25, "never lose a run" part two, items 1-2: one run (lineage) per run.dir, and a resume
that compares the training config. Each test reproduces one of the issue's cases."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.trainrun import cache_dir  # noqa: F401 (a fixture)
from tests.trainrun import losses, run_in_process, tiny_overrides
from training.run.files import LINEAGE as LINEAGE_FILE
from training.run.store import CheckpointStore, load_checkpoint, save_checkpoint


def names(run_dir: Path) -> list[str]:
    return [p.name for p in CheckpointStore(run_dir).list()]


def lineage_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / LINEAGE_FILE).read_text().splitlines()]


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run folder (the lock aside), by relative path."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def last_error(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, lines
    return errors[0]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, cache_dir):
    """Two finished 8-step runs (checkpoints at 4 and 8) with different seeds: two lineages."""
    a, b = tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")
    assert run_in_process(tiny_overrides(a, cache_dir, steps=8)) == 0
    assert run_in_process(tiny_overrides(b, cache_dir, steps=8, seed=7)) == 0
    return a, b


def copy_run(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns(".lock"))
    return dest


# --------------------------------------------------------------------------- identity

def test_checkpoints_record_the_run_and_lineage_jsonl_its_starts(two_runs):
    a, b = two_runs
    ids = {load_checkpoint(CheckpointStore(a).path(s))["lineage"]["id"] for s in (4, 8)}
    assert len(ids) == 1 and lineage_rows(a) == [{**lineage_rows(a)[0], "event": "start", "step": 0}]
    assert lineage_rows(a)[0]["run_id"] == ids.pop() != lineage_rows(b)[0]["run_id"]


# --------------------------------------------------------------------------- item 1: other runs' files

def test_resume_from_another_runs_checkpoint_into_a_used_folder_is_refused_touching_nothing(two_runs, tmp_path, cache_dir,
                                                                                            capsys):
    a, b = two_runs
    target = copy_run(a, tmp_path / "a")
    before = snapshot(target)
    other = CheckpointStore(b).path(4)
    assert run_in_process(tiny_overrides(target, cache_dir, steps=25, resume=str(other), seed=7,
                                         **{"trainer.keep_ckpts": 2})) == 2
    err = last_error(capsys)
    assert err.startswith(f"error: resume={other}: that checkpoint belongs to run {lineage_rows(b)[0]['run_id']}, "
                          f"but run.dir={target} holds run {lineage_rows(a)[0]['run_id']}") and "empty run.dir" in err
    assert snapshot(target) == before


def test_resume_from_another_run_into_an_empty_folder_is_a_branch_recording_its_parent(two_runs, tmp_path, cache_dir):
    a, _ = two_runs
    branch = tmp_path / "branch"
    assert run_in_process(tiny_overrides(branch, cache_dir, steps=8, resume=str(CheckpointStore(a).path(4)))) == 0
    (row,) = lineage_rows(branch)
    parent = {"id": lineage_rows(a)[0]["run_id"], "step": 4, "checkpoint": str(CheckpointStore(a).path(4).resolve())}
    assert row["event"] == "branch" and row["parent"] == parent and row["run_id"] != parent["id"]
    lineage = load_checkpoint(CheckpointStore(branch).path(8))["lineage"]
    assert lineage == {"id": row["run_id"], "parent": parent}
    assert losses(branch) == losses(a)[4:]  # the same settings: the branch repeats steps 5-8 exactly
    # and it is a run of its own: resume=auto continues the branch, not its parent
    assert run_in_process(tiny_overrides(branch, cache_dir, steps=12, resume="auto",
                                         allow_changes="[trainer.max_steps]")) == 0
    assert load_checkpoint(CheckpointStore(branch).path(12))["lineage"] == lineage


def test_a_branch_may_extend_the_context_which_a_continued_run_may_not(tmp_path, cache_dir, capsys, caplog):
    """Context extension: train in short windows, then go on in longer ones from the checkpoint. A
    branch may (its lineage records trainer.seq_len's change, and its data position is the same
    fraction of the epoch); the same run continued in other windows is still refused in one line,
    since its sampler position would index other tokens."""
    short = tmp_path / "short"
    assert run_in_process(tiny_overrides(short, cache_dir, steps=8, **{"trainer.seq_len": 32})) == 0
    parent = load_checkpoint(CheckpointStore(short).path(8))
    long = tmp_path / "long"
    assert run_in_process(tiny_overrides(long, cache_dir, steps=12, resume=str(CheckpointStore(short).path(8)),
                                         **{"trainer.seq_len": 64, "trainer.batch_size": 2})) == 0
    (row,) = lineage_rows(long)
    assert row["event"] == "branch" and row["changes"]["trainer.seq_len"] == [32, 64]
    assert "in windows of 64 tokens, not the checkpoint's 32" in caplog.text
    branched = load_checkpoint(CheckpointStore(long).path(12))
    assert branched["sampler"]["seq_len"] == 64 and branched["step"] == 12
    assert [r[0] for r in losses(long)] == [9, 10, 11, 12]
    epoch, cursor = parent["sampler"]["epoch"], parent["sampler"]["cursor"]
    fraction = cursor / parent["sampler"]["n_windows"]
    after = branched["sampler"]   # 4 steps of 2 windows on from the carried position
    assert after["epoch"] > epoch or abs((after["cursor"] - 8) / after["n_windows"] - fraction) < 0.05
    continued = copy_run(short, tmp_path / "continued")
    for changed_data in ({}, {"data.max_bytes": 1_500_000, "data.allow_changed": "true"}):   # carried, not re-cut
        assert run_in_process(tiny_overrides(continued, cache_dir, steps=12, resume="auto",
                                             allow_changes="[trainer.max_steps]",
                                             **{"trainer.seq_len": 64, **changed_data})) == 2
        assert "seq_len=32 but this run has seq_len=64" in last_error(capsys)


def test_a_foreign_checkpoint_in_the_folder_is_never_pruned_counted_or_resumed(two_runs, tmp_path, cache_dir, caplog):
    """The issue: a foreign step_00000099.pt dropped in the folder was kept and the run's own deleted."""
    a, b = two_runs
    target = copy_run(a, tmp_path / "a")
    foreign = CheckpointStore(target).path(99)
    shutil.copy(CheckpointStore(b).path(8), foreign)
    assert run_in_process(tiny_overrides(target, cache_dir, steps=16, resume="auto", allow_changes="[trainer.max_steps]",
                                         **{"trainer.keep_ckpts": 2})) == 0
    assert names(target) == ["step_00000012.pt", "step_00000016.pt", "step_00000099.pt"]
    assert [r[0] for r in losses(target)] == list(range(1, 17))  # resumed from its own 8, not the foreign 99
    assert f"{foreign} belongs to another run" in caplog.text


def test_a_foreign_checkpoint_this_run_would_overwrite_is_refused(two_runs, tmp_path, cache_dir, capsys):
    a, b = two_runs
    target = copy_run(a, tmp_path / "a")
    shutil.copy(CheckpointStore(b).path(8), CheckpointStore(target).path(12))
    before = snapshot(target)
    assert run_in_process(tiny_overrides(target, cache_dir, steps=16, resume="auto",
                                         allow_changes="[trainer.max_steps]")) == 2
    assert "would write over it at step 12" in last_error(capsys)
    assert snapshot(target) == before


def test_pruning_counts_and_deletes_only_its_own_runs_files(tmp_path):
    def state(step: int, run: str) -> dict:
        return {"step": step, "tokens": 0, "model": {"w": torch.zeros(2)}, "optimizer": {}, "rng": {},
                "sampler": {}, "config": {}, "wandb_id": None, "lineage": {"id": run, "parent": None}}

    for step, run in ((2, "mine"), (4, "other"), (6, "mine"), (8, "other"), (10, "mine")):
        save_checkpoint(CheckpointStore(tmp_path).path(step), state(step, run))
    CheckpointStore(tmp_path).prune(keep=1, run_id="mine")
    assert names(tmp_path) == ["step_00000004.pt", "step_00000008.pt", "step_00000010.pt"]


# --------------------------------------------------------------------------- item 1: a rewind

def test_a_rewind_moves_the_later_files_aside_and_prunes_only_its_own(tmp_path, cache_dir):
    """The issue: resume=<step 5> into a folder holding 5..60 with keep_ckpts=2 ended with only 55 and
    60, and a later resume=auto continued from 60 under a metrics file of the rewound run."""
    assert run_in_process(tiny_overrides(tmp_path, cache_dir, steps=20, **{"trainer.ckpt_every": 2,
                                                                          "trainer.keep_ckpts": 10})) == 0
    later = snapshot(tmp_path)
    assert run_in_process(tiny_overrides(tmp_path, cache_dir, steps=10, resume=str(CheckpointStore(tmp_path).path(4)),
                                         allow_changes="[trainer.max_steps]",
                                         **{"trainer.ckpt_every": 2, "trainer.keep_ckpts": 2})) == 0
    assert names(tmp_path) == ["step_00000008.pt", "step_00000010.pt"]  # its own newest two
    assert [r[0] for r in losses(tmp_path)] == list(range(1, 11))
    row = lineage_rows(tmp_path)[-1]
    assert row["event"] == "rewind" and row["step"] == 4
    aside = tmp_path / row["superseded"]
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == [f"step_{s:08d}.pt" for s in range(6, 21, 2)]
    assert (aside / "model.safetensors").read_bytes() == later["model.safetensors"]  # nothing lost
    assert [json.loads(line)["step"] for line in (aside / "metrics.jsonl").read_text().splitlines()] == list(range(5, 21))
    # and resume=auto now continues the rewound run, from its own step 10
    assert run_in_process(tiny_overrides(tmp_path, cache_dir, steps=10, resume="auto",
                                         **{"trainer.ckpt_every": 2, "trainer.keep_ckpts": 2})) == 0


# --------------------------------------------------------------------------- item 1: nothing usable

def test_resume_auto_refuses_a_finished_run_whose_checkpoints_were_removed(two_runs, tmp_path, cache_dir, capsys):
    """The issue: it restarted from step 0, shrank metrics.jsonl and replaced model.safetensors."""
    target = copy_run(two_runs[0], tmp_path / "a")
    shutil.rmtree(target / "checkpoints")
    before = snapshot(target)
    assert run_in_process(tiny_overrides(target, cache_dir, steps=8, resume="auto")) == 2
    err = last_error(capsys)
    assert err == (f"error: resume=auto: run.dir={target} holds metrics.jsonl up to step 8, model.safetensors but no "
                   f"checkpoint: starting over would replace them; move them aside (or choose another run.dir) to "
                   f"start from step 0"), err
    assert snapshot(target) == before


@pytest.mark.parametrize("keep", ["metrics.jsonl", "model.safetensors"])
def test_a_fresh_run_refuses_a_folder_holding_a_runs_metrics_or_weights(two_runs, tmp_path, cache_dir, capsys, keep):
    target = tmp_path / "a"
    target.mkdir()
    shutil.copy(two_runs[0] / keep, target / keep)
    assert run_in_process(tiny_overrides(target, cache_dir, steps=8)) == 2
    assert last_error(capsys).startswith(f"error: run.dir={target} already holds a run (")
    assert [p.name for p in target.iterdir() if p.name != ".lock"] == [keep]


def test_checkpoints_from_before_lineages_still_resume_and_are_pruned_as_the_folders_own(tmp_path, cache_dir):
    assert run_in_process(tiny_overrides(tmp_path, cache_dir, steps=8, **{"trainer.keep_ckpts": 2})) == 0
    for step in (4, 8):  # rewrite them as the previous format wrote them: no lineage, no lineage.jsonl
        path = CheckpointStore(tmp_path).path(step)
        state = {k: v for k, v in load_checkpoint(path).items() if k not in ("lineage", "checksum", "format_version")}
        path.unlink()
        save_checkpoint(path, state)
    (tmp_path / LINEAGE_FILE).unlink()
    uninterrupted = losses(tmp_path)
    assert run_in_process(tiny_overrides(tmp_path, cache_dir, steps=8, resume=str(CheckpointStore(tmp_path).path(4)),
                                         **{"trainer.keep_ckpts": 2})) == 0
    assert losses(tmp_path) == uninterrupted and names(tmp_path) == ["step_00000004.pt", "step_00000008.pt"]


# --------------------------------------------------------------------------- item 2: the training config

def test_resume_refuses_changed_training_settings_in_one_line_listing_the_keys(two_runs, tmp_path, cache_dir, capsys):
    """The issue: a forgotten override changed the learning rate silently mid-run."""
    target = copy_run(two_runs[0], tmp_path / "a")
    before = snapshot(target)
    changed = tiny_overrides(target, cache_dir, steps=12, resume="auto", **{"optim.lr": 0.01, "optim.min_lr": 0})
    assert run_in_process(changed) == 2
    ckpt = CheckpointStore(target).path(8)
    assert last_error(capsys) == (
        f"error: checkpoint {ckpt} was trained with other training settings: trainer.max_steps=8 in checkpoint, 12 "
        f"now; optim.lr=0.001 in checkpoint, 0.01 now; optim.min_lr=0.0001 in checkpoint, 0.0 now; pass allow_changes="
        f"[trainer.max_steps,optim.lr,optim.min_lr] to continue with the new values (recorded in "
        f"{target / LINEAGE_FILE}), or the checkpoint's values")
    assert snapshot(target) == before
    # accepted explicitly (a group name covers its keys): recorded, and the new values are used
    assert run_in_process(changed + ["allow_changes=[optim,trainer.max_steps]"]) == 0
    row = lineage_rows(target)[-1]
    assert row["event"] == "resume" and row["changes"] == {"trainer.max_steps": [8, 12], "optim.lr": [0.001, 0.01],
                                                          "optim.min_lr": [0.0001, 0.0]}
    assert [r[0] for r in losses(target)] == list(range(1, 13)) and losses(target)[8][3] > 0.002  # lr from 0.01


@pytest.mark.parametrize("key,value", [("seed", 5), ("trainer.seq_len", 32)])
def test_what_orders_the_training_windows_cannot_change_even_when_allowed(two_runs, tmp_path, cache_dir, capsys, key,
                                                                           value):
    target = copy_run(two_runs[0], tmp_path / "a")
    assert run_in_process(tiny_overrides(target, cache_dir, steps=8, resume="auto", **{key: value})) == 2
    assert f"sampler state has {key.split('.')[-1]}=" in last_error(capsys)
    assert run_in_process(tiny_overrides(target, cache_dir, steps=8, resume="auto", allow_changes=f"[{key}]",
                                         **{key: value})) == 2
    assert last_error(capsys).startswith(f"error: allow_changes: {key} cannot change within a run (the data sampler")


def test_settings_that_do_not_change_the_numbers_may_change_and_resume_bit_identically(tmp_path, cache_dir):
    base = tiny_overrides(tmp_path, cache_dir, steps=12, **{"trainer.keep_ckpts": 3})
    assert run_in_process(base) == 0
    uninterrupted = losses(tmp_path)
    free = {"trainer.log_every": 2, "trainer.keep_ckpts": 4, "trainer.ckpt_every": 5, "trainer.progress": "true",
            "trainer.deterministic": "true"}
    assert run_in_process(tiny_overrides(tmp_path, cache_dir, steps=12, resume=str(CheckpointStore(tmp_path).path(4)),
                                         **free)) == 0
    assert [r for r in losses(tmp_path) if r[0] <= 4] == uninterrupted[:4]
    assert [r for r in losses(tmp_path) if r[0] > 4] == uninterrupted[5::2]  # logged every 2nd step now


def test_allow_changes_names_only_training_settings(tmp_path, cache_dir, capsys):
    assert run_in_process(tiny_overrides(tmp_path, cache_dir, allow_changes="[model.n_layer]")) == 2
    assert last_error(capsys).startswith("error: allow_changes: 'model.n_layer' is not a training setting")


def test_a_resume_without_the_runs_preset_names_the_preset(tmp_path, cache_dir, capsys):
    """The advice used to be allow_changes=[...] of the preset's own settings, which would change
    the run's hyperparameters; the preset is what the command left out."""
    with_preset = tiny_overrides(tmp_path, cache_dir, steps=4, experiment="cpu-small")
    assert run_in_process(with_preset) == 0
    before = snapshot(tmp_path)
    assert run_in_process(tiny_overrides(tmp_path, cache_dir, steps=4, resume="auto")) == 2
    err = last_error(capsys)
    assert err.startswith(f"error: checkpoint {CheckpointStore(tmp_path).path(4)} was trained with other training "
                          "settings: optim.lr=0.002 in checkpoint, 0.001 now; optim.min_lr=0.0002 in checkpoint, "
                          "0.0001 now; the run was made with experiment=cpu-small, which this command leaves out: "
                          "add experiment=cpu-small"), err
    assert snapshot(tmp_path) == before
    assert run_in_process(with_preset + ["resume=auto"]) == 0   # nothing to do: it is the same run
