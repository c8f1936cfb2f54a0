"""FlashAttention forward for Hopper (sm_90a) in Gluon: TMA, wgmma and warp specialisation.

The algorithm is kernels/flash_fwd.py's (FlashAttention-2's loop order, online softmax in exp2
with the scale folded into one FMA per score, fp32 running max m and sum l, the LSE stored in
natural log, rows that see no key give O = 0 and L = -inf, causal aligned bottom-right, GQA by
head index). What Gluon adds is explicit control of what Triton 3.6 schedules itself on Hopper:

Tiles. A program owns BLOCK_M query rows of one (batch, head) and streams BLOCK_N-key tiles of
the matching KV head past them. Each warpgroup (4 warps, 128 threads) owns 64 of those rows: a
wgmma instruction is 64 rows tall, so S = Q K^T (64 x BLOCK_N) and O (64 x HEAD_DIM) live in that
warpgroup's registers as fp32 accumulators, and P = exp2(S * scale - m), cast to the input dtype,
stays in registers as the A operand of O += P V (no trip through shared memory). K and V come
from shared memory, where TMA wrote them; Q is loaded once.

TMA. q, k, v, o are described as 4-D tensors (B, N, H, D) with their own strides, one block
being (1, rows, 1, HEAD_DIM) at coordinates (b, row, head, 0). So strided views of a fused QKV
projection are read in place, rows past N (ragged last tiles) arrive as zeros without crossing
into the next sequence, and the output tile's TMA store drops rows past N. A descriptor needs
16-byte aligned strides and base, and a last stride of 1: kernels.gluon.tma_refusal says when a view is not.

Masks. Key tiles [0, mid) are seen whole by every row of the program and run with no mask;
[mid, hi) (the causal diagonal and the ragged last key tile) compare each key with its row's
bound. Tiles past hi are never loaded. Document masks and sliding windows are not implemented
here: the kernel plan (kernels/plan.py) runs them on the Triton kernel, and refuses kernel="gluon".

Scores (kernels/scores.py, whose functions these kernels call), as the Triton forward computes them:
soft-capping bends each score through c tanh(s / c) before the row max; sinks start every row's
(m, l) at (sink, 1); dropout draws the Triton kernels' Philox mask for the tile while its QK^T
wgmma runs, zeroes the dropped P after l has summed it, and scales O by 1 / (1 - p) at the end.

The kernel, `attention_fwd_ws`, has FlashAttention-3's structure: gl.warp_specialize into three
partitions,
    producer   1 warp:      Q of both halves, then K and V tiles into a ring of STAGES buffers (TMA only);
    consumer 0 4 warps:     rows [0, 64) of the program (the default partition);
    consumer 1 4 warps:     rows [64, 128).
Barriers: q_ready[2] (one per consumer), k_ready[s] and v_ready[s] (TMA completion: a consumer
may start S = Q K^T before V has landed), kv_empty[s] (count 2: both consumers arrive after their
P V wgmma has read the buffer; the producer waits on it before refilling). With PINGPONG the two
consumers take turns issuing their QK^T wgmma (turn[2], each consumer releases the other's turn
after issuing): one warpgroup's softmax then runs while the other's matmuls occupy the tensor
cores. With OVERLAP (FlashAttention-3's intra-warpgroup overlap) a consumer issues QK^T of tile t
together with P V of tile t - 1 and computes tile t's softmax while that P V runs; it then holds
two tiles' buffers at once, so it needs STAGES >= 3 to leave the producer one to fill.

VARIANTS are the settings a kernel plan can pick, DEFAULT_VARIANTS the one per head dim (the
fastest measured). The steps that led here (one partition, a software-pipelined ring, warp
specialisation without ping-pong) are kernels/lab/gluon_forward_ladder.py's, and kernels/LOG.md
has what each measured. Query tiles run longest first (the last, longest causal tile of each head
is dispatched first; see kernels/tiles.py's query_tile_longest_first).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels import exp2, scores
from kernels.gluon import descriptors, tma_strides
from kernels.gluon.compat import thread_barrier, tma_load, tma_store
from kernels.exp2 import exp2_split
from kernels.scores import drop_scores, dropout_seed_of, dropout_word_at, hardware_tanh
from kernels.launch import cdiv
from kernels.launch import launch as run_kernel
from kernels.tiles import LN2, LOG2E

WG_ROWS = 64            # rows of one warpgroup's wgmma: 4 warps x 16

# ----------------------------------------------------------------------------- device code


@gluon.constexpr_function
def _mma_layout(rows, cols, num_warps):
    """Accumulator layout of a (rows x cols) wgmma result over num_warps warps (16 rows per warp)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, cols, 16])


