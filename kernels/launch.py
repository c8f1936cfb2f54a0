"""Launching a compiled kernel again without the jit's per-call work.

`JITFunction.run` (Triton and Gluon alike) binds and specialises every argument on every launch
(~45 for the attention kernels: each integer tested for == 1 and % 16, each pointer for alignment),
hashes the result and looks the compiled kernel up: ~10 us of host time a launch, a fifth of a
small call's budget (gpt2-small's heads at T = 1K run ~100 us of GPU work per forward). A call
signature of flash_attention (shapes, strides, dtypes, base alignment: kernels/flash_op.py) fixes
every one of those specialisations, so the compiled kernel found by the first launch of a signature
is the one every later launch would find. `launch` keeps it, in a dict the caller owns per call
signature, and launches it directly with the arguments in the kernel's order.

Both Triton releases we run (3.6, 3.9) launch a compiled kernel the same way (`compiled[grid](*all
arguments in signature order)`, what `JITFunction.run` itself calls). Under the interpreter, and
wherever no cache is given, every launch goes through the jit.
"""
from __future__ import annotations

from kernels.checks import INTERPRET


def launch(fn, grid, args: tuple, kwargs: dict, cache: dict | None, key) -> None:
    """fn[grid](*args, **kwargs): through the jit the first time `key` is seen in `cache`, then straight
    to the kernel it compiled. `key` must fix every specialisation of the arguments (their dtypes,
    which integers are 1 or multiples of 16, which pointers are 16-byte aligned); `grid` is a tuple or
    a function of the launch's keyword arguments."""
    compiled = cache.get(key) if cache is not None else None
    if compiled is None:
        kernel = fn[grid](*args, **kwargs)
        if cache is not None and kernel is not None and not INTERPRET:
            # the constexpr and tile arguments that follow the positional ones, in the kernel's order
            cache[key] = (kernel, tuple(kwargs[name] for name in fn.arg_names[len(args):]))
        return
    kernel, tail = compiled
    grid = grid(kwargs) if callable(grid) else grid
    kernel[tuple(grid) + (1,) * (3 - len(grid))](*args, *tail)   # a compiled kernel takes all three grid dims
