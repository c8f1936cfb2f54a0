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


def cpu_threads(setting: int | None, local_processes: int = 1, resumed: int | None = None) -> tuple[int, str]:
    """(torch's intra-op threads for a CPU run, why): `trainer.cpu_threads` when set; else
    OMP_NUM_THREADS when set; else the count the resumed run used (on the CPU a resume repeats an
    uninterrupted run to the bit, and a thread count can change a reduction's order); else this
    process's share of the cores that other work does not keep busy (the 1-minute load average).
    torch's own default, one thread per core, makes OpenMP workers spin-wait on cores that other
    processes hold: on a busy 2-core machine training ran 20x slower than on one thread."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if setting:
        if setting > cores:   # threads past the cores only wait on each other: 2 steps took minutes, not 0.2 s
            raise ValueError(f"trainer.cpu_threads={setting}: this process may use {cores} cores; set at most {cores}")
        return setting, "trainer.cpu_threads"
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env), f"OMP_NUM_THREADS={env}"
    if resumed:
        return resumed, "as the run it continues; trainer.cpu_threads=N sets another"
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    free = max(1, cores - round(busy))
    threads = max(1, min(cores, free) // max(1, local_processes))
    shared = f" shared by {local_processes} processes" if local_processes > 1 else ""
    return threads, (f"{cores} cores{shared}, {busy:.1f} of them busy with other work (load average); "
                     f"trainer.cpu_threads=N sets it")