@gluon.jit
def _tile_ranges(start_m, n_q, n_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """(mid, hi): key tiles [0, mid) are visible to every row of [start_m, start_m + BLOCK_M) and
    run unmasked; [mid, hi) are masked; none past hi is visible to any row. Causal bottom-right:
    query i sees keys j <= i + n_k - n_q. mid is a multiple of BLOCK_N, 0 <= mid <= hi."""
    if CAUSAL:
        shift = n_k - n_q
        first_hi = gl.minimum(start_m + shift + 1, n_k)
        hi = gl.maximum(gl.minimum(start_m + BLOCK_M + shift, n_k), 0)
    else:
        first_hi = n_k
        hi = n_k
    mid = gl.maximum(first_hi, 0) // BLOCK_N * BLOCK_N
    return mid, hi


@gluon.jit
def _stage_range(STAGE: gl.constexpr, mid, hi):
    """The key tiles of stage STAGE of a program's loop (`_tile_ranges`): 0 the unmasked [0, mid),
    1 the masked [mid, hi). One loop body serves both, MASK = STAGE == 1 (the tutorial's STAGE)."""
    first = 0
    end = mid
    if STAGE == 1:
        first = mid
        end = hi
    return first, end


@gluon.jit
def _softmax(s, m_i, rows, start_n, n_k, shift, qk_scale, CAUSAL: gl.constexpr, MASK: gl.constexpr,
             SOFTCAP: gl.constexpr, EXP2_ON_FMA: gl.constexpr):
    """The online-softmax step on raw scores s (ROWS x BLOCK_N, keys from start_n): (P, m_new, alpha)
    with P = exp2(s * scale - m_new) and alpha = exp2(m_old - m_new), the factor by which the running
    sum and accumulator shrink. MASK: key j of row i counts iff j < n_k (and j <= i + shift, causal).
    SOFTCAP > 0: the scores are c tanh(scale s / c) first, in the log2 domain (kernels/scores.py).
    EXP2_ON_FMA (0 to 4): of every 4 exponentials of P, how many the FMA units compute in an unmasked
    tile, to relieve the special-function unit (kernels/exp2.py)."""
    if SOFTCAP > 0:   # u = tanh(scale s / c), scaled by c log2(e) as raw scores are by qk_scale (softcap_tanh)
        s = hardware_tanh(s * (qk_scale / (SOFTCAP * LOG2E)))
        qk_scale = SOFTCAP * LOG2E
    if MASK:
        cols = start_n + gl.arange(0, s.shape[1], gl.SliceLayout(0, s.type.layout))
        visible = cols[None, :] < n_k
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None] + shift)
        s = gl.where(visible, s, float("-inf"))
    # the running max lives in the scaled log2 domain; scaling the raw row max (scale > 0) is
    # exactly the max of the scaled scores, and leaves one FMA per score for P
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    m_shift = m_new
    if MASK:  # a row that has seen only masked keys keeps m = -inf; shift by 0 so that no NaN appears
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    if EXP2_ON_FMA > 0 and not MASK:   # no -inf in an unmasked tile
        p = exp2_split(s * qk_scale - m_shift[:, None], EXP2_ON_FMA)
    else:
        p = gl.exp2(s * qk_scale - m_shift[:, None])
    return p, m_new, gl.exp2(m_i - m_shift)


@gluon.jit
def _rows_scale(acc, alpha):
    """acc * alpha[:, None], alpha being per row in the scores' layout."""
    return acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]


@gluon.jit
def _p_operand(p, dtype, o_layout: gl.constexpr, draw, DROPOUT_P: gl.constexpr, PACKED_MASK: gl.constexpr):
    """P cast to the input dtype, in registers laid out as wgmma's A operand for O += P V. With
    DROPOUT_P > 0 its dropped scores are 0 (draw: `_dropout_words`' of the tile; PACKED_MASK: zeroed
    after the cast, on P's packed pairs in the accumulator's layout: kernels/scores.py's drop_scores)."""
    if DROPOUT_P > 0:
        words, r, c = draw
        p = drop_scores(words, r, c, p, dtype, DROPOUT_P, PACKED_MASK)
    return gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))


