"""scripts/_common.py: result metadata names the code that produced it; bad input is one line."""
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import _common  # noqa: E402


def test_commit_given_in_the_environment_wins(monkeypatch):
    """A copy of the tree on a GPU machine can carry a stale .git; the caller knows better."""
    monkeypatch.setenv(_common.COMMIT_ENV, "abc1234")
    assert _common.git_commit() == "abc1234"


def test_commit_from_git_otherwise(monkeypatch):
    monkeypatch.delenv(_common.COMMIT_ENV, raising=False)
    commit = _common.git_commit()
    assert commit is None or len(commit.removesuffix("-dirty")) == 40


@pytest.mark.parametrize("args, message", [
    (["--attention", "bogus"], "error: --attention: 'bogus' is not registered"),
    (["impls=[naive]"], "error: unknown config key 'impls'"),   # the old name: one name, --attention, now
    (["start=abc"], "error: start='abc': must be a positive integer"),
    (["model=nosuch"], "error: In 'train': Could not find 'model/nosuch'"),
])
def test_bad_input_is_one_line_on_stderr(args, message):
    script = Path(__file__).resolve().parent.parent / "scripts" / "max_context.py"
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr
    assert done.stderr.startswith(message)
