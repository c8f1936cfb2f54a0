"""The Hopper (sm_90) attention kernels, written in Gluon: `forward.py`, `backward.py`.

They compute what kernels/flash_fwd.py and flash_bwd.py compute, with FlashAttention-3's
structure (TMA loads into shared-memory rings, wgmma, warp-specialised producer and consumer
partitions), for the settings `refusal` accepts. kernels/plan.py decides where they run;
`compat.py` holds the differences between the Triton releases we run (3.6 on the GPU machine,
3.9 in CI).
"""
from __future__ import annotations

import torch

ARCH = "sm_90"
HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)


def refusal(arch: str | None, dtype: torch.dtype, head_dim: int, mask: str, tma: bool, direction: str = "forward",
            causal: bool = True) -> str | None:
    """Why the Gluon kernel of `direction` cannot run this setting (one line), or None. `arch`: the
    GPU's "sm_XY", None off CUDA; `mask`: "none" or the kind of mask; `tma`: whether TMA can read
    the inputs (`tma_refusal`). The backward takes causal document masks (per key, the end of its
    document bounds the queries that see it); everything else masked runs on the Triton kernels."""
    if arch is None:
        return "it needs a CUDA device"
    if arch != ARCH:
        return f"it is written for Hopper ({ARCH}); this GPU is {arch}"
    if dtype not in DTYPES:
        return f"it takes float16 and bfloat16, got {dtype}"
    if head_dim not in HEAD_DIMS:
        return f"it supports head dims {', '.join(map(str, HEAD_DIMS))}, got {head_dim}"
    if mask == "documents" and direction == "backward" and not causal:
        return "its document masks are causal ones; without causal they run on the Triton kernel"
    if mask != "none" and not (mask == "documents" and direction == "backward"):
        return ("sliding windows and key bounds run on the Triton kernels only" if direction == "backward" else
                "document masks, sliding windows and key bounds run on the Triton kernel only")
    if not tma:
        return "q, k or v is a view TMA cannot read (it needs the head dim contiguous, every other stride and " \
               "the start address multiples of 16 bytes)"
    return None


def tma_strides(t: torch.Tensor) -> list[int]:
    """t's strides for a TMA descriptor; a size-1 dim's stride is never used, so it is made aligned."""
    aligned = 16 // t.element_size() * max(1, max(t.stride()))
    return [s if n > 1 else aligned for n, s in zip(t.shape, t.stride())][:-1] + [t.stride(-1)]


def tma_refusal(name: str, t: torch.Tensor) -> str | None:
    """Why `t` cannot be read through a TMA descriptor, or None. Under torch.compile the tensors
    are fake and have no address: the base is then checked when the op runs."""
    strides = tma_strides(t)
    if strides[-1] != 1:
        return f"{name} has head-dim stride {t.stride(-1)}; TMA needs the head dim contiguous (stride 1)"
    if any(s * t.element_size() % 16 for s in strides[:-1]):
        return f"{name} has strides {tuple(t.stride())}: TMA needs every stride but the last to be a multiple of 16 bytes"
    if not torch.compiler.is_compiling() and t.data_ptr() % 16:
        return f"{name} starts at an address that is not a multiple of 16 bytes, as TMA needs"
    return None


def descriptors(cache: dict | None, key, tensors: tuple, make) -> list:
    """The TMA descriptors of `tensors`, made (and validated) by `make()` the first time `key` is seen
    in `cache`, a call signature's (kernels/launch.py). Later calls copy those with each base
    replaced by this call's tensor: the signature fixes every shape, stride, block, layout and
    base alignment a descriptor checks, and building one anew costs ~7 us of host time (a
    backward makes nine)."""
    made = cache.get(key) if cache is not None else None
    if made is None:
        made = make()
        if cache is not None:
            cache[key] = made
        return made
    return [_rebased(d, t) for d, t in zip(made, tensors)]


def _rebased(template, base):
    fresh = object.__new__(type(template))
    fresh.__dict__.update(template.__dict__)
    fresh.base = base
    return fresh
