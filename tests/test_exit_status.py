"""The exit-status contract of train.py (docs/training.md, "Stopping and exit statuses"): bad input
is one line on stderr and status 2 before any step, whether Hydra, a config value, a folder or the
corpus is at fault."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.trainrun import cache_dir, finished_run  # noqa: F401 (fixtures)
from tests.trainrun import REPO, run_in_process, run_subprocess, tiny_overrides
from training.process import exits
from training.run.store import CheckpointStore


def test_the_readme_table_is_the_one_table():
    """What each status means is said once (training/process/exits.py); the README shows that table
    as it is, and `--help` prints it (test_train.py)."""
    readme = (REPO / "README.md").read_text()
    assert exits.markdown_table() in readme
    assert sorted(c for codes, _ in exits.EXIT_STATUSES for c in codes) == [0, 1, 2, 129, 130, 143]

HYDRA_ERRORS = [
    (["trainer.foo=1"], "error: unknown config key 'trainer.foo' (`python train.py --cfg job` prints every valid key)"),
    (["bogus=1"], "error: unknown config key 'bogus' (`python train.py --cfg job` prints every valid key)"),
    (["model=gpt2small"], "error: In 'train': Could not find 'model/gpt2small'; Available options in 'model': "
                          "gpt-1b, gpt2-medium, gpt2-small, tiny"),
    (["experiment=cpu-smal"], "error: In 'train': Could not find 'experiment/cpu-smal'; Available options in "
                              "'experiment': " + ", ".join(sorted(p.stem for p in (REPO / "configs/experiment").glob("*.yaml")))),
    (["data=files", "data.paths=[~/corpus]"], "error: LexerNoViableAltException: data.paths=[~/corpus]; ^; a value "
     "holding ~, spaces or other special characters goes in quotes, e.g. 'data.paths=[\"~/corpus\"]'"),
]


@pytest.mark.parametrize("overrides,line", HYDRA_ERRORS, ids=["unknown-key", "unknown-top-key", "group-typo",
                                                                     "preset-typo", "unquoted-tilde"])
def test_hydra_composition_errors_are_one_line_and_exit_2(tmp_path, overrides, line):
    result = run_subprocess([f"run.dir={tmp_path}", *overrides])
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [line]


WRONG_TYPES = [
    ({"optim.lr": "abc"}, "optim.lr='abc': must be a number"),
    ({"optim.betas": 0.9}, "optim.betas=0.9: expected two values in [0, 1)"),
    ({"model.n_layer": 2.5}, "model.n_layer=2.5: must be a positive integer"),
    ({"trainer.precision": "fp8"}, "trainer.precision='fp8': expected one of auto, bf16, fp32"),
    ({"trainer.keep_ckpts": 0}, "trainer.keep_ckpts=0: must be a positive integer"),
    ({"attention.window": 0}, "attention.window=0: must be null or a positive integer"),
    ({"model.dropout": "abc"}, "model.dropout='abc': must be a number"),
    ({"model.tie_embeddings": "maybe"}, "model.tie_embeddings='maybe': must be true or false"),
    ({"data.val_fraction": "abc"}, "data.val_fraction='abc': must be a number in [0, 1)"),
    ({"data.val_fraction": -0.1}, "data.val_fraction=-0.1: must be a number in [0, 1)"),
    ({"model.pos_emb": "learned"}, "model.max_seq_len=1048576: with model.pos_emb=learned this is the size of the "
                                   "position table, larger than trainer.seq_len=64 needs"),
]


@pytest.mark.parametrize("override,message", WRONG_TYPES, ids=[f"{next(iter(o))}={next(iter(o.values()))}"
                                                              for o, _ in WRONG_TYPES])
def test_wrong_typed_values_name_the_key(tmp_path, cache_dir, capsys, override, message):
    assert run_in_process(tiny_overrides(tmp_path / "run", cache_dir, **override)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {message}"), err


def test_learned_positions_sized_to_the_training_length_train(tmp_path, cache_dir):
    assert run_in_process(tiny_overrides(tmp_path, cache_dir, steps=1, **{
        "model.pos_emb": "learned", "model.max_seq_len": 64})) == 0


def make_read_only(folder):
    """chmod for a normal user; root ignores modes, so make the folder immutable instead."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o555)
    if os.geteuid() == 0:
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)]).returncode:
            pytest.skip("running as root without chattr: cannot make a read-only folder")
    return folder


def undo_read_only(folder):
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(folder)])
    folder.chmod(0o755)


