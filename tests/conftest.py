"""Shared pytest set-up.

Without CUDA the Triton kernels run in Triton's interpreter, which must be switched on
before triton is first imported; doing it here, before any test module imports
`kernels`, makes the same kernel tests run on a CPU-only CI machine.
"""
import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
