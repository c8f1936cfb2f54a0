"""Bad arguments to the tools in scripts/: one line on stderr, exit status 2, before any result
file is written or overwritten (they used to exit 0 with a nonsense table)."""
from __future__ import annotations

import sys

import pytest

from tests.trainrun import REPO, run_in_process, tiny_overrides

sys.path.insert(0, str(REPO / "scripts"))

import data_stats  # noqa: E402
import eval_loss_by_position  # noqa: E402
import eval_passkey  # noqa: E402
import max_context  # noqa: E402
from _common import run_cli  # noqa: E402

SENTINEL = "an earlier result\n"


def run_script(module, argv: list[str], monkeypatch, capsys) -> str:
    """The script as `python scripts/<tool>.py argv` runs it; returns its one stderr line."""
    monkeypatch.setattr(sys, "argv", [module.__file__, *argv])
    with pytest.raises(SystemExit) as exit_info:
        run_cli(module.main)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    assert run_in_process(tiny_overrides(root / "tiny", root / "cache", steps=2)) == 0
    return root / "tiny"


@pytest.mark.parametrize("override,message", [
    ("start=0", "start=0: must be a positive integer"),
    ("granularity=1000", "start=1024 is not a multiple of granularity=1000"),
    ("memory_budget_mb=-5", "memory_budget_mb=-5.0: must be null or a number > 0"),
])
def test_max_context_refuses_bad_search_settings(tmp_path, monkeypatch, capsys, override, message):
    for suffix in (".json", ".md"):
        (tmp_path / f"mc{suffix}").write_text(SENTINEL)
    line = run_script(max_context, ["model.vocab_size=256", "--attention", "naive", "memory_budget_mb=8", "device=cpu",
                                    "--out", str(tmp_path), "--name", "mc", override], monkeypatch, capsys)
    assert message in line, line
    assert all((tmp_path / f"mc{s}").read_text() == SENTINEL for s in (".json", ".md"))


@pytest.mark.parametrize("args,message", [
    (["--lengths", "0"], "--lengths 0: must be a positive integer"),
    (["--lengths", "-5"], "--lengths -5: must be a positive integer"),
    (["--lengths", "10"], "--lengths 10: a passkey prompt with a 5-digit key needs at least"),
    (["--key-digits", "0"], "--key-digits 0: must be a positive integer"),
    (["--trials", "0"], "--trials 0: must be a positive integer"),
    ([], "the run's trainer.seq_len=64 is shorter than the shortest passkey prompt"),
], ids=["length-0", "length-negative", "length-10", "key-digits-0", "trials-0", "default-lengths-empty"])
def test_eval_passkey_refuses_bad_arguments(trained, tmp_path, monkeypatch, capsys, args, message):
    out = tmp_path / "passkey_t.json"
    out.write_text(SENTINEL)
    line = run_script(eval_passkey, [str(trained), "--device", "cpu", "--out", str(tmp_path), "--name", "t",
                                     *args], monkeypatch, capsys)
    assert message in line, line
    assert out.read_text() == SENTINEL


@pytest.mark.parametrize("flag", ["--batches", "--buckets", "--batch-size", "--seq-len"])
def test_eval_loss_by_position_refuses_zero_counts(trained, tmp_path, monkeypatch, capsys, flag):
    out = tmp_path / "loss_by_position_t.json"
    out.write_text(SENTINEL)
    line = run_script(eval_loss_by_position, [str(trained), "--device", "cpu", "--out", str(tmp_path),
                                              "--name", "t", flag, "0"], monkeypatch, capsys)
    assert line == f"error: {flag} 0: must be a positive integer"
    assert out.read_text() == SENTINEL


def test_data_stats_json_into_a_folder_is_one_line_and_leaves_no_tmp(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "stats"
    folder.mkdir()
    line = run_script(data_stats, [f"data.cache_dir={tmp_path / 'cache'}", "data.max_bytes=200000",
                                   "--json", str(folder)], monkeypatch, capsys)
    assert line == f"error: --json {folder} is a folder: pass a file path"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats"] and not list(folder.iterdir())
