"""flashtrain runs from its checkout: nothing is installed under its short folder names, a user's
own folders never shadow ours, and train.py works from any working directory."""
from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

from tests.trainrun import REPO, cache_dir, subprocess_env, tiny_overrides  # noqa: F401 (cache_dir is a fixture)

OUR_PACKAGES = ("model", "kernels", "data", "training")


def test_nothing_of_ours_is_installed_under_a_generic_name(tmp_path):
    """A fresh interpreter outside the checkout finds none of our folders as installed modules
    (so PyPI's `kernels`, say, and ours can never overwrite each other)."""
    probe = ("import importlib.util, json; "
             f"print(json.dumps({{n: getattr(importlib.util.find_spec(n), 'origin', None) for n in {OUR_PACKAGES!r}}}))")
    env = {k: v for k, v in subprocess_env().items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for name, origin in __import__("json").loads(proc.stdout).items():
        assert origin is None or not origin.startswith(str(REPO)), f"{name} resolves to the checkout: {origin}"


@pytest.mark.slow
def test_the_wheel_holds_no_modules(tmp_path):
    """`pip install .` installs the dependencies only (the README's run-from-checkout workflow)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    wheel, = tmp_path.glob("flashtrain-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert names and all(".dist-info/" in n for n in names)


def test_train_runs_from_another_folder_despite_decoy_packages(tmp_path, cache_dir):
    """Started from a folder holding its own `model/` and `kernels/`, train.py still uses ours."""
    work = tmp_path / "elsewhere"
    for decoy in ("model", "kernels", "data", "training"):
        (work / decoy).mkdir(parents=True)
        (work / decoy / "__init__.py").write_text("raise ImportError('a user folder shadowed flashtrain')\n")
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *tiny_overrides(tmp_path / "run", cache_dir, steps=1)],
                          cwd=work, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def test_nothing_refers_outside_the_repository():
    """Everything a user needs is in the checkout: no code, config, script or document points at a
    design note, a bootstrap helper or wheel folders that are not in it. (Result JSONs record the
    folders a measured run used; they are records, not instructions, and are not scanned.)"""
    files = subprocess.run(["git", "ls-files", "*.py", "*.yaml", "*.md", "*.toml", "*.sh", "*.cfg", "*.txt"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    # Spelled in pieces, so that this test is not itself a file that names them.
    outside = ("DESIGN" + ".md", "_boot" + "strap", "../" + "shared", "/" + "work/", ".w" + "hl/")
    found = [f"{name}: {word}" for name in files
             for word in outside if word in (REPO / name).read_text(errors="replace")]
    assert not found, found
