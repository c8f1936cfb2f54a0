"""What a step spends compiling and autotuning Triton kernels, beside its own work.

A long step is timed once (a second one would cost minutes), so its time includes the first call's
costs: compiling every kernel it launches (or loading it from Triton's on-disk cache) and
autotuning where a kernel's plan tunes. `KernelSetupTime` times those two while it is entered, by
wrapping the Triton methods that do them (`JITFunction._do_compile`, the same in triton 3.6 and 3.9,
for Triton and Gluon kernels alike; `Autotuner._bench`, one candidate's timing). Compiling a
candidate during tuning counts as compile time, not tuning time. Under Triton's interpreter nothing
compiles and both stay 0.
"""
from __future__ import annotations

import time


class KernelSetupTime:
    """`with KernelSetupTime() as setup: ...`, then `setup.compile_s` and `setup.tune_s`."""

    def __init__(self) -> None:
        self.compile_s = 0.0
        self.tune_s = 0.0
        self._patched: list = []

    def __enter__(self) -> "KernelSetupTime":
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction

        self._wrap(JITFunction, "_do_compile", "compile_s")
        if hasattr(Autotuner, "_bench"):
            self._wrap(Autotuner, "_bench", "tune_s")
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()

    def _wrap(self, owner, name: str, total: str) -> None:
        original = getattr(owner, name)
        setup = self

        def timed(*args, **kwargs):
            compiled_before = setup.compile_s
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent = time.perf_counter() - began
                if total == "tune_s":   # a candidate compiled while being timed is compile time
                    spent -= setup.compile_s - compiled_before
                setattr(setup, total, getattr(setup, total) + spent)
        setattr(owner, name, timed)
        self._patched.append((owner, name, original))