@gluon.jit
def _dropout_words(rng, start_n, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """(words, r, c) in the scores' `layout` for score (first row + r, start_n + c): each score's
    Philox word, which `drop_scores` reads (kernels/scores.py's dropout_word_at). Row bit 3 and key bits 0
    and 3 are registers of one thread in the wgmma accumulator, row bit 0 a lane: of each two calls
    that a thread and the thread 4 lanes away both read, each makes one and takes its partner's
    words (SHARE=1)."""
    seed, offset, bh, start_row = rng
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))[:, None]
    c = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))[None, :]
    zero = gl.zeros([ROWS, BLOCK_N], gl.uint32, layout)
    return dropout_word_at(seed, offset, bh, start_row, r, start_n, c, zero, SHARE=1), r, c


@gluon.jit
def _attend(q_smem, k_smem, v_smem, v_ready, v_phase, release, acc, m_i, l_i, rows, start_n, n_k, shift, qk_scale,
            rng, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
            CAUSAL: gl.constexpr, MASK: gl.constexpr, PINGPONG: gl.constexpr, SOFTCAP: gl.constexpr,
            DROPOUT_P: gl.constexpr, PACKED_MASK: gl.constexpr, EXP2_ON_FMA: gl.constexpr, num_warps: gl.constexpr):
    """Fold keys [start_n, start_n + BLOCK_N) into one warpgroup's (acc, m, l).

    q_smem (ROWS x D), k_smem and v_smem (BLOCK_N x D) are shared-memory tiles; K has landed,
    V is waited for (v_ready, v_phase) only before P V, so its copy may still run during S and
    the softmax. PINGPONG: arrive on `release` (the other consumer's turn) once QK^T is issued.
    rng: (seed, offset, bh, first row) of the dropout mask, drawn while QK^T runs.
    Returns with both wgmmas complete, i.e. K and V are no longer read."""
    s_layout: gl.constexpr = _mma_layout(ROWS, BLOCK_N, num_warps)
    o_layout: gl.constexpr = _mma_layout(ROWS, HEAD_DIM, num_warps)
    s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    s = warpgroup_mma(q_smem, k_smem.permute((1, 0)), s, use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(release, count=1)
    draw = None
    if DROPOUT_P > 0:
        draw = _dropout_words(rng, start_n, ROWS, BLOCK_N, s_layout)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    p, m_i, alpha = _softmax(s, m_i, rows, start_n, n_k, shift, qk_scale, CAUSAL, MASK, SOFTCAP, EXP2_ON_FMA)
    l_i = l_i * alpha + gl.sum(p, 1)   # the normaliser sums every probability, dropped or not
    acc = _rows_scale(acc, alpha)
    # the dropped ones leave O; 1 / (1 - p) scales it at the end
    p = _p_operand(p, q_smem.dtype, o_layout, draw, DROPOUT_P, PACKED_MASK)
    mbarrier.wait(v_ready, v_phase)
    acc = warpgroup_mma(p, v_smem, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    return acc, m_i, l_i


@gluon.jit
def _epilogue(acc, m_i, l_i, q_smem4, o_desc, lse_ptr, b, h, n_heads, n_q, start_row,
              ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, num_warps: gl.constexpr):
    """O = acc / l through shared memory (Q's buffer, no longer read) and a TMA store, which drops
    rows past n_q; L = m + log2(l) in natural log. Rows that saw no key: O = 0, L = -inf."""
    row_layout: gl.constexpr = m_i.type.layout
    o_layout: gl.constexpr = _mma_layout(ROWS, HEAD_DIM, num_warps)
    seen = l_i > 0
    l_safe = gl.where(seen, l_i, 1.0)
    lse = gl.where(seen, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
    out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
    q_smem4.reshape([ROWS, HEAD_DIM]).store(out.to(o_desc.dtype))
    fence_async_shared()
    tma_store(o_desc, [b, start_row, h, 0], q_smem4)
    rows = start_row + gl.arange(0, ROWS, row_layout)
    gl.store(lse_ptr + (b * n_heads + h).to(gl.int64) * n_q + rows, lse, mask=rows < n_q)
    tma.store_wait(0)


@gluon.jit
def _issue_kv(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, tile, b, h_kv, pred,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """TMA loads of key tile `tile` into ring buffer tile % STAGES, each arriving on its barrier."""
    stage = tile % STAGES
    mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes, pred=pred)
    tma_load(k_desc, [b, tile * BLOCK_N, h_kv, 0], k_ready.index(stage), k_bufs.index(stage), pred=pred)
    mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes, pred=pred)
    tma_load(v_desc, [b, tile * BLOCK_N, h_kv, 0], v_ready.index(stage), v_bufs.index(stage), pred=pred)


@gluon.jit
def _program_coordinates(n_heads, kv_group, BLOCK_M: gl.constexpr):
    """(b, h, h_kv, start_m) of this program in a (cdiv(n_q, BLOCK_M), B * H) grid, query tiles of
    each head last (longest causal tile) first. GQA: query head h reads KV head h // kv_group."""
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    return b, h, h // kv_group, pid_m * BLOCK_M


# Integer arguments only enter scalar arithmetic: not specialising them (on == 1 or % 16) keeps one
# compiled kernel per (variant, dtype, head dim, causal) instead of one per length class.
SIZES = ["n_heads", "kv_group", "n_q", "n_k"]


# ---- warp-specialised: a TMA producer warp and two consumer warpgroups


@gluon.jit
def _ws_producer(descs, bufs, bars, coords, sizes, qk_scale, lse_ptr, scores,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                 OVERLAP: gl.constexpr, SOFTCAP: gl.constexpr, DROPOUT_P: gl.constexpr, PACKED_MASK: gl.constexpr,
                 EXP2_ON_FMA: gl.constexpr, WG: gl.constexpr):
    """Loads Q's two halves, then every K/V tile the consumers visit, into the ring."""
    q_desc, k_desc, v_desc, o_desc = descs
    q_bufs, k_bufs, v_bufs = bufs
    q_ready, k_ready, v_ready, kv_empty, turn = bars
    b, h, h_kv, start_m, mid, hi = coords
    for half in gl.static_range(2):
        mbarrier.expect(q_ready.index(half), q_desc.block_type.nbytes)
        tma_load(q_desc, [b, start_m + half * q_desc.block_type.shape[1], h, 0], q_ready.index(half), q_bufs.index(half))
    for tile in range(gl.cdiv(hi, BLOCK_N)):
        stage = tile % STAGES
        # wait until both consumers released this buffer (its previous use, STAGES tiles ago); a
        # fresh barrier counts as released, hence the flipped phase
        mbarrier.wait(kv_empty.index(stage), ((tile // STAGES) & 1) ^ 1)
        _issue_kv(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, tile, b, h_kv, True, BLOCK_N, STAGES)


@gluon.jit
def _ws_consumer(descs, bufs, bars, coords, sizes, qk_scale, lse_ptr, scores,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                 OVERLAP: gl.constexpr, SOFTCAP: gl.constexpr, DROPOUT_P: gl.constexpr, PACKED_MASK: gl.constexpr,
                 EXP2_ON_FMA: gl.constexpr, WG: gl.constexpr):
    """One warpgroup: rows [start_m + 64 WG, + 64) of the program, every K/V tile of the ring.
    scores: (Rng, Sinks), the dropout seed and the sinks (kernels/scores.py), each None when unused."""
    q_desc, k_desc, v_desc, o_desc = descs
    q_bufs, k_bufs, v_bufs = bufs
    q_ready, k_ready, v_ready, kv_empty, turn = bars
    b, h, h_kv, start_m, mid, hi = coords
    n_heads, n_q, n_k = sizes
    ROWS: gl.constexpr = q_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    s_layout: gl.constexpr = _mma_layout(ROWS, BLOCK_N, 4)
    o_layout: gl.constexpr = _mma_layout(ROWS, HEAD_DIM, 4)
    start_row = start_m + WG * ROWS
    Rng, Sinks = scores

    if Sinks is None:
        m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    else:   # the sink is every row's first score: (m, l) start at (sink log2(e), 1)
        m_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout)) + gl.load(Sinks + h) * LOG2E
        l_i = gl.full([ROWS], 1.0, gl.float32, gl.SliceLayout(1, s_layout))
    seed, offset = dropout_seed_of(Rng, DROPOUT_P)
    rng = (seed, offset, b * n_heads + h, start_row)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
    rows = start_row + gl.arange(0, ROWS, gl.SliceLayout(1, s_layout))
    q_smem = q_bufs.index(WG).reshape([ROWS, HEAD_DIM])
    shift = n_k - n_q
    mbarrier.wait(q_ready.index(WG), 0)
    if OVERLAP:
        if hi > 0:
            acc, m_i, l_i = _ws_overlapped(q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turn, acc, m_i, l_i,
                                           rows, mid, hi, n_k, shift, qk_scale, rng, ROWS, BLOCK_N, HEAD_DIM, STAGES,
                                           CAUSAL, PINGPONG, SOFTCAP, DROPOUT_P, PACKED_MASK, EXP2_ON_FMA, WG)
    else:
        for stage in gl.static_range(2):   # the unmasked key tiles, then the masked ones
            first, end = _stage_range(stage, mid, hi)
            for start_n in range(first, end, BLOCK_N):
                acc, m_i, l_i = _ws_step(q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turn, acc, m_i, l_i,
                                         rows, start_n, n_k, shift, qk_scale, rng, ROWS, BLOCK_N, HEAD_DIM, STAGES,
                                         CAUSAL, stage == 1, PINGPONG, SOFTCAP, DROPOUT_P, PACKED_MASK, EXP2_ON_FMA, WG)
    if DROPOUT_P > 0:
        acc = acc * (1.0 / (1.0 - DROPOUT_P))
    _epilogue(acc, m_i, l_i, q_bufs.index(WG), o_desc, lse_ptr, b, h, n_heads, n_q, start_row, ROWS, HEAD_DIM, 4)


@gluon.jit
def _ws_step(q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turn, acc, m_i, l_i, rows,
             start_n, n_k, shift, qk_scale, rng, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
             STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASK: gl.constexpr, PINGPONG: gl.constexpr,
             SOFTCAP: gl.constexpr, DROPOUT_P: gl.constexpr, PACKED_MASK: gl.constexpr, EXP2_ON_FMA: gl.constexpr,
             WG: gl.constexpr):
    tile = start_n // BLOCK_N
    stage = tile % STAGES
    phase = (tile // STAGES) & 1
    mbarrier.wait(k_ready.index(stage), phase)
    if PINGPONG:
        # consumer 0 goes first (a fresh barrier counts as completed for the flipped phase); each
        # releases the other once its QK^T has been issued (inside _attend, before its softmax).
        # Neither can run two turns ahead, so a parity wait never misses a phase.
        mbarrier.wait(turn.index(WG), (tile & 1) ^ (1 - WG))
    acc, m_i, l_i = _attend(q_smem, k_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM]),
                            v_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM]), v_ready.index(stage), phase,
                            turn.index(1 - WG), acc, m_i, l_i, rows, start_n, n_k, shift, qk_scale, rng,
                            ROWS, BLOCK_N, HEAD_DIM, CAUSAL, MASK, PINGPONG, SOFTCAP, DROPOUT_P, PACKED_MASK,
                            EXP2_ON_FMA, 4)
    mbarrier.arrive(kv_empty.index(stage), count=1)
    return acc, m_i, l_i


