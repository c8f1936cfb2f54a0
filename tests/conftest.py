"""Shared pytest set-up.

Without CUDA the Triton kernels run in Triton's interpreter, which must be switched on
before triton is first imported; doing it here, before any test module imports
`kernels`, makes the same kernel tests run on a CPU-only CI machine. The tools' default
output folder is a temporary one ($FLASHTRAIN_OUTPUTS), set here before scripts/_common
is imported, and the tools' folders (scripts/ and its bench/ and kernel_dev/) are on sys.path,
so a test imports a tool by its name wherever it sits.
"""
import os
import sys
import tempfile
from pathlib import Path

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The tools' default results folder (outputs/ in the checkout) moved to a temporary one, for this
# process and every subprocess a test starts: a test never writes into the checkout.
# Set once per process (this file may be imported under two names), and respecting a folder given.
if "FLASHTRAIN_OUTPUTS" not in os.environ:
    os.environ["FLASHTRAIN_OUTPUTS"] = tempfile.mkdtemp(prefix="flashtrain-test-outputs-")

for folder in ("kernel_dev", "bench", ""):   # scripts/ first, as a tool's own bootstrap puts it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / folder))

import pytest  # noqa: E402

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
ON_HOPPER = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)   # the Gluon kernels' GPU
requires_hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 (Hopper) GPU")
