"""Launching a compiled kernel again without the jit's per-call work.

`JITFunction.run` (Triton and Gluon alike) binds and specialises every argument on every launch
(~45 for the attention kernels: each integer tested for == 1 and % 16, each pointer for alignment),
hashes the result and looks the compiled kernel up: ~10 us of host time a launch, a fifth of a
small call's budget (gpt2-small's heads at T = 1K run ~100 us of GPU work per forward). A call
signature of flash_attention (shapes, strides, dtypes, base alignment: kernels/flash_op.py) fixes
every one of those specialisations, and its grid, so the compiled kernel and grid found by the
first launch of a signature are the ones every later launch would find. `launch` keeps them, in a
dict the caller owns per call signature, and later launches hand the arguments straight to the
kernel's launcher (the C function that calls cuLaunchKernelEx), as the compiled kernel's own
`kernel[grid](*args)` does, less its per-launch closure, device query and metadata.

Both Triton releases we run (3.6, 3.9) launch a compiled kernel the same way: its `run` (the
launcher), `function` and `packed_metadata`, the grid's three dimensions and the current stream,
then the launch hooks and every argument in signature order. Triton passes its hook chains even
when they are empty, which costs a Python call before and after every launch and the metadata the
enter hook would read; a direct launch passes none. While a hook is installed (Triton's profiler,
proton), launches go through `kernel[grid]`, which builds that metadata and calls the hooks.
Under the interpreter, and wherever no cache is given, every launch goes through the jit.
"""
from __future__ import annotations

from typing import Callable

from kernels.checks import INTERPRET


def launch(fn, grid, args: tuple, kwargs: dict, cache: dict | None, key) -> None:
    """fn[grid](*args, **kwargs): through the jit the first time `key` is seen in `cache`, then straight
    to the kernel it compiled. `key` must fix every specialisation of the arguments (their dtypes,
    which integers are 1 or multiples of 16, which pointers are 16-byte aligned) and the grid; `grid`
    is a tuple or a function of the launch's keyword arguments."""
    direct = cache.get(key) if cache is not None else None
    if direct is not None:
        direct(args)
        return
    kernel = fn[grid](*args, **kwargs)
    if cache is not None and kernel is not None and not INTERPRET:
        # the constexpr and tile arguments that follow the positional ones, in the kernel's order
        tail = tuple(kwargs[name] for name in fn.arg_names[len(args):])
        cache[key] = direct_launcher(kernel, grid(kwargs) if callable(grid) else grid, tail)


def direct_launcher(kernel, grid, tail: tuple) -> Callable[[tuple], None]:
    """A function of the leading arguments that launches the compiled `kernel` on `grid` with
    `tail` appended, on the current device's current stream."""
    from triton import knobs
    from triton.runtime import driver

    gx, gy, gz = tuple(grid) + (1,) * (3 - len(grid))
    run, function, metadata = kernel.run, kernel.function, kernel.packed_metadata
    active = driver.active
    stream_of, current_device = active.get_current_stream, active.get_current_device
    hooks = knobs.runtime

    def direct(args: tuple) -> None:
        if _installed(hooks.launch_enter_hook) or _installed(hooks.launch_exit_hook):
            kernel[(gx, gy, gz)](*args, *tail)
            return
        run(gx, gy, gz, stream_of(current_device()), function, metadata, None, None, None, *args, *tail)
    return direct


def _installed(hook) -> bool:
    """Whether a launch hook is set: a non-empty HookChain (its `calls`), or any callable."""
    return hook is not None and bool(getattr(hook, "calls", True))


# Grid arithmetic for the host side. triton.cdiv and triton.next_power_of_2 are constexpr functions
# in triton 3.9, ~4 us a call from Python (each argument unwrapped): too slow for a launch path.

def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 1
