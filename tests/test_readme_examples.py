"""The README's first example of each run-folder tool, copied from the README and run as written on
a CPU (in a folder where `runs/a` is a tiny finished run and a sweep sits under multirun/): every
one works on the first try. GPU-only tools must refuse in one line instead."""
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.trainrun import REPO, cache_dir, run_in_process, subprocess_env, tiny_overrides  # noqa: F401

README = (REPO / "README.md").read_text()
RUN_TOOLS = ("generate", "export_hf", "export_weights", "compare_runs")   # they act on runs/a, hf/a, sweeps


def first_example(tool: str) -> str:
    """The first `python scripts/<tool>.py ...` command in the README (continuation lines joined,
    comment dropped), from a code block or an inline `code` span."""
    text = README.replace("\\\n", " ")
    match = re.search(rf"python scripts/{tool}\.py[^`\n#]*", text)
    assert match, f"the README has no example of scripts/{tool}.py"
    return match.group(0).strip()


def run_example(command: str, cwd) -> subprocess.CompletedProcess:
    argv = shlex.split(command)
    argv[0:2] = [sys.executable, str(REPO / argv[1])]
    return subprocess.run(argv, cwd=cwd, env=subprocess_env(), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, cache_dir):  # noqa: F811
    root = tmp_path_factory.mktemp("readme")
    assert run_in_process(tiny_overrides(root / "runs" / "a", cache_dir, steps=4, **{"trainer.eval_every": 2})) == 0
    sweep = re.search(r"compare_runs\.py (multirun/\S+)", README).group(1)
    for job in ("0", "1"):
        shutil.copytree(root / "runs" / "a", root / sweep / job)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("tool", RUN_TOOLS)
def test_the_readme_example_works_on_the_first_try(tool, workdir):
    command = first_example(tool)
    folder = workdir / shlex.split(command)[2]
    if tool != "compare_runs" and not folder.exists():   # the example's run folder (a summary's): a finished run
        shutil.copytree(workdir / "runs" / "a", folder)
    result = run_example(command, workdir)
    assert result.returncode == 0, f"{command}\n{result.stderr}"
    assert "\r" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("tool", ["bench_generation"])
def test_gpu_only_examples_refuse_in_one_line_on_a_cpu(tool, workdir):
    if __import__("torch").cuda.is_available():
        pytest.skip("checks the refusal on a CPU-only machine")
    result = run_example(first_example(tool), workdir)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "CUDA" in result.stderr
