"""The metadata stored beside every benchmark result names the code that produced it."""
import sys
from pathlib import Path

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
