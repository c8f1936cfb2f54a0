"""Device and numeric precision: where the run happens and in which dtype the matmuls run."""
from __future__ import annotations

import contextlib

import torch


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
