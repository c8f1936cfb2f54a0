"""Shared pytest set-up.

Without CUDA the Triton kernels run in Triton's interpreter, which must be switched on
before triton is first imported; doing it here, before any test module imports
`kernels`, makes the same kernel tests run on a CPU-only CI machine. The tools' default
output folder is a temporary one ($FLASHTRAIN_OUTPUTS), set here before scripts/_common
is imported.
"""
import os
import tempfile

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The tools' default results folder (outputs/ in the checkout) moved to a temporary one, for this
# process and every subprocess a test starts: a test never writes into the checkout.
# Set once per process (this file may be imported under two names), and respecting a folder given.
if "FLASHTRAIN_OUTPUTS" not in os.environ:
    os.environ["FLASHTRAIN_OUTPUTS"] = tempfile.mkdtemp(prefix="flashtrain-test-outputs-")

import pytest  # noqa: E402

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
