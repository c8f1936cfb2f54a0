"""The Gluon forward's optimisation ladder: the steps before the production kernel, runnable.

kernels/gluon/forward.py holds the kernel a plan runs (`attention_fwd_ws`, warp-specialised).
The ladder that led to it, each rung timed side by side in benchmarks/gluon/gluon_fwd_h200_rounds.md
(kernels/LOG.md, "The Gluon forward"):

- "simple": `attention_fwd_pipelined` with STAGES=1, one partition; it issues the TMA loads of a
  tile, waits, computes. The simple, correct baseline.
- "pipelined": the same with a ring of STAGES K/V buffers in shared memory, one mbarrier per
  buffer (TMA arrives with the bytes); the loads of tile j + STAGES - 1 are issued before tile j
  is computed, so the copy engine runs ahead of the tensor cores. A bar.sync before each issue
  makes every warp done with the buffer being overwritten.
- "ws", "ws-pingpong", "ws-pingpong-s3": the warp-specialised kernel without ping-pong, and with
  it on shallower rings; then the production variants (kernels/gluon/forward.py's VARIANTS).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from kernels.gluon import forward as production
from kernels.gluon.compat import thread_barrier, tma_load
from kernels.gluon.forward import (SIZES, Launch, _attend, _epilogue, _issue_kv, _mma_layout, _program_coordinates,
                                   _stage_range, _tile_ranges, ws_launch)

_WS = production._WS
LADDER = {
    "simple": ("pipelined", dict(STAGES=1), dict(num_warps=8)),
    "pipelined": ("pipelined", dict(STAGES=2), dict(num_warps=8)),
    "ws": ("ws", dict(STAGES=2, PINGPONG=False, OVERLAP=False), _WS),
    "ws-pingpong": ("ws", dict(STAGES=2, PINGPONG=True, OVERLAP=False), _WS),
    "ws-pingpong-s3": ("ws", dict(STAGES=3, PINGPONG=True, OVERLAP=False), _WS),
    **{name: ("ws", *entry) for name, entry in production.VARIANTS.items()},
}


def forward(q, k, v, causal: bool, softmax_scale: float, variant: str):
    """out, lse of the Gluon forward's rung `variant` (checked inputs, as kernels/gluon/forward.py's)."""
    return production.gluon_attention_forward(q, k, v, causal, softmax_scale,
                                                  launch=variant_launch(variant, causal, q.shape[-1]))


def variant_launch(variant: str, causal: bool, head_dim: int) -> Launch:
    """How a rung of the ladder launches (the production variants included)."""
    if variant not in LADDER:
        raise ValueError(f"Gluon forward variant {variant!r} is not one of {', '.join(LADDER)}")
    kind, consts, options = LADDER[variant]
    if kind == "ws":
        return ws_launch(consts, options, causal, head_dim)
    rows = 16 * options["num_warps"]
    consts = dict(consts, CAUSAL=bool(causal), BLOCK_N=production.BLOCK_N)
    return Launch(attention_fwd_pipelined, rows, rows, consts, options)


@gluon.jit(do_not_specialize=SIZES)
def attention_fwd_pipelined(q_desc, k_desc, v_desc, o_desc, lse_ptr, Rng, Sinks, n_heads, kv_group, n_q, n_k,
                            qk_scale, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                            SOFTCAP: gl.constexpr, DROPOUT_P: gl.constexpr, PACKED_MASK: gl.constexpr,
                            EXP2_ON_FMA: gl.constexpr, num_warps: gl.constexpr):
    """One partition of num_warps warps (BLOCK_M = 16 * num_warps rows); K/V through a ring of
    STAGES buffers, the loads of tile j + STAGES - 1 issued before tile j is computed (STAGES=1:
    load, wait, compute). The production kernel's signature; plain attention only (no score options)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    gl.static_assert(BLOCK_M == 16 * num_warps, "wgmma: each warp owns 16 rows of the query tile")
    gl.static_assert(num_warps % 4 == 0, "whole warpgroups")
    gl.static_assert(k_desc.block_type.shape[1] == BLOCK_N, "K descriptor block has BLOCK_N rows")
    gl.static_assert(BLOCK_N % 16 == 0 and HEAD_DIM % 16 == 0, "wgmma K and N are multiples of 16")
    gl.static_assert(STAGES >= 1)
    gl.static_assert(SOFTCAP == 0 and DROPOUT_P == 0 and Sinks is None, "the ladder's rungs compute plain attention")
    s_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, num_warps)
    o_layout: gl.constexpr = _mma_layout(BLOCK_M, HEAD_DIM, num_warps)

    b, h, h_kv, start_m = _program_coordinates(n_heads, kv_group, BLOCK_M)
    q_smem4 = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)

    mid, hi = _tile_ranges(start_m, n_q, n_k, BLOCK_M, BLOCK_N, CAUSAL)
    n_tiles = gl.cdiv(hi, BLOCK_N)
    mbarrier.expect(q_ready, q_desc.block_type.nbytes)
    tma_load(q_desc, [b, start_m, h, 0], q_ready, q_smem4)
    for i in gl.static_range(STAGES - 1):
        _issue_kv(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, i, b, h_kv, i < n_tiles, BLOCK_N, STAGES)

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    rows = start_m + gl.arange(0, BLOCK_M, gl.SliceLayout(1, s_layout))
    q_smem = q_smem4.reshape([BLOCK_M, HEAD_DIM])
    shift = n_k - n_q
    mbarrier.wait(q_ready, 0)
    for stage in gl.static_range(2):   # the unmasked key tiles [0, mid), then the masked ones [mid, hi)
        first, end = _stage_range(stage, mid, hi)
        for start_n in range(first, end, BLOCK_N):
            acc, m_i, l_i = _pipelined_step(q_smem, k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, acc, m_i, l_i,
                                            rows, start_n, n_tiles, n_k, shift, qk_scale, b, h_kv,
                                            BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, stage == 1, EXP2_ON_FMA,
                                            num_warps)
    _epilogue(acc, m_i, l_i, q_smem4, o_desc, lse_ptr, b, h, n_heads, n_q, start_m, BLOCK_M, HEAD_DIM, num_warps)


@gluon.jit
def _pipelined_step(q_smem, k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, acc, m_i, l_i,
                    rows, start_n, n_tiles, n_k, shift, qk_scale, b, h_kv,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                    CAUSAL: gl.constexpr, MASK: gl.constexpr, EXP2_ON_FMA: gl.constexpr, num_warps: gl.constexpr):
    tile = start_n // BLOCK_N
    ahead = tile + STAGES - 1
    # the buffer `ahead` fills last held tile - 1, which every warp has finished (its wgmmas waited)
    thread_barrier()
    _issue_kv(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, ahead, b, h_kv, ahead < n_tiles, BLOCK_N, STAGES)
    stage = tile % STAGES
    phase = (tile // STAGES) & 1
    mbarrier.wait(k_ready.index(stage), phase)
    return _attend(q_smem, k_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM]),
                   v_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM]), v_ready.index(stage), phase,
                   k_ready.index(stage), acc, m_i, l_i, rows, start_n, n_k, shift, qk_scale, None,
                   BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, MASK, False, 0.0, 0.0, 0, EXP2_ON_FMA, num_warps)


