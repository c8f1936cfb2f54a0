"""Device, numeric precision and determinism: where the run happens, in which dtype the matmuls run, and whether every kernel repeats its bits."""
from __future__ import annotations

import contextlib
import importlib
import os
import sys

import torch
import torch.utils.deterministic


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present; asking for CUDA without it is an error, not a fallback."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device (use device=cpu or device=auto)")
        return torch.device("cuda")
    raise ValueError(f"device={name!r}: expected one of auto, cpu, cuda")


def resolve_precision(precision: str, device: torch.device) -> str:
    """`auto` is bf16 autocast on CUDA and plain float32 on the CPU (bit-exact resume there)."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def autocast(device: torch.device, precision: str):
    """Context for forward passes: bf16 autocast (weights and optimizer stay float32) or nothing."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


# What cuBLAS needs to pick deterministic algorithms; read when CUDA creates its first handle.
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


def set_deterministic(enabled: bool, device: torch.device) -> None:
    """`trainer.deterministic`: every kernel of the step deterministic, so a resumed run repeats an
    uninterrupted one to the bit on CUDA as it does on the CPU.

    PyTorch's deterministic algorithms (an op without one raises instead of running), cuBLAS's
    workspace config (set here when CUDA has not started yet, else it must already be in the
    environment), cuDNN without benchmarking, and Inductor's deterministic mode (no choice of
    kernel by timing where it changes numerics). Our attention kernel's backward is chosen by
    `attention.deterministic` (the config refuses false with this); SDPA under PyTorch's switch
    leaves out its cuDNN backend and runs FlashAttention-2's deterministic backward. PyTorch's
    switch also fills every new tensor with NaN (`fill_uninitialized_memory`, a debugging aid that
    costs a memory pass per allocation); that is left off: the kernels write what they allocate.
    """
    if enabled and device.type == "cuda" and os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in CUBLAS_DETERMINISTIC:
        if torch.cuda.is_initialized():
            raise ValueError("trainer.deterministic=true: CUDA started in this process before cuBLAS could be told to "
                             "be deterministic; set CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment")
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC[0]
    torch.use_deterministic_algorithms(enabled)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = False
    if enabled:  # a few seconds of imports, only for a run that asks for this
        importlib.import_module("torch._inductor.config")
    inductor_config = sys.modules.get("torch._inductor.config")  # not imported: nothing to turn off
    if inductor_config is not None and hasattr(inductor_config, "deterministic"):
        inductor_config.deterministic = enabled
