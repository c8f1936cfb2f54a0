"""scripts/kernel_dev/ab_trees.sh: one command run inside several source trees in turn (a kernel A/B in
one device call). Run from a copy of the script, so that its trees live in a temporary folder."""
import shutil
import subprocess
import sys
from pathlib import Path

from tests.trainrun import REPO


def copy_of_the_script(root: Path) -> Path:
    script = root / "scripts" / "kernel_dev" / "ab_trees.sh"
    script.parent.mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "kernel_dev" / "ab_trees.sh", script)
    return script


def tree(root: Path, name: str, commit: str) -> None:
    folder = root / ".ab" / name
    folder.mkdir(parents=True)
    (folder / "AB_COMMIT").write_text(f".ab/{name}: {commit}\n")
    (folder / "which.py").write_text(f"print('{name}')\n")


def test_run_runs_the_command_inside_each_tree_with_its_name_and_commit(tmp_path):
    script = copy_of_the_script(tmp_path)
    tree(tmp_path, "main", "abc1234")
    tree(tmp_path, "branch", "def5678")
    probe = "import os, sys; print(open('which.py').read().split(chr(39))[1], os.environ['FLASHTRAIN_COMMIT'], sys.argv[1])"
    proc = subprocess.run(["bash", str(script), "run", "main", "branch", "--", sys.executable, "-c", f'"{probe}"',
                           "out/{}"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if not line.startswith("===")]
    assert lines == ["main abc1234 out/main", "branch def5678 out/branch"], proc.stdout


def test_a_missing_tree_or_command_is_refused_in_one_line(tmp_path):
    script = copy_of_the_script(tmp_path)
    tree(tmp_path, "main", "abc1234")
    missing = subprocess.run(["bash", str(script), "run", "main", "other", "--", "true"], capture_output=True,
                             text=True, timeout=60)
    assert missing.returncode == 2 and "no tree .ab/other: make it first" in missing.stderr
    no_command = subprocess.run(["bash", str(script), "run", "main"], capture_output=True, text=True, timeout=60)
    assert no_command.returncode == 2 and no_command.stderr.startswith("usage:")
    nothing = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60)
    assert nothing.returncode == 2 and nothing.stderr.startswith("usage:")
