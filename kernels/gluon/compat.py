"""Gluon names that differ between the Triton releases we run: 3.6 (the GPU machine) and 3.9 (CI).

Each shim is one name the kernels call, bound at import to whichever spelling this Triton has.
Gluon builtins are plain module attributes, so an alias is the builtin itself: calling it from a
`@gluon.jit` function is the same as calling the original. Two PTX instructions neither release
exposes are inline assembly here, the same in both.
"""
from __future__ import annotations

from triton.experimental import gluon
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


# A TMA reduce-add of a shared-memory tile into global memory (cp.reduce.async.bulk.tensor .add):
# public in 3.9 as tma.async_atomic_add; in 3.6 only the IR builder has it (create_async_tma_reduce),
# which this builtin calls with the same arguments.
if hasattr(tma, "async_atomic_add"):
    tma_reduce_add = tma.async_atomic_add
else:
    from triton._C.libtriton import ir

    @builtin
    def tma_reduce_add(desc, coord, src, _semantic=None):
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord, src.handle)


@gluon.jit
def _ptx(asm: gl.constexpr, anchor):
    """One PTX instruction with no operands, issued by every thread (an int32 `anchor` carries it)."""
    return gl.inline_asm_elementwise(asm + " mov.b32 $0, $1;", "=r,r", [anchor], dtype=gl.int32, is_pure=False,
                                     pack=1)


@gluon.jit
def bulk_wait_written(anchor):
    """Wait until this thread's bulk (TMA) stores and reductions have written global memory, not only
    read their shared-memory source (what tma.store_wait waits for in 3.6, and by default in 3.9)."""
    _ptx("cp.async.bulk.wait_group 0;", anchor)


@gluon.jit
def fence_proxy_async_global(anchor):
    """Order this thread's generic-proxy global accesses (an acquire, say) before its later
    async-proxy ones (a TMA reduction)."""
    _ptx("fence.proxy.async.global;", anchor)