@gluon.jit
def _ws_overlapped(q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turn, acc, m_i, l_i, rows, mid, hi,
                   n_k, shift, qk_scale, rng, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                   STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, SOFTCAP: gl.constexpr,
                   DROPOUT_P: gl.constexpr, PACKED_MASK: gl.constexpr, EXP2_ON_FMA: gl.constexpr, WG: gl.constexpr):
    """FlashAttention-3's intra-warpgroup overlap, for hi > 0 key columns: QK^T of tile t is issued
    together with P V of tile t - 1, and the softmax of tile t runs while that P V wgmma is still
    in flight. Only then is acc rescaled (alpha_t) and buffer t - 1 released. Tile 0 is peeled off
    (masked: it may be the diagonal); the last P V is drained after the loops."""
    s_layout: gl.constexpr = _mma_layout(ROWS, BLOCK_N, 4)
    o_layout: gl.constexpr = _mma_layout(ROWS, HEAD_DIM, 4)
    mbarrier.wait(k_ready.index(0), 0)
    if PINGPONG:
        mbarrier.wait(turn.index(WG), 1 - WG)
    s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    s = warpgroup_mma(q_smem, k_bufs.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s,
                      use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG), count=1)
    draw = None
    if DROPOUT_P > 0:
        draw = _dropout_words(rng, 0, ROWS, BLOCK_N, s_layout)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    p, m_i, alpha = _softmax(s, m_i, rows, 0, n_k, shift, qk_scale, CAUSAL, True, SOFTCAP, EXP2_ON_FMA)
    l_i = l_i * alpha + gl.sum(p, 1)
    p = _p_operand(p, q_smem.dtype, o_layout, draw, DROPOUT_P, PACKED_MASK)
    for start_n in range(BLOCK_N, mid, BLOCK_N):
        acc, m_i, l_i, p = _ws_overlapped_step(q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turn, acc, m_i,
                                               l_i, p, rows, start_n, n_k, shift, qk_scale, rng, ROWS, BLOCK_N,
                                               HEAD_DIM, STAGES, CAUSAL, False, PINGPONG, SOFTCAP, DROPOUT_P,
                                               PACKED_MASK, EXP2_ON_FMA, WG)
    for start_n in range(gl.maximum(mid, BLOCK_N), hi, BLOCK_N):
        acc, m_i, l_i, p = _ws_overlapped_step(q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turn, acc, m_i,
                                               l_i, p, rows, start_n, n_k, shift, qk_scale, rng, ROWS, BLOCK_N,
                                               HEAD_DIM, STAGES, CAUSAL, True, PINGPONG, SOFTCAP, DROPOUT_P,
                                               PACKED_MASK, EXP2_ON_FMA, WG)
    last = gl.cdiv(hi, BLOCK_N) - 1
    stage = last % STAGES
    mbarrier.wait(v_ready.index(stage), (last // STAGES) & 1)
    acc = warpgroup_mma(p, v_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(kv_empty.index(stage), count=1)
    return acc, m_i, l_i


@gluon.jit
def _ws_overlapped_step(q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turn, acc, m_i, l_i, p, rows,
                        start_n, n_k, shift, qk_scale, rng, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                        HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASK: gl.constexpr,
                        PINGPONG: gl.constexpr, SOFTCAP: gl.constexpr, DROPOUT_P: gl.constexpr,
                        PACKED_MASK: gl.constexpr, EXP2_ON_FMA: gl.constexpr, WG: gl.constexpr):
    s_layout: gl.constexpr = _mma_layout(ROWS, BLOCK_N, 4)
    o_layout: gl.constexpr = _mma_layout(ROWS, HEAD_DIM, 4)
    tile = start_n // BLOCK_N
    stage = tile % STAGES
    prev = (tile - 1) % STAGES
    mbarrier.wait(k_ready.index(stage), (tile // STAGES) & 1)
    mbarrier.wait(v_ready.index(prev), ((tile - 1) // STAGES) & 1)
    if PINGPONG:   # as in _ws_step: one turn is the issue of both wgmmas
        mbarrier.wait(turn.index(WG), (tile & 1) ^ (1 - WG))
    s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    s = warpgroup_mma(q_smem, k_bufs.index(stage).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s,
                      use_acc=False, is_async=True)
    acc = warpgroup_mma(p, v_bufs.index(prev).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG), count=1)
    draw = None
    if DROPOUT_P > 0:
        draw = _dropout_words(rng, start_n, ROWS, BLOCK_N, s_layout)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))        # QK^T done; P V may still run
    p, m_i, alpha = _softmax(s, m_i, rows, start_n, n_k, shift, qk_scale, CAUSAL, MASK, SOFTCAP, EXP2_ON_FMA)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(kv_empty.index(prev), count=1)
    l_i = l_i * alpha + gl.sum(p, 1)
    acc = _rows_scale(acc, alpha)
    return acc, m_i, l_i, _p_operand(p, q_smem.dtype, o_layout, draw, DROPOUT_P, PACKED_MASK)


@gluon.jit(do_not_specialize=SIZES)
def attention_fwd_ws(q_desc, k_desc, v_desc, o_desc, lse_ptr, Rng, Sinks, n_heads, kv_group, n_q, n_k, qk_scale,
                     CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
                     OVERLAP: gl.constexpr, SOFTCAP: gl.constexpr, DROPOUT_P: gl.constexpr,
                     PACKED_MASK: gl.constexpr, EXP2_ON_FMA: gl.constexpr, num_warps: gl.constexpr):
    """BLOCK_M = 128 rows per program: consumer warpgroups 0 and 1 (64 rows each) and a producer warp.
    SOFTCAP, DROPOUT_P, Rng and Sinks as the Triton forward's (kernels/flash_fwd.py): without them
    (0.0 and None) the code is the plain kernel's."""
    ROWS: gl.constexpr = q_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_M: gl.constexpr = 2 * ROWS
    gl.static_assert(num_warps == 4, "the default partition is consumer warpgroup 0")
    gl.static_assert(ROWS == 64, "one warpgroup's wgmma rows")
    gl.static_assert(k_desc.block_type.shape[1] == BLOCK_N, "K descriptor block has BLOCK_N rows")
    gl.static_assert(BLOCK_N % 16 == 0 and HEAD_DIM % 16 == 0, "wgmma K and N are multiples of 16")
    gl.static_assert(STAGES >= 2, "the producer runs ahead by at least one buffer")

    b, h, h_kv, start_m = _program_coordinates(n_heads, kv_group, BLOCK_M)
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)   # both consumers release a buffer

    mid, hi = _tile_ranges(start_m, n_q, n_k, BLOCK_M, BLOCK_N, CAUSAL)
    descs = (q_desc, k_desc, v_desc, o_desc)
    bufs = (q_bufs, k_bufs, v_bufs)
    bars = (q_ready, k_ready, v_ready, kv_empty, turn)
    coords = (b, h, h_kv, start_m, mid, hi)
    sizes = (n_heads, n_q, n_k)
    scores = (Rng, Sinks)
    gl.warp_specialize([
        (_ws_consumer, (descs, bufs, bars, coords, sizes, qk_scale, lse_ptr, scores, BLOCK_N, STAGES, CAUSAL,
                        PINGPONG, OVERLAP, SOFTCAP, DROPOUT_P, PACKED_MASK, EXP2_ON_FMA, 0)),
        (_ws_consumer, (descs, bufs, bars, coords, sizes, qk_scale, lse_ptr, scores, BLOCK_N, STAGES, CAUSAL,
                        PINGPONG, OVERLAP, SOFTCAP, DROPOUT_P, PACKED_MASK, EXP2_ON_FMA, 1)),
        (_ws_producer, (descs, bufs, bars, coords, sizes, qk_scale, lse_ptr, scores, BLOCK_N, STAGES, CAUSAL,
                        PINGPONG, OVERLAP, SOFTCAP, DROPOUT_P, PACKED_MASK, EXP2_ON_FMA, 0)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# Registers per thread: 1 + 4 + 4 warps round up to 3 warpgroups (384 threads), so a launch with
# maxnreg = 168 holds 64,512 registers, one program per SM; the producer needs few and gives the
# rest to the consumers (setmaxnreg). The default partition gets what is left: 240.
MAXNREG = 168
CONSUMER_REGS: gl.constexpr = gl.constexpr(240)
PRODUCER_REGS: gl.constexpr = gl.constexpr(24)


# ----------------------------------------------------------------------------- host side

BLOCK_N = 128
_WS = dict(num_warps=4, maxnreg=MAXNREG)
# The variants a plan can pick: their constexprs (STAGES may depend on the head dim: a D = 128 ring
# of 3 K/V stages and the two Q halves take 224 KB of the 227 KB of shared memory, so 4 fit at
# D = 64 only) and launch options. The steps that led to them, kept runnable for comparison, are
# kernels/lab/gluon_forward_ladder.py's.
VARIANTS = {
    "ws-pingpong-s4": (dict(STAGES={64: 4, 128: 3}, PINGPONG=True, OVERLAP=False), _WS),
    "ws-overlap-s3": (dict(STAGES=3, PINGPONG=True, OVERLAP=True), _WS),
}
# What runs per head dim: the fastest exact variant measured (benchmarks/gluon/gluon_fwd_h200_rounds.md;
# at D = 64 the intra-warpgroup overlap was slower).
DEFAULT_VARIANTS = {64: "ws-pingpong-s4", 128: "ws-overlap-s3"}


@dataclass(frozen=True)
class Launch:
    kernel: object        # the @gluon.jit function
    rows: int             # query rows of one Q / O descriptor block
    block_m: int          # query rows per program
    constexprs: dict
    options: dict         # num_warps, maxnreg


def ws_launch(consts: dict, options: dict, causal: bool, head_dim: int) -> Launch:
    """The warp-specialised kernel's launch for a variant's constexprs and options."""
    stages = consts["STAGES"]
    consts = dict(consts, STAGES=stages[head_dim] if isinstance(stages, dict) else stages, CAUSAL=bool(causal),
                  BLOCK_N=BLOCK_N)
    return Launch(attention_fwd_ws, WG_ROWS, 2 * WG_ROWS, consts, options)


@functools.lru_cache(maxsize=None)
def variant_launch(variant: str | None, causal: bool, head_dim: int) -> Launch:
    """How `variant` (None: the default for this head dim) launches: the same description serves
    the GPU launch and the CPU compile check (scripts/kernel_dev/kernel_report.py)."""
    variant = variant or DEFAULT_VARIANTS[head_dim]
    if variant not in VARIANTS:
        raise ValueError(f"Gluon forward variant {variant!r} is not one of {', '.join(VARIANTS)}")
    return ws_launch(*VARIANTS[variant], causal, head_dim)


def tiles(variant: str, head_dim: int) -> str:
    """The variant's tiles, as a kernel plan names them."""
    stages = VARIANTS[variant][0]["STAGES"]
    return f"{2 * WG_ROWS}x{BLOCK_N}, {stages[head_dim] if isinstance(stages, dict) else stages} stages"


@functools.lru_cache(maxsize=None)
def shared_layout(rows: int, head_dim: int, dtype: torch.dtype):
    """NVMMA (swizzled, wgmma-readable) shared layout of a (1, rows, 1, head_dim) TMA block."""
    return gl.NVMMASharedLayout.get_default_for([1, rows, 1, head_dim], _GL_DTYPES[dtype])


_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


def descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A TMA descriptor of t (B, N, H, D) in blocks of (1, rows, 1, D)."""
    return TensorDescriptor(t, list(t.shape), tma_strides(t), [1, rows, 1, t.shape[-1]],
                            shared_layout(rows, t.shape[-1], t.dtype))


def gluon_attention_forward(q, k, v, causal: bool, softmax_scale: float, variant: str | None = None,
                            launch: Launch | None = None, cache: dict | None = None, *, softcap: float = 0.0,
                            dropout_p: float = 0.0, rng=None, sinks=None):
    """out (B, Nq, H, D) in q's dtype and lse (B, H, Nq) float32 (natural log), by the Gluon kernel
    `variant` (VARIANTS; None: DEFAULT_VARIANTS) or a given `launch`. The caller's kernel plan has
    accepted the inputs (kernels.gluon.refusal); `cache`: the call signature's compiled kernels
    (kernels/launch.py). softcap, dropout_p, rng and sinks as the Triton forward takes them
    (kernels/flash_op.py's _triton_forward)."""
    B, n_q, H, D = q.shape
    n_k, h_kv = k.shape[1], k.shape[2]
    spec = launch or variant_launch(variant, causal, D)
    out = torch.empty((B, n_q, H, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, n_q), dtype=torch.float32, device=q.device)
    tensors = (q, k, v, out)
    described = descriptors(cache, "gluon_fwd_tma", tensors, lambda: [
        descriptor(t, rows) for t, rows in zip(tensors, (spec.rows, BLOCK_N, BLOCK_N, spec.rows))])
    args = (*described, lse, rng, sinks, H, H // h_kv, n_q, n_k, softmax_scale * LOG2E.value)
    run_kernel(spec.kernel, (cdiv(n_q, spec.block_m), B * H), args,
               {**spec.constexprs, **spec.options, "SOFTCAP": float(softcap), "DROPOUT_P": float(dropout_p),
                "PACKED_MASK": scores.packed_mask(dropout_p, q.dtype, True),
                "EXP2_ON_FMA": exp2.on_fma("gluon", D, softcap, dropout_p, q.dtype)},
               cache, "gluon_fwd")
    return out, lse
