"""The generated code of the attention kernels is what tests/kernel_ptx_fingerprints.json records.

A change made for the reader of kernels/ (names, grouping, shared helpers) must leave the PTX for
Hopper as it was: no GPU is at hand to re-test or re-time it. scripts/kernel_dev/kernel_ptx_fingerprint.py
compiles each kernel config for sm_90a without a GPU and hashes its PTX without the debug lines;
this compiles the quick subset (head dims 64 and 128, no mask and every mask, the Gluon kernels at
their defaults) in a subprocess, since the test session interprets the kernels (TRITON_INTERPRET=1)
instead of compiling them. A refactor that changes the code fails here; a deliberate change
records the new set with `--write` under every Triton release the file holds.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_kernels_compile_to_the_recorded_ptx():
    import triton

    release = f"triton {triton.__version__}"
    recorded = json.loads((REPO / "tests" / "kernel_ptx_fingerprints.json").read_text())["fingerprints"]
    if release not in recorded:
        pytest.skip(f"no fingerprints recorded for {release} (they differ between releases): "
                    f"record them with scripts/kernel_dev/kernel_ptx_fingerprint.py --write")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "scripts/kernel_dev/kernel_ptx_fingerprint.py", "--quick", "--check"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = {name: value for value, name in (line.split("  ", 1) for line in proc.stdout.splitlines() if "  " in line)}
    assert len(printed) == 22 and all(recorded[release][name] == value for name, value in printed.items())
