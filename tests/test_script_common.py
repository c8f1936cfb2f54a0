"""scripts/_common.py: result metadata names the code that produced it; bad input is one line."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import _common  # noqa: E402
from tests.trainrun import subprocess_env  # noqa: E402


def test_commit_given_in_the_environment_wins(monkeypatch):
    """A copy of the tree on a GPU machine can carry a stale .git; the caller knows better."""
    monkeypatch.setenv(_common.COMMIT_ENV, "abc1234")
    assert _common.git_commit() == "abc1234"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()


def test_commit_from_git_otherwise(monkeypatch, tmp_path):
    """HEAD's hash, with -dirty exactly when a tracked file differs (an untracked one does not count);
    None, not a guess, where there is no repository."""
    monkeypatch.delenv(_common.COMMIT_ENV, raising=False)
    repo = tmp_path / "repo"
    repo.mkdir()
    monkeypatch.setattr(_common, "REPO_ROOT", repo)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))   # no repository above it counts
    if subprocess.run(["git", "--version"], capture_output=True).returncode != 0:
        pytest.skip("no git on this machine")
    assert _common.git_commit() is None   # not a repository (tmp_path lies outside any)
    _git(repo, "init", "-q")
    (repo / "a.txt").write_text("one\n")
    _git(repo, "add", "a.txt")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "first")
    head = _git(repo, "rev-parse", "HEAD")
    assert len(head) == 40 and _common.git_commit() == head
    (repo / "b.txt").write_text("untracked\n")
    assert _common.git_commit() == head
    (repo / "a.txt").write_text("two\n")
    assert _common.git_commit() == f"{head}-dirty"


@pytest.mark.parametrize("args, message", [
    (["--attention", "bogus"], "error: --attention: 'bogus' is not registered"),
    (["impls=[naive]"], "error: unknown config key 'impls'"),   # the old name: one name, --attention, now
    (["start=abc"], "error: start='abc': must be null or a positive integer"),
    (["model=nosuch"], "error: In 'train': Could not find 'model/nosuch'"),
])
def test_bad_input_is_one_line_on_stderr(args, message):
    script = Path(__file__).resolve().parent.parent / "scripts" / "max_context.py"
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr
    assert done.stderr.startswith(message)


SCRIPTS = sorted((Path(__file__).resolve().parent.parent / "scripts").rglob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_no_tool_writes_into_the_committed_results_by_default(script):
    """benchmarks/ holds committed results: a tool writes there only when told (`--out benchmarks`);
    by default its results go to the git-ignored outputs/<tool>/ (_common.add_out_argument)."""
    source = script.read_text()
    assert not re.search(r"""REPO_ROOT\s*/\s*["']benchmarks""", source), script.name
    assert not re.search(r"""^\s*out_dir:\s*benchmarks""", (_common.REPO_ROOT / "configs" / "max_context.yaml")
                         .read_text(), re.M)


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_one_name_per_idea_across_tools(script):
    """One name for the attention implementation(s) (--attention) and the output folder (--out)."""
    source = script.read_text()
    for old in ("--backends", "--attentions", "--out-dir", "impls="):
        assert old not in source, f"{script.name} still says {old}"


def test_outputs_are_git_ignored_and_the_tests_write_elsewhere(tmp_path):
    """The suite used to leave its results in the checkout's outputs/ (the README's compare_runs
    example, among others): the tests point $FLASHTRAIN_OUTPUTS at a temporary folder."""
    ignored = (Path(__file__).resolve().parent.parent / ".gitignore").read_text().split()
    assert "/outputs/" in ignored and "/benchmarks/" not in ignored
    env = {k: v for k, v in subprocess_env().items() if k != "FLASHTRAIN_OUTPUTS"}
    default = subprocess.run([sys.executable, "-c", "import _common; print(_common.OUTPUTS)"], cwd=tmp_path,
                             env={**env, "PYTHONPATH": str(_common.REPO_ROOT / "scripts")}, capture_output=True,
                             text=True, timeout=60)
    assert default.stdout.strip() == str(_common.REPO_ROOT / "outputs"), default.stderr
    elsewhere = Path(os.environ["FLASHTRAIN_OUTPUTS"])   # set by conftest.py, passed on to every subprocess
    assert _common.OUTPUTS == elsewhere and not elsewhere.is_relative_to(_common.REPO_ROOT)
    assert subprocess_env()["FLASHTRAIN_OUTPUTS"] == str(elsewhere)


def test_a_wide_table_in_a_log_is_printed_whole(capsys):
    """Off a terminal the console was 200 columns wide: compare_runs' table of many differing keys
    came out with its cells cut to '…'."""
    headers = ["run", *(f"model.key_{i:02d}" for i in range(14))]
    rows = [[f"runs/sweep-{j}", *(f"value-{i:02d}-{j}-abcdefgh" for i in range(14))] for j in range(2)]
    _common.print_table("wide", headers, rows)
    out = capsys.readouterr().out
    assert "…" not in out and max(map(len, out.splitlines())) > 200
    assert all(cell in out for row in rows for cell in row) and all(h in out for h in headers)


def test_pass_timer_splits_each_call_at_the_forwards_end():
    """Forward, backward and forward+backward come from the same calls: the backward gets the
    forward's output and its span starts where the forward's ends (on the CPU, perf_counter)."""
    import time as clock

    import torch

    seen = []

    def forward():
        clock.sleep(0.01)
        return len(seen)

    def backward(out):
        seen.append(out)
        clock.sleep(0.06)

    timer, how = _common.pass_timer(torch.device("cpu"), cpu_calls=3)
    ms = timer(forward, backward)
    assert seen == [0, 1, 2, 3]   # one untimed call, then three timed ones, each backward on its own forward
    assert set(ms) == set(_common.PASSES) and "perf_counter" in how
    assert 10 <= ms["fwd"] < ms["bwd"] and ms["bwd"] >= 60 and ms["fwd+bwd"] >= 70
