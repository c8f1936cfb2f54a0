"""Measuring the peak memory of a block of work, on the GPU or, as a stand-in, on the CPU.

CUDA: the caching allocator's own peak (torch.cuda.max_memory_allocated), reset on entry.
CPU: there is no allocator to ask, so LiveTensorMeter counts the bytes of every tensor created
inside the block while it lives; with a budget it raises torch.OutOfMemoryError where an
allocator with that much memory would. Both expose `.peak` in bytes, baseline included.
"""
from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class CudaPeak:
    """Peak bytes handed out by the CUDA caching allocator inside the block (what was live on entry
    counts too, as it occupies the device all the while)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak: int | None = None

    def __enter__(self):
        torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> bool:
        # Read now: whoever cleans up next (release_memory) resets the allocator's peak.
        self.peak = torch.cuda.max_memory_allocated(self.device)
        return False


class LiveTensorMeter(TorchDispatchMode):
    """CPU stand-in for a GPU memory meter: live bytes of the tensors created under it, plus `baseline`.

    New storages are counted when an op returns them and uncounted when they are freed; views and
    in-place results alias an input and are not counted again. With `budget` set, crossing it raises
    torch.OutOfMemoryError. Allocations that bypass the dispatcher (kernel scratch space) are not
    seen, so the figure is a floor: good for exercising tools on a CPU, not for reporting.
    """

    def __init__(self, baseline: int = 0, budget: int | None = None):
        super().__init__()
        self.budget, self.current, self.peak = budget, baseline, baseline
        self._live: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._count(t.untyped_storage(), inputs)
        return out

    def _count(self, storage, inputs: set[int]) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in inputs or key in self._live:
            return
        self._live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)
        if self.budget is not None and self.current > self.budget:
            raise torch.OutOfMemoryError(
                f"out of memory: {self.current} live tensor bytes exceed the CPU budget of {self.budget}")

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)


def peak_meter(device: torch.device, baseline: int = 0, budget: int | None = None):
    """The meter for `device`: CudaPeak on CUDA (baseline and budget are the device's own),
    LiveTensorMeter elsewhere."""
    if device.type == "cuda":
        return CudaPeak(device)
    return LiveTensorMeter(baseline, budget)


def allocated_bytes(device: torch.device, tensors=()) -> int:
    """Bytes allocated now: the CUDA allocator's count, or on the CPU the storages of `tensors`."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def is_oom(exc: BaseException) -> bool:
    """True for the allocator's out-of-memory error, also as re-raised from inside autograd, and for
    a library (cuBLAS, cuDNN) failing to allocate its workspace near the limit."""
    text = str(exc)
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and ("out of memory" in text.lower() or "ALLOC_FAILED" in text))


def release_memory(device: torch.device) -> None:
    """Return cached blocks after a measurement (OOM or not) and restart peak tracking from here.

    Call it once the work's tensors (and any caught exception, whose traceback holds their frames)
    are out of scope; otherwise the memory is still referenced and nothing comes back.
    """
    if device.type == "cuda":  # (on the CPU nothing is cached, and a full collection costs ~0.1 s)
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