@pytest.mark.parametrize("which", ["run.dir", "data.cache_dir"])
def test_unwritable_folders_are_one_line_before_the_data_setup(tmp_path, cache_dir, capsys, which):
    folder = make_read_only(tmp_path / "ro")
    try:
        overrides = tiny_overrides(tmp_path / "run", cache_dir, **{which: folder})
        assert run_in_process(overrides) == 2
    finally:
        undo_read_only(folder)
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {which}={folder} is not writable ("), err
    assert not any("tokenizing" in line for line in err)


def test_resume_pointing_at_a_folder_says_what_to_pass(tmp_path, cache_dir, finished_run, capsys):
    assert run_in_process(tiny_overrides(tmp_path, cache_dir, resume=str(finished_run))) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: resume={finished_run} is a folder: pass a checkpoint (") and \
        f"run.dir={finished_run} resume=auto" in err, err


def test_resumed_run_with_max_steps_reached_says_so(finished_run, cache_dir, capsys):
    metrics = (finished_run / "metrics.jsonl").read_text()
    assert run_in_process(tiny_overrides(finished_run, cache_dir, steps=4, resume="auto")) == 0
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"nothing to do: {CheckpointStore(finished_run).path(4)} is at step 4, trainer.max_steps=4 is reached; "
                   f"raise trainer.max_steps to train further"), err
    assert (finished_run / "metrics.jsonl").read_text() == metrics


def test_nan_before_any_checkpoint_does_not_name_a_missing_folder(tmp_path, cache_dir, capsys):
    status = run_in_process(tiny_overrides(tmp_path, cache_dir, steps=40, **{
        "optim.lr": 1e4, "optim.min_lr": 0, "optim.warmup_steps": 0, "optim.grad_clip": 0,
        "trainer.ckpt_every": 0}))
    assert status == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "NaN/inf" in err and err.endswith("stopped without saving: no checkpoint was saved yet"), err
    assert not (tmp_path / "checkpoints").exists()


def test_stale_tokenization_folders_are_removed(tmp_path, cache_dir):
    from data.cache import remove_stale_builds

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / "tokens" / f"stdlib-bytes-0123456789abcdef.tmp-{dead.pid}"
    live = tmp_path / "tokens" / f"stdlib-bytes-0123456789abcdef.tmp-{os.getppid()}"
    for folder in (stale, live):
        folder.mkdir(parents=True)
        (folder / "tokens.bin").write_bytes(b"\0" * 10)
    with pytest.warns(UserWarning, match=f"left by a tokenization that was killed \\(pid {dead.pid}\\)"):
        remove_stale_builds(tmp_path / "tokens")
    assert not stale.exists() and live.exists()


def bad_corpus(folder, n_good: int, n_undecodable: int):
    folder.mkdir(parents=True)
    for i in range(n_good):
        (folder / f"good{i}.txt").write_text(("print('document %d')\n" % i) * 300)
    for i in range(n_undecodable):
        (folder / f"bad{i}.txt").write_bytes(b"latin-1 caf\xe9 " * 300)
    return folder


@pytest.mark.parametrize("bad_fraction,status", [(0.5, 0), (0.01, 2)], ids=["under-threshold", "over-threshold"])
def test_undecodable_files_are_counted_warned_and_fail_past_the_threshold(tmp_path, capsys, caplog, bad_fraction, status):
    folder = bad_corpus(tmp_path / "corpus", n_good=7, n_undecodable=1)
    overrides = [o for o in tiny_overrides(tmp_path / "run", tmp_path / "cache", steps=1)
                 if not o.startswith("data.max_bytes")]
    overrides += ["data=files", f"data.paths=[{folder}]", "data.val_fraction=0.2",
                  f"data.max_bad_fraction={bad_fraction}"]
    assert run_in_process(overrides) == status
    message = "1 of 8 documents are text files with bytes that are not UTF-8 (decoded with replacements) (corpus/bad0.txt)"
    if status:
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: {message}: more than "
                                                                           f"data.max_bad_fraction=0.01")
    else:
        assert message in caplog.text


def test_jsonl_records_without_the_text_field_are_counted(tmp_path, capsys):
    records = tmp_path / "r.jsonl"
    rows = [{"text": "x = %d\n" % i * 200} for i in range(6)] + [{"body": "no text field"}] * 2
    records.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [o for o in tiny_overrides(tmp_path / "run", tmp_path / "cache", steps=1)
                 if not o.startswith("data.max_bytes")]
    assert run_in_process(overrides + ["data=files", f"data.paths=[{records}]", "data.val_fraction=0.2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: 2 of 8 documents are json records without a 'text' field (record 6, record 7)"), err


def test_a_key_given_twice_is_refused_by_train_py_and_the_tools(tmp_path, capsys):
    """Hydra takes the last of `trainer.max_steps=5 trainer.max_steps=7` and says nothing."""
    import sys

    import train
    from tests.trainrun import REPO

    with pytest.raises(SystemExit) as refused:
        train.check_before_hydra([f"run.dir={tmp_path}", "trainer.max_steps=5", "+trainer.max_steps=7"])
    assert refused.value.code == 2
    assert capsys.readouterr().err.strip() == "error: trainer.max_steps is given twice (5, then 7): pass it once"
    sys.path.insert(0, str(REPO / "scripts"))
    import max_context

    with pytest.raises(ValueError, match=r"^model is given twice \(tiny, then gpt2-small\): pass it once$"):
        max_context.parse_args(["model=tiny", "--attention", "naive", "model=gpt2-small"])
    assert train.check_before_hydra(["-m", f"run.dir={tmp_path}", "trainer.max_steps=5", "seed=1,2"]) is None
