"""Gluon names that differ between the Triton releases we run: 3.6 (the GPU machine) and 3.9 (CI).

Each shim is one name the kernels call, bound at import to whichever spelling this Triton has.
Gluon builtins are plain module attributes, so an alias is the builtin itself: calling it from a
`@gluon.jit` function is the same as calling the original.
"""
from __future__ import annotations

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import tma

# TMA copies between global and shared memory: 3.6 spells them async_copy_global_to_shared /
# async_copy_shared_to_global; 3.9 renamed them async_load / async_store (the old names now raise).
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

# A barrier across the warps of the running partition (bar.sync): `thread_barrier` in 3.6,
# `barrier` in 3.9.
thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@builtin
def smem_reinterpret(buf, dtype, shape, layout, _semantic=None):
    """A shared-memory view as another dtype/shape/layout: `_reinterpret` in 3.6, `reinterpret` in 3.9."""
    method = getattr(buf, "reinterpret", None) or buf._reinterpret
    return method(dtype, shape, layout, _semantic=_semantic)
