"""FlashAttention backward for Hopper (sm_90a) in Gluon, built as FlashAttention-3's.

With S = scale * Q K^T, P = softmax(S) and O = P V, the gradients are (kernels/flash_bwd.py)

    dV = P^T dO        dP = dO V^T        dS = P * (dP - Delta),  Delta_i = rowsum(dO_i * O_i)
    dK = scale * dS^T Q                    dQ = scale * dS K

and P is recomputed tile by tile from the forward's log-sum-exp L: P = exp2(S log2(e) - L log2(e)).
Five matmuls per (key tile, query tile) pair, all wgmma.

Work split. One program (CTA) owns BLOCK_N = 128 keys of one (batch, query head): their K and V
stay in shared memory and their dK, dV accumulate in registers while it streams every query tile
that sees any of those keys. With GQA, the query heads of a KV head share its K and V (in L2), and
each program stores its float32 shares of dK and dV, which `gluon_bwd_dkdv_kernel` sums over the
group in head order (FlashAttention-3 splits the group the same way). Past SPLIT_MAX_BYTES of
shares one program per (batch, KV head) loops over the group's query heads instead, summing in
its registers: 15-22% slower at 32/8 (benchmarks/gluon/gluon_bwd_gqa_split_h200.md), since its
programs are group times longer (the causal grid's tail) and keep the whole group's Q, dO and dQ
in flight. Three partitions (gl.warp_specialize):

    consumers  8 warps (two warpgroups, 240 registers a thread): the matmuls and the softmax;
    producer   1 warp  (24 registers): K and V once, then each step's Q, dO, L2 and Delta through
               a ring of shared-memory buffers, 2 stages (4 for dropout's 64-query steps: SCORE_TILES)
               (TMA; mbarriers `ready`, `step_done`);
    dQ writer  1 warp  (24 registers): each step's dQ tile from shared memory into a float32
               accumulator in global memory with one TMA reduce-add (mbarriers `step_done`, `dq_empty`).

S and dP are computed transposed, keys on the rows: S^T = K Q^T and dP^T = V dO^T are
(BLOCK_N x BLOCK_M) accumulators, 64 key rows per warpgroup (a wgmma is 64 rows tall). P^T and
dS^T are then already laid out as wgmma's A operand for dV += P^T dO and dK += dS^T Q, which take
them from registers: P never reaches shared memory. dQ = dS K needs dS with the queries on the
rows, so dS^T goes to shared memory (double-buffered, one buffer per step parity) and the dQ
wgmma reads it transposed.

One consumer step (query tile i):
    wait `ready`; issue S^T and dP^T; wait for S^T: P^T = exp2(S^T * scale log2 e - L2), masked
    on diagonal and ragged tiles only; wait for dP^T: dS^T = P^T (dP^T - Delta); store dS^T;
    issue dV += P^T dO; ONE barrier over the two warpgroups (both halves of dS^T are in place, and
    every warp has finished step i - 1, so step i - 1's ring stage and dQ buffer are handed on to
    the producer and the writer, one mbarrier `step_done` per ring stage); issue dQ = dS K and
    dK += dS^T Q; wait for all three; store dQ into its buffer for the writer.

Registers. In the transposed layout L2 and Delta run along the columns, so a thread holds 32 of
each (its 32 query columns), on top of the S^T and dP^T accumulators (64 each), dK and dV (32
each) and P^T as an operand (32). So a plain step (no soft-capping, no dropout) starts its two
accumulators at -L2 / (scale log2 e) and at -Delta (use_acc with those tiles): S^T ends as
S^T - L2 / (scale log2 e), so P^T = exp2(that * scale log2 e), and dP^T ends as dP^T - Delta, and
neither vector lives past the issue. At head dim 64 and 128 x 128 that cut ptxas's spills from
340 to 112 bytes a thread, and took 3.5-5% off the causal backward at head dim 64 (1% without a
mask, about 1% at head dim 128; kernels/LOG.md, 2026-12-04 late). The subtraction moves into the
tensor cores' float32 sums, whose rounding is at the scale of L2 / (scale log2 e): an error of a
few units of L2's last place in P's exponent, far below the 16-bit P^T and dS^T the matmuls take.
Dropout steps need S^T and dP^T as they are and keep both vectors; capped ones need S^T as it is
and keep L2 (read after S^T's wait), but start dP^T at -Delta.

dQ. Query tile m of head h receives one dQ share from every key tile that sees it, key tiles
c(m) .. 0 (c(m) the last one, the causal diagonal; all key tiles without a mask). The writer adds
each share to the float32 accumulator (B H, Nq_pad, D) with a TMA reduce-add of the whole tile, so
the consumers never wait on global memory. DETERMINISTIC (the default): the shares are added in
a fixed order, descending key tile, behind a counter per query tile: key tile n's writer waits
until the counter reads c(m) - n, reduces, waits until the reduction has written global memory,
then increments it. Programs take their (KV head, key tile) from an atomic ticket, key tiles
descending within each head, so a writer only waits on programs that started earlier, which are
running or done: no deadlock. Otherwise the shares are added in arrival order.

Three launches (four with GQA's shares): `gluon_bwd_prep_kernel` writes Delta and L2 = L log2(e)
into padded rows TMA can load (+inf for rows that see no key, so their P is 0), zeroes the
accumulator and the counters; the main kernel; `gluon_bwd_dq_kernel` writes dQ = scale *
accumulator in q's dtype and layout (and `gluon_bwd_dkdv_kernel` sums GQA's dK/dV shares).

Soft-capping (kernels/scores.py): S^T is capped as the forward capped it, P^T follows from the capped
scores, and dS^T takes the cap's derivative 1 - tanh^2 as a third factor. Each program first scales
its K tile by scale / c in shared memory (`_fold_cap_into_k`), so S^T = (scale / c) K Q^T is tanh's
input as it stands and dQ's epilogue divides the factor back out; and dS^T is formed at once from P^T,
u and dP^T, after both wgmmas are waited for, so nothing is carried across the dP^T wait. The step
then waits on the special-function unit (a tanh and an exp2 a score), not on instruction issue:
one exponential in four goes to the FMA units (kernels/exp2.py). (The step before it scaled each
score and held P' = P (1 - u^2) as float16 pairs across the dP^T wait: 155 more instructions a step
and the same time, kernels/LOG.md 2026-12-07, midnight.)

Dropout (kernels/scores.py): each step regenerates the forward's keep mask of its S^T tile from the
call's seed, with the same Philox calls the Triton kernels make, between issuing the S^T and dP^T
wgmmas and waiting for them, so that the mask's integer arithmetic runs beside the tensor cores.
The keep bit then rides in P^T's sign (P >= 0: dropped scores negated), so no mask is held across
the dP^T wait: dV sums max(P^T, 0), the dropped P^T (its 1 / (1 - p) applied once, to the finished
dV), and dS^T = P^T (dL/dP^T - Delta) with dL/dP^T = dP^T / (1 - p) where kept and 0 where dropped
is s max(P^T, 0) dP^T - |P^T| Delta, s = 1 / (1 - p).

Tiles (TILES): head dim 64, 128 queries x 128 keys (64 x 128 with dropout: SCORE_TILES); head
dim 128, 64 x 128 (the dK, dV, S^T and dP^T accumulators and the dQ tile must fit 240 registers). Causal: query tiles that see none of a key
tile's keys are never visited, and only those that see some but not all run the masked step.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels import exp2
from kernels.checks import check_flag, check_inputs, check_like_q, check_lse, device_arch, softmax_scale_for
from kernels.exp2 import exp2_split
from kernels.gluon import compat, descriptors, refusal, tma_refusal, tma_strides
from kernels.launch import cdiv, launch
from kernels.scores import dropout_keep_at, dropout_seed_of, hardware_tanh
from kernels.tiles import LOG2E

# Per head dim: BLOCK_M query rows per step, BLOCK_N keys per program, STAGES of the Q/dO ring,
# DQ_BUFS dQ hand-off buffers, and the consumers' schedule (`_step`), each the faster of the two
# measured side by side (benchmarks/gluon/gluon_bwd_h200_rounds.md; DQ_OVERLAP crashes ptxas of
# triton 3.6). STAGES = DQ_BUFS: step j's barrier `step_done` j % STAGES frees both. Shared memory
# per program, of Hopper's 227 KB: head dim 64, K and V 32 KB, the ring 2 x 32 KB, dS^T 2 x 32 KB,
# dQ 2 x 32 KB; head dim 128, K and V 64 KB, the ring 2 x 32 KB, dS^T 2 x 16 KB, dQ 2 x 32 KB.
TILES = {64: dict(BLOCK_M=128, BLOCK_N=128, STAGES=2, DQ_BUFS=2, DV_EARLY=False, DQ_OVERLAP=False,
                 HANDOFF_AT_END=False),
         128: dict(BLOCK_M=64, BLOCK_N=128, STAGES=2, DQ_BUFS=2, DV_EARLY=False, DQ_OVERLAP=False,
                  HANDOFF_AT_END=True)}
SCHEDULE = ("DV_EARLY", "DQ_OVERLAP", "HANDOFF_AT_END")
# Dropout keeps its keep mask alive from S^T's issue to P^T: at head dim 64 the 128-query step then
# spills 30 loads and stores a step (ptxas, triton 3.6), the 64-query one none, and is slower (backward
# 0.937 against 0.896 ms at 4K; benchmarks/attention/score_options_ab_h200.md), so dropout calls take
# the 64-query step, and its smaller tiles leave shared memory for a 4-stage ring (199 KB): with 2 a
# step waited on the ring, for its Q and dO or a free dQ buffer (not yet told apart) (0.918 -> 0.850
# ms at 4K, 3.17 -> 2.85 at 16K on an H100; 3 stages 0.856, 2.87:
# benchmarks/attention/dropout_ring_h100/). Soft-capped steps keep 128 queries: their 64-query step
# gained nothing from the deeper ring (same file).
SCORE_TILES = {64: dict(BLOCK_M=64, STAGES=4, DQ_BUFS=4)}
# dQ added in arrival order (deterministic=False): the 64-query step, whose time with the fixed order
# went to the writer's turns, is then faster than the 128-query one, which contends more in arrival
# order (head dim 64, backward ms on one H100, 64 against 128 queries: causal 0.718 / 0.759 at 4K,
# 2.46 / 2.56 at 16K; no mask 1.20 / 1.36 at 4K; deterministic, causal 0.810 / 0.733 at 4K:
# benchmarks/attention/backward_ring_atomic_h100/, atomic_tiles_h100/). Not soft-capped calls: their
# 128-query step stayed ahead in arrival order too (causal 0.85 / 0.86 at 4K, 2.86 / 3.04 at 16K,
# timed before K was folded, kernels/LOG.md 2026-12-08).
ATOMIC_TILES = {64: dict(BLOCK_M=64, STAGES=4, DQ_BUFS=4)}
TILE_TABLES = ("TILES", "SCORE_TILES", "ATOMIC_TILES")   # what config_for layers, in its order
# GQA: one program per (query head, key tile) while the float32 dK/dV shares take at most this much
# memory (2 GiB: 32 query heads of 128 at 64K tokens); past it, one program per (KV head, key tile)
# loops over the group.
SPLIT_MAX_BYTES = 2 << 30
DKDV_ROWS = 32   # key rows per program of the shares' sum (two float32 tiles in registers)
CONSUMER_WARPS = 8                               # two warpgroups
WORKER_REGS: gl.constexpr = gl.constexpr(24)     # producer and dQ writer; setmaxnreg gives the rest to the consumers


# ---- the prologue and epilogue (plain Triton: no tensor cores, nothing to specialise) ------------

@triton.jit
def _query_tile(n_heads, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """(pid_m, pid_bh, batch, head, rows, cols) of a program in a (query tiles, B * H) grid; batch
    and head in int64 for addressing."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    return pid_m, pid_bh, b, h, pid_m * BLOCK_M + tl.arange(0, BLOCK_M), tl.arange(0, HEAD_DIM)


@triton.jit
def gluon_bwd_prep_kernel(Out, dOut, Lse, Delta, Lse2, DQacc, Sem, Ticket,
                          stride_ob, stride_on, stride_oh, stride_od,
                          stride_dob, stride_don, stride_doh, stride_dod,
                          n_heads, n_q, n_q_pad, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """One (query tile, batch x head) program: its Delta and L2 rows (padded rows: 0 and +inf), its
    zeroed dQ accumulator rows and counter. Program (0, 0) resets the ticket counter."""
    pid_m, pid_bh, b, h, rows, cols = _query_tile(n_heads, BLOCK_M, HEAD_DIM)
    in_q = (rows < n_q)[:, None]
    o = tl.load(Out + b * stride_ob + h * stride_oh + rows[:, None] * stride_on + cols[None, :] * stride_od,
                mask=in_q, other=0.0)
    do = tl.load(dOut + b * stride_dob + h * stride_doh + rows[:, None] * stride_don + cols[None, :] * stride_dod,
                 mask=in_q, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse = tl.load(Lse + pid_bh.to(tl.int64) * n_q + rows, mask=rows < n_q, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    row0 = pid_bh.to(tl.int64) * n_q_pad
    tl.store(Delta + row0 + rows, delta)
    tl.store(Lse2 + row0 + rows, lse2)
    tl.store(DQacc + (row0 + rows[:, None]) * HEAD_DIM + cols[None, :], tl.zeros([BLOCK_M, HEAD_DIM], tl.float32))
    tl.store(Sem + pid_bh * tl.num_programs(0) + pid_m, 0)
    if pid_m + pid_bh == 0:
        tl.store(Ticket, 0)


@triton.jit
def gluon_bwd_dq_kernel(DQacc, dQ, stride_b, stride_n, stride_h, stride_d, n_heads, n_q, n_q_pad, sm_scale,
                        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """dQ = scale * the accumulated shares, in dQ's dtype and layout: one (query tile, batch x head)."""
    pid_m, pid_bh, b, h, rows, cols = _query_tile(n_heads, BLOCK_M, HEAD_DIM)
    acc = tl.load(DQacc + (pid_bh.to(tl.int64) * n_q_pad + rows[:, None]) * HEAD_DIM + cols[None, :])
    tl.store(dQ + b * stride_b + h * stride_h + rows[:, None].to(tl.int64) * stride_n + cols[None, :] * stride_d,
             (acc * sm_scale).to(dQ.dtype.element_ty), mask=(rows < n_q)[:, None])


@triton.jit
def gluon_bwd_dkdv_kernel(DKpart, DVpart, dK, dV, stride_b, stride_n, stride_h, stride_d, n_heads, n_kv_heads, n_k,
                          sm_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """SPLIT_GROUP's epilogue: dK = scale * the sum, and dV = the sum, of a KV head's query heads'
    float32 shares (`_store_dk_dv_share`), added in head order (bit-identical run to run), in dK's
    dtype and layout. One (key tile, batch x KV head) program."""
    pid_n = tl.program_id(0)
    pid = tl.program_id(1)
    b = (pid // n_kv_heads).to(tl.int64)
    h_kv = (pid % n_kv_heads).to(tl.int64)
    group = n_heads // n_kv_heads
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, HEAD_DIM)
    in_k = (rows < n_k)[:, None]
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for g in range(group):
        offs = ((b * n_heads + h_kv * group + g) * n_k + rows[:, None]) * HEAD_DIM + cols[None, :]
        dk += tl.load(DKpart + offs, mask=in_k, other=0.0)
        dv += tl.load(DVpart + offs, mask=in_k, other=0.0)
    out = b * stride_b + h_kv * stride_h + rows[:, None].to(tl.int64) * stride_n + cols[None, :] * stride_d
    tl.store(dK + out, (dk * sm_scale).to(dK.dtype.element_ty), mask=in_k)
    tl.store(dV + out, dv.to(dV.dtype.element_ty), mask=in_k)


# ---- the main kernel ------------------------------------------------------------------------

@gluon.constexpr_function
def _acc_layout(rows, cols, num_warps):
    """wgmma accumulator layout of a (rows x cols) float32 tile: warps 16 rows each down the tile
    (a warpgroup of 4 covers 64 rows); warpgroups left over split the columns."""
    warps_m = min(num_warps, rows // 16)
    warps_n = num_warps // warps_m
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps_m, warps_n],
                                     instr_shape=[16, cols // warps_n, 16])


@gluon.jit
def _row_vector(buf, parent: gl.constexpr):
    """A [1, BLOCK_M] float32 row in shared memory (L2 or Delta, as TMA wrote it, unswizzled) as a
    vector along `parent`'s columns: every thread reads the columns it holds, no layout conversion."""
    flat = compat.smem_reinterpret(buf, gl.float32, [buf.shape[1]], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    return flat.load(gl.SliceLayout(0, parent))


@gluon.jit
def _work_item(Ticket, Docs, n_heads, n_kv_heads, n_q, n_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               CAUSAL: gl.constexpr, SPLIT_GROUP: gl.constexpr, DOCS: gl.constexpr):
    """This program's key tile, from a ticket (heads in order, key tiles descending within each),
    the query heads it visits (SPLIT_GROUP: one; otherwise every query head of its KV head's GQA
    group) and the query tiles it visits per query head: [lo, mid) masked, [mid, tail) not, [tail, hi)
    masked (causal: [lo, hi) are the tiles that see any of its keys; a ragged last key tile masks
    all). Without documents tail = hi = n_m, every query tile from the diagonal down. With them
    (DOCS, causal, kernels/masks.bounds_buffer in Docs) key j is seen by queries [j, end of j's
    document): the tiles past the diagonal see all of the key tile until one holds a query of a
    later document (tail), and none after the last key's document ends (hi).
    Returns (b, h_kv, h0, pid_n, start_n, lo, mid, tail, hi, n_m, heads): query heads h0 .. h0 + heads - 1."""
    n_kt = gl.cdiv(n_k, BLOCK_N)
    ticket = gl.atomic_add(Ticket, 1, sem="relaxed")
    unit = ticket // n_kt
    pid_n = n_kt - 1 - ticket % n_kt
    group = n_heads // n_kv_heads
    if SPLIT_GROUP:   # unit = b * H + h: one query head
        b = unit // n_heads
        h0 = unit % n_heads
        h_kv = h0 // group
        heads = group * 0 + 1
    else:             # unit = b * Hkv + h_kv: the whole group
        b = unit // n_kv_heads
        h_kv = unit % n_kv_heads
        h0 = h_kv * group
        heads = group
    start_n = pid_n * BLOCK_N
    n_m = gl.cdiv(n_q, BLOCK_M)
    if CAUSAL:   # query i sees keys j <= i + n_k - n_q (bottom-right)
        shift = n_k - n_q
        lo = gl.minimum(gl.maximum(start_n - shift, 0) // BLOCK_M, n_m)
        mid = gl.minimum(gl.maximum(gl.cdiv(gl.maximum(start_n + BLOCK_N - 1 - shift, 0), BLOCK_M), lo), n_m)
    else:
        lo = n_m * 0
        mid = n_m * 0
    tail = n_m
    hi = n_m
    if DOCS:   # per key, one past the last query that sees it, at 2 n_q + n_k of the batch row
        ends = Docs + b * (2 * n_q + 2 * n_k + 1) + 2 * n_q + n_k
        hi = gl.cdiv(gl.load(ends + gl.minimum(start_n + BLOCK_N, n_k) - 1), BLOCK_M)
        mid = gl.minimum(mid, hi)
        tail = gl.minimum(gl.maximum(gl.load(ends + start_n) // BLOCK_M, mid), hi)
    if start_n + BLOCK_N > n_k:
        mid = hi
        tail = hi
    return b, h_kv, h0, pid_n, start_n, lo, mid, tail, hi, n_m, heads


@gluon.jit
def _dq_turn(start_m, pid_n, n_q, n_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """How many shares of query tile start_m are added before this key tile's: the key tiles
    above it, c(m) down to pid_n + 1 (c(m): the last key tile the query tile sees)."""
    if CAUSAL:
        last_row = gl.minimum(start_m + BLOCK_M, n_q) - 1
        c = gl.minimum((last_row + n_k - n_q) // BLOCK_N, gl.cdiv(n_k, BLOCK_N) - 1)
    else:
        c = gl.cdiv(n_k, BLOCK_N) - 1
    return c - pid_n


@gluon.jit
def _stage_range(STAGE: gl.constexpr, lo, mid, tail, hi):
    """The query tiles of stage STAGE of a program's loop: 0 the masked [lo, mid), 1 the unmasked
    [mid, tail), 2 the masked [tail, hi) (documents only). One loop body serves them all,
    MASK = STAGE != 1."""
    first = lo
    end = mid
    if STAGE == 1:
        first = mid
        end = tail
    if STAGE == 2:
        first = tail
        end = hi
    return first, end


@gluon.jit
def _step(i, start_m, k_s, v_s, q_bufs, do_bufs, lse_bufs, delta_bufs, ds_bufs, dq_bufs,
          ready, step_done, dq_empty, dk, dv, start_n, n_q, n_k, qk_scale, seed, offset, bh, doc_ends,
          CAUSAL: gl.constexpr, MASK: gl.constexpr, DV_EARLY: gl.constexpr, DQ_OVERLAP: gl.constexpr,
          HANDOFF_AT_END: gl.constexpr, SOFTCAP: gl.constexpr, DROPOUT_P: gl.constexpr, DOCS: gl.constexpr,
          EXP2_ON_FMA: gl.constexpr):
    """Consumer step i over query tile start_m: accumulate dK and dV, leave the dQ share in its buffer.
    The schedule flags (TILES) order the same work differently: DV_EARLY issues dV += P^T dO before
    dP^T is waited for; DQ_OVERLAP stores dQ while dK += dS^T Q runs; HANDOFF_AT_END hands the step's
    ring stage and dQ buffer on at its end (one more barrier) rather than at the next step's barrier.
    Soft-capped calls: k_s holds K scale / c (_fold_cap_into_k), so S^T is tanh's input, and without
    dropout dS^T is computed with P, after both S^T and dP^T are waited for."""
    BLOCK_N: gl.constexpr = k_s.shape[0]
    HEAD_DIM: gl.constexpr = k_s.shape[1]
    BLOCK_M: gl.constexpr = q_bufs.shape[2]
    STAGES: gl.constexpr = q_bufs.shape[0]
    DQ_BUFS: gl.constexpr = dq_bufs.shape[0]
    NW: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = _acc_layout(BLOCK_N, BLOCK_M, NW)
    kv_layout: gl.constexpr = _acc_layout(BLOCK_N, HEAD_DIM, NW)
    dq_layout: gl.constexpr = _acc_layout(BLOCK_M, HEAD_DIM, NW)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    s = i % STAGES
    q_s = q_bufs.index(s).reshape([BLOCK_M, HEAD_DIM])
    do_s = do_bufs.index(s).reshape([BLOCK_M, HEAD_DIM])
    ds_s = ds_bufs.index(i % 2)

    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    FOLDED: gl.constexpr = SOFTCAP == 0 and DROPOUT_P == 0
    # dS^T = P^T (dP^T - Delta) (1 - u^2) at once: u and P die with their score, nothing is packed
    # (the unmasked 128-query step at head dim 64, with K folded too: 698 instructions against 853)
    CAP_DS_AT_ONCE: gl.constexpr = SOFTCAP > 0 and DROPOUT_P == 0
    if SOFTCAP > 0 and DROPOUT_P == 0:   # capped scores need S^T as it is; Delta still folds into dP^T
        delta = _row_vector(delta_bufs.index(s), s_layout)
        dp_init = _own(zero_s - delta[None, :])
        s_t = warpgroup_mma(k_s, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(v_s, do_s.permute((1, 0)), dp_init, is_async=True)
    elif FOLDED:   # the accumulators start at -L2 / qk_scale and -Delta, so no row vector outlives the
        # issue; both starting tiles are written before the first wgmma, so none waits for the other
        lse2 = _row_vector(lse_bufs.index(s), s_layout)
        delta = _row_vector(delta_bufs.index(s), s_layout)
        s_init = _own(zero_s - lse2[None, :] * (1.0 / qk_scale))
        dp_init = _own(zero_s - delta[None, :])
        s_t = warpgroup_mma(k_s, q_s.permute((1, 0)), s_init, is_async=True)
        dp_t = warpgroup_mma(v_s, do_s.permute((1, 0)), dp_init, is_async=True)
    else:   # dropped scores, capped or not, need S^T and dP^T as they are
        s_t = warpgroup_mma(k_s, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(v_s, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    if DROPOUT_P > 0:   # the forward's mask, drawn while the tensor cores compute S^T and dP^T
        keep_t = _dropout_keep_t(seed, offset, bh, start_m, start_n, BLOCK_N, BLOCK_M, s_layout, DROPOUT_P)
    if CAP_DS_AT_ONCE:
        s_t, dp_t = warpgroup_mma_wait(0, deps=(s_t, dp_t))
    else:
        s_t = warpgroup_mma_wait(1, deps=(s_t,))
    if not FOLDED:   # L2 read at its use: beside the issue its 32 registers stayed live through the keep
        # mask's draw and tanh's tile (128 queries: dropout's spills 99 -> 30 loads and stores a step)
        lse2 = _row_vector(lse_bufs.index(s), s_layout)
    if SOFTCAP > 0:   # scores c tanh(s / c) (kernels/scores.py): P from the capped scores, u kept for dS
        u = hardware_tanh(s_t)   # S^T is already (scale / c) K Q^T
        # EXP2_ON_FMA of every 4 exponentials on the FMA units (kernels/exp2.py), in unmasked steps
        p_t = exp2_split(u * (SOFTCAP * LOG2E) - lse2[None, :], 0 if MASK else EXP2_ON_FMA)
    elif FOLDED:   # s_t is S^T - L2 / qk_scale
        p_t = gl.exp2(s_t * qk_scale)
    else:
        p_t = gl.exp2(s_t * qk_scale - lse2[None, :])
    if MASK:  # key j of query i: j < n_k, and causal j <= i + n_k - n_q
        keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        queries = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        if CAUSAL and DROPOUT_P > 0:   # see _apart: else LLVM makes the masked step's Philox calls twice
            queries = _apart(queries)
        seen = (keys[:, None] < n_k) & (queries[None, :] >= 0)
        if CAUSAL:
            seen = seen & (keys[:, None] <= queries[None, :] + (n_k - n_q))
        if DOCS:   # and i before the end of key j's document: per key row of S^T, two a thread (per query
            # column, the document's start, would hold 32 a thread across the step's wgmmas)
            ends = gl.load(doc_ends + keys, mask=keys < n_k, other=0)
            seen = seen & (queries[None, :] < ends[:, None])
        p_t = gl.where(seen, p_t, 0.0)
    # A operands in registers are read while their wgmma runs: they stay in the final wait's deps
    if DROPOUT_P > 0:   # the keep bit rides in P's sign (P >= 0) to dS: no mask is held past this
        p_t = gl.where(keep_t, p_t, -p_t)
        # dV sums the dropped P^T; its 1 / (1 - p) is applied once, at the end
        p_op = gl.convert_layout(gl.maximum(p_t, 0.0).to(k_s.dtype), a_layout)
    else:
        p_op = gl.convert_layout(p_t.to(k_s.dtype), a_layout)
    if CAP_DS_AT_ONCE:   # dp_t is dP^T - Delta
        ds_t = (p_t * (1.0 - u * u) * dp_t).to(k_s.dtype)
    elif SOFTCAP > 0:   # dS = P (dP - Delta) (1 - u^2): fold the cap's derivative into the P that dS reads
        p_t = p_t * (1.0 - u * u)
    if DV_EARLY:   # dV queued behind dP^T: the tensor cores run it while dS is computed and stored
        dv = warpgroup_mma(p_op, do_s, dv, is_async=True)
    if DROPOUT_P > 0:
        delta = _row_vector(delta_bufs.index(s), s_layout)
    if not CAP_DS_AT_ONCE:   # (which waited for dP^T with S^T)
        if DV_EARLY:
            dp_t = warpgroup_mma_wait(1, deps=(dp_t,))
        else:
            dp_t = warpgroup_mma_wait(0, deps=(dp_t,))
    if DROPOUT_P > 0:   # dS = P (dL/dP - Delta), dL/dP 0 where dropped, scaled by 1 / (1 - p) where kept:
        # here (1 - p) dS, whose 1 / (1 - p) joins dQ's and dK's final scale (launch_backward)
        ds_t = (gl.maximum(p_t, 0.0) * dp_t - gl.abs(p_t) * (delta * (1.0 - DROPOUT_P))[None, :]).to(k_s.dtype)
    elif not CAP_DS_AT_ONCE:   # dp_t is dP^T - Delta
        ds_t = (p_t * dp_t).to(k_s.dtype)
    ds_s.store(ds_t)
    if not DV_EARLY:
        dv = warpgroup_mma(p_op, do_s, dv, is_async=True)
    fence_async_shared()
    compat.thread_barrier()   # both halves of dS^T are in place
    if not HANDOFF_AT_END:
        # every warp is also past step i - 1: its ring stage and dQ buffer go to the producer and writer
        mbarrier.arrive(step_done.index((i + STAGES - 1) % STAGES), count=1, pred=i > 0)
    dq = warpgroup_mma(ds_s.permute((1, 0)), k_s, gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout),
                       use_acc=False, is_async=True)
    ds_op = gl.convert_layout(ds_t, a_layout)
    dk = warpgroup_mma(ds_op, q_s, dk, is_async=True)
    jb = i % DQ_BUFS
    if DQ_OVERLAP:   # dQ stored while dK still runs
        dq, dv, p_op = warpgroup_mma_wait(1, deps=(dq, dv, p_op))
        mbarrier.wait(dq_empty.index(jb), ((i // DQ_BUFS) & 1) ^ 1)   # the writer is done with its last use
        dq_bufs.index(jb).store(dq)
        fence_async_shared()
        dk, ds_op = warpgroup_mma_wait(0, deps=(dk, ds_op))
    else:
        dq, dk, dv, p_op, ds_op = warpgroup_mma_wait(0, deps=(dq, dk, dv, p_op, ds_op))
        mbarrier.wait(dq_empty.index(jb), ((i // DQ_BUFS) & 1) ^ 1)
        dq_bufs.index(jb).store(dq)
        fence_async_shared()
    if HANDOFF_AT_END:   # this step's ring stage and dQ buffer go on now
        compat.thread_barrier()
        mbarrier.arrive(step_done.index(i % STAGES), count=1)
    return dk, dv


@gluon.jit
def _own(x):
    """x with every element in a register of its own, written here. A wgmma's starting accumulator
    built from a broadcast vector repeats values (a thread's two rows share their columns'), and
    LLVM then copies them into the accumulator registers after the wgmma's fence, which makes
    ptxas wait for the wgmma in flight before the next one issues (its warning C7517)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def _apart(x):
    """Integer x through an opaque copy, which ptxas drops. The causal mask compares each query
    (column) with each key; given that, LLVM no longer sees that a thread's columns with the same
    call counter (`kernels.scores.dropout_draw_at`) make the same Philox call, and the masked step
    made about twice the calls of the unmasked one (kernels/LOG.md, 2026-12-05). A mask computed
    from the copy leaves the draw's arithmetic to itself."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _dropout_keep_t(seed, offset, bh, start_m, start_n, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                    layout: gl.constexpr, DROPOUT_P: gl.constexpr):
    """(BLOCK_N, BLOCK_M) booleans in `layout`: whether the forward kept score (query start_m + c, key
    start_n + r), kernels/scores.py's draw on S^T. Key bit 0 is a lane of the S^T accumulator,
    query bits 0 and 3 and key bit 3 are registers: of each two calls that a thread and the thread
    4 lanes away both read, each makes one and takes its partner's words (SHARE=2)."""
    r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))[:, None]
    c = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, layout))[None, :]
    return dropout_keep_at(seed, offset, bh, start_m, c, start_n, r, gl.zeros([BLOCK_N, BLOCK_M], gl.uint32, layout),
                           DROPOUT_P, SHARE=2)


@gluon.jit
def _consumers(k_s, v_s, smem, bars, work, sizes, qk_scale, Rng, Docs, CAUSAL: gl.constexpr,
               DV_EARLY: gl.constexpr, DQ_OVERLAP: gl.constexpr, HANDOFF_AT_END: gl.constexpr,
               SOFTCAP: gl.constexpr, DROPOUT_P: gl.constexpr, DOCS: gl.constexpr, EXP2_ON_FMA: gl.constexpr):
    """The two consumer warpgroups: every step of the program, then dK (unscaled) and dV, float32."""
    q_bufs, do_bufs, lse_bufs, delta_bufs, ds_bufs, dq_bufs = smem
    kv_bar, ready, step_done, dq_empty = bars
    b, h_kv, h0, pid_n, start_n, lo, mid, tail, hi, n_m, group = work
    n_heads, n_q, n_k, n_q_pad = sizes
    BLOCK_N: gl.constexpr = k_s.shape[0]
    HEAD_DIM: gl.constexpr = k_s.shape[1]
    BLOCK_M: gl.constexpr = q_bufs.shape[2]
    STAGES: gl.constexpr = q_bufs.shape[0]
    kv_layout: gl.constexpr = _acc_layout(BLOCK_N, HEAD_DIM, gl.num_warps())
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    seed, offset = dropout_seed_of(Rng, DROPOUT_P)
    doc_ends = Docs
    if DOCS:   # per key, one past the last query that sees it (its document's end), at 2 n_q + n_k of the row
        doc_ends = Docs + b * (2 * n_q + 2 * n_k + 1) + 2 * n_q + n_k
    STAGE_LOOPS: gl.constexpr = 3 if DOCS else 2
    mbarrier.wait(kv_bar, 0)
    if SOFTCAP > 0:
        _fold_cap_into_k(k_s, qk_scale / (SOFTCAP * LOG2E))
    i = 0
    for g in range(group):
        # the masked query tiles [lo, mid), the unmasked [mid, tail), then (documents) the masked [tail, hi)
        for stage in gl.static_range(STAGE_LOOPS):
            first, end = _stage_range(stage, lo, mid, tail, hi)
            for m in range(first, end):
                dk, dv = _step(i, m * BLOCK_M, k_s, v_s, q_bufs, do_bufs, lse_bufs, delta_bufs, ds_bufs, dq_bufs,
                               ready, step_done, dq_empty, dk, dv, start_n, n_q, n_k, qk_scale, seed, offset,
                               b * n_heads + h0 + g, doc_ends, CAUSAL, stage != 1, DV_EARLY, DQ_OVERLAP,
                               HANDOFF_AT_END, SOFTCAP, DROPOUT_P, DOCS, EXP2_ON_FMA)
                i += 1
    if not HANDOFF_AT_END:
        compat.thread_barrier()   # the last step's dQ is in its buffer
        mbarrier.arrive(step_done.index((i + STAGES - 1) % STAGES), count=1, pred=i > 0)
    if DROPOUT_P > 0:
        dv = dv * (1.0 / (1.0 - DROPOUT_P))
    return dk, dv


@gluon.jit
def _fold_cap_into_k(k_s, factor):
    """K in shared memory times factor = scale / c, once a program: S^T = K Q^T is then tanh's input
    as it stands, which takes one multiply a score out of every step (issue slots that let one
    exponential in four move to the FMA units: kernels/LOG.md, 2026-12-08), and dQ = dS K carries
    the factor, which the epilogue's scale divides out. The scaled K is rounded to K's dtype, a
    relative 2^-9 at most on each element in bf16: less than the bf16 scores of the standard formula
    are rounded by."""
    NW: gl.constexpr = gl.num_warps()
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // k_s.shape[1], k_s.shape[1] // 8], [NW, 1], [1, 0])
    k = k_s.load(layout)
    k_s.store((k.to(gl.float32) * factor).to(k_s.dtype))
    fence_async_shared()   # the consumers' wgmmas read K through the async proxy
    compat.thread_barrier()


@gluon.jit
def _producer(k_s4, v_s4, smem, bars, descs, work, sizes, CAUSAL: gl.constexpr):
    """TMA loads: K and V once, then each step's Q, dO, L2 and Delta into the ring."""
    q_bufs, do_bufs, lse_bufs, delta_bufs, ds_bufs, dq_bufs = smem
    kv_bar, ready, step_done, dq_empty = bars
    q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc, Sem = descs
    b, h_kv, h0, pid_n, start_n, lo, mid, tail, hi, n_m, group = work
    n_heads, n_q, n_k, n_q_pad = sizes
    STAGES: gl.constexpr = q_bufs.shape[0]
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    compat.tma_load(k_desc, [b, start_n, h_kv, 0], kv_bar, k_s4)
    compat.tma_load(v_desc, [b, start_n, h_kv, 0], kv_bar, v_s4)
    per_head = hi - lo
    for j in range(group * per_head):
        s = j % STAGES
        # step j - 2 has released the stage (a fresh barrier counts as released, hence the flip)
        mbarrier.wait(step_done.index(s), ((j // STAGES) & 1) ^ 1)
        h = h0 + j // per_head
        start_m = (lo + j % per_head) * BLOCK_M
        bar = ready.index(s)
        mbarrier.expect(bar, 2 * q_desc.block_type.nbytes + 2 * lse_desc.block_type.nbytes)
        compat.tma_load(q_desc, [b, start_m, h, 0], bar, q_bufs.index(s))
        compat.tma_load(do_desc, [b, start_m, h, 0], bar, do_bufs.index(s))
        compat.tma_load(lse_desc, [b * n_heads + h, start_m], bar, lse_bufs.index(s))
        compat.tma_load(delta_desc, [b * n_heads + h, start_m], bar, delta_bufs.index(s))


@gluon.jit
def _dq_writer(k_s4, v_s4, smem, bars, descs, work, sizes, CAUSAL: gl.constexpr, DETERMINISTIC: gl.constexpr):
    """Each step's dQ share from its buffer into the float32 accumulator, one TMA reduce-add a tile;
    DETERMINISTIC, in descending key-tile order behind the query tile's counter."""
    q_bufs, do_bufs, lse_bufs, delta_bufs, ds_bufs, dq_bufs = smem
    kv_bar, ready, step_done, dq_empty = bars
    q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc, Sem = descs
    b, h_kv, h0, pid_n, start_n, lo, mid, tail, hi, n_m, group = work
    n_heads, n_q, n_k, n_q_pad = sizes
    BLOCK_M: gl.constexpr = dq_bufs.shape[1]
    BLOCK_N: gl.constexpr = k_s4.shape[1]
    DQ_BUFS: gl.constexpr = dq_bufs.shape[0]
    per_head = hi - lo
    for j in range(group * per_head):
        jb = j % DQ_BUFS
        mbarrier.wait(step_done.index(jb), (j // DQ_BUFS) & 1)   # step j's dQ is in its buffer
        bh = b * n_heads + h0 + j // per_head
        m = lo + j % per_head
        row = bh * n_q_pad + m * BLOCK_M
        if DETERMINISTIC:
            counter = Sem + bh * n_m + m
            turn = _dq_turn(m * BLOCK_M, pid_n, n_q, n_k, BLOCK_M, BLOCK_N, CAUSAL)
            seen = gl.atomic_add(counter, 0, sem="acquire")
            while seen < turn:
                seen = gl.atomic_add(counter, 0, sem="acquire")
            compat.fence_proxy_async_global(seen)
            compat.tma_reduce_add(dq_desc, [row, 0], dq_bufs.index(jb))
            tma.store_wait(0)                  # the buffer has been read: the consumers may refill it
            mbarrier.arrive(dq_empty.index(jb), count=1)
            compat.bulk_wait_written(seen)     # the sum is in global memory before the next key tile's turn
            compat.thread_barrier()
            gl.atomic_add(counter, 1, sem="release")
        else:
            compat.tma_reduce_add(dq_desc, [row, 0], dq_bufs.index(jb))
            tma.store_wait(0)
            mbarrier.arrive(dq_empty.index(jb), count=1)


@gluon.jit
def _allocate(q_desc, k_desc, lse_desc, dq_desc, STAGES: gl.constexpr, DQ_BUFS: gl.constexpr):
    """Shared memory (K and V, the ring of Q, dO, L2 and Delta, dS^T twice, the dQ buffers) and the
    mbarriers, initialised."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[3]
    dtype: gl.constexpr = k_desc.dtype
    k_s4 = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_s4 = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    ds_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype))
    dq_bufs = gl.allocate_shared_memory(gl.float32, [DQ_BUFS] + dq_desc.block_type.shape, dq_desc.layout)
    gl.static_assert(STAGES == DQ_BUFS, "step_done's barrier j % STAGES releases step j's ring stage and dQ buffer")
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    step_done = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_BUFS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(step_done.index(s), count=1)
        mbarrier.init(dq_empty.index(s), count=1)
    smem = (q_bufs, do_bufs, lse_bufs, delta_bufs, ds_bufs, dq_bufs)
    return k_s4, v_s4, smem, (kv_bar, ready, step_done, dq_empty)


@gluon.jit
def _store_dk_dv(dk_desc, dv_desc, k_s4, v_s4, dk, dv, sm_scale, b, start_n, h_kv):
    """dK = scale * sum dS^T Q and dV through the K and V buffers (every wgmma that read them is
    done) to TMA stores, which drop the rows past n_k of a ragged last tile."""
    BLOCK_N: gl.constexpr = k_s4.shape[1]
    HEAD_DIM: gl.constexpr = k_s4.shape[3]
    compat.thread_barrier()
    k_s4.reshape([BLOCK_N, HEAD_DIM]).store((dk * sm_scale).to(dk_desc.dtype))
    v_s4.reshape([BLOCK_N, HEAD_DIM]).store(dv.to(dv_desc.dtype))
    fence_async_shared()
    compat.thread_barrier()
    compat.tma_store(dk_desc, [b, start_n, h_kv, 0], k_s4)
    compat.tma_store(dv_desc, [b, start_n, h_kv, 0], v_s4)
    tma.store_wait(0)


@gluon.jit
def _store_dk_dv_share(DKpart, DVpart, dk, dv, bh, start_n, n_k):
    """SPLIT_GROUP: this query head's share of dK (unscaled) and dV in float32, rows start_n.. of
    head bh = b * H + h of the two (B H, Nk, D) buffers, for
    `gluon_bwd_dkdv_kernel` to sum over the group. Stored from the wgmma accumulators' registers:
    once a program, so no shared-memory staging."""
    BLOCK_N: gl.constexpr = dk.shape[0]
    HEAD_DIM: gl.constexpr = dk.shape[1]
    layout: gl.constexpr = dk.type.layout
    rows = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    offs = (bh.to(gl.int64) * n_k + rows[:, None]) * HEAD_DIM + cols[None, :]
    in_k = (rows < n_k)[:, None] & (cols < HEAD_DIM)[None, :]
    gl.store(DKpart + offs, dk, mask=in_k)
    gl.store(DVpart + offs, dv, mask=in_k)


@gluon.jit(do_not_specialize=["n_heads", "n_kv_heads", "n_q", "n_k", "n_q_pad"])
def gluon_bwd_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc, dq_desc,
                     Sem, Ticket, DKpart, DVpart, Rng, Docs, n_heads, n_kv_heads, n_q, n_k, n_q_pad, qk_scale,
                     sm_scale, STAGES: gl.constexpr, DQ_BUFS: gl.constexpr, CAUSAL: gl.constexpr,
                     DETERMINISTIC: gl.constexpr, SPLIT_GROUP: gl.constexpr, DV_EARLY: gl.constexpr,
                     DQ_OVERLAP: gl.constexpr, HANDOFF_AT_END: gl.constexpr, SOFTCAP: gl.constexpr = 0.0,
                     DROPOUT_P: gl.constexpr = 0.0, DOCS: gl.constexpr = False, EXP2_ON_FMA: gl.constexpr = 0):
    """Grid: (cdiv(Nk, BLOCK_N) * B * Hkv,), or (cdiv(Nk, BLOCK_N) * B * H,) with SPLIT_GROUP.
    Descriptors: q, do (B, Nq, H, D) and k, v, dk, dv (B, Nk, Hkv, D) in blocks [1, rows, 1, D]; L2
    and Delta (B H, Nq_pad) in blocks [1, BLOCK_M]; the dQ accumulator (B H Nq_pad, D) float32 in
    blocks [BLOCK_M, D]. DKpart, DVpart: SPLIT_GROUP's (B H, Nk, D) float32 shares of dK and dV. Rng:
    with DROPOUT_P > 0, the call's seed and offset (kernels/scores.py); None otherwise. Docs: with DOCS
    (causal documents), kernels/masks.bounds_buffer's (B, 2 Nq + 2 Nk + 1) int32; None otherwise.
    sm_scale: dK's factor, the softmax scale, over (1 - p) with dropout (the steps' dS is (1 - p) dS).
    EXP2_ON_FMA (0 to 4): of every 4 exponentials of a soft-capped unmasked step's P, how many the FMA
    units compute (kernels/exp2.py), from kernels.exp2.on_fma. SOFTCAP > 0: K is scaled by scale / c
    in shared memory (_fold_cap_into_k), so dQ's accumulator is (scale / c) times dS K; the
    epilogue's factor takes it out."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[3]
    gl.static_assert(HEAD_DIM % 16 == 0 and HEAD_DIM <= 256, "wgmma takes head dims in steps of 16")
    gl.static_assert(BLOCK_N == 16 * gl.num_warps(), "each consumer warp owns 16 key rows")
    gl.static_assert(BLOCK_M % 64 == 0 and BLOCK_M <= 128, "query tiles of 64 or 128 rows")
    gl.static_assert(STAGES >= 2, "the ring needs a stage to fill while one is read")
    gl.static_assert(CAUSAL or not DOCS, "document masks here are causal ones")
    work = _work_item(Ticket, Docs, n_heads, n_kv_heads, n_q, n_k, BLOCK_M, BLOCK_N, CAUSAL, SPLIT_GROUP, DOCS)
    k_s4, v_s4, smem, bars = _allocate(q_desc, k_desc, lse_desc, dq_desc, STAGES, DQ_BUFS)
    k_s = k_s4.reshape([BLOCK_N, HEAD_DIM])
    v_s = v_s4.reshape([BLOCK_N, HEAD_DIM])
    descs = (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc, Sem)
    sizes = (n_heads, n_q, n_k, n_q_pad)
    dk, dv = gl.warp_specialize([
        (_consumers, (k_s, v_s, smem, bars, work, sizes, qk_scale, Rng, Docs, CAUSAL, DV_EARLY, DQ_OVERLAP,
                      HANDOFF_AT_END, SOFTCAP, DROPOUT_P, DOCS, EXP2_ON_FMA)),
        (_producer, (k_s4, v_s4, smem, bars, descs, work, sizes, CAUSAL)),
        (_dq_writer, (k_s4, v_s4, smem, bars, descs, work, sizes, CAUSAL, DETERMINISTIC)),
    ], [1, 1], [WORKER_REGS, WORKER_REGS])
    if SPLIT_GROUP:
        bh = work[0] * n_heads + work[2]
        _store_dk_dv_share(DKpart, DVpart, dk, dv, bh, work[4], n_k)
    else:
        _store_dk_dv(dk_desc, dv_desc, k_s4, v_s4, dk, dv, sm_scale, work[0], work[4], work[1])


# ---- host side ------------------------------------------------------------------------------

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def config_for(head_dim: int, dropout: bool = False, config: dict | None = None, *, deterministic: bool = True,
               softcap: bool = False) -> dict:
    """TILES of a head dim, with SCORE_TILES' changes for dropout calls, ATOMIC_TILES' for dQ in
    arrival order without a soft cap, and `config`'s on top."""
    arrival = not deterministic and not softcap
    return {**TILES[head_dim], **(SCORE_TILES.get(head_dim, {}) if dropout else {}),
            **(ATOMIC_TILES.get(head_dim, {}) if arrival else {}), **(config or {})}


def tiles(head_dim: int, dropout: bool = False, deterministic: bool = True, softcap: bool = False) -> str:
    """The tiles of a head dim, as a kernel plan names them."""
    cfg = config_for(head_dim, dropout, deterministic=deterministic, softcap=softcap)
    return f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}, {cfg['STAGES']} stages"


@functools.cache
def _layouts(dtype: torch.dtype, block_m: int, block_n: int, head_dim: int):
    """Shared-memory layouts of the TMA blocks: (query/dO tile, key/value tile, L2/Delta row, dQ tile)."""
    gdt = _GL_DTYPES[dtype]
    return (gl.NVMMASharedLayout.get_default_for([1, block_m, 1, head_dim], gdt),
            gl.NVMMASharedLayout.get_default_for([1, block_n, 1, head_dim], gdt),
            gl.NVMMASharedLayout.get_default_for([1, block_m], gl.float32),
            gl.NVMMASharedLayout.get_default_for([block_m, head_dim], gl.float32))


def launch_options() -> dict:
    """num_warps, and the register cap at launch: 8 consumer warps plus 2 worker warps round up to 3
    warpgroups (384 threads), so 64K registers allow 168 a thread; setmaxnreg then moves the workers'
    share (WORKER_REGS) to the consumers (240)."""
    return {"num_warps": CONSUMER_WARPS, "maxnreg": 168}


def compile_for_sm90(head_dim: int, dtype: torch.dtype = torch.bfloat16, causal: bool = True,
                     deterministic: bool = True, config: dict | None = None, softcap: float = 0.0,
                     dropout_p: float = 0.0, documents: bool = False, exp2_on_fma: int = 0):
    """The main kernel compiled for sm_90a without a GPU (a launch's signature: descriptors, the
    pointers 16-byte aligned): CI checks it compiles, and kernel reports read its registers."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = config_for(head_dim, dropout_p > 0, config, deterministic=deterministic, softcap=softcap > 0)
    qlay, klay, llay, dqlay = _layouts(dtype, cfg["BLOCK_M"], cfg["BLOCK_N"], head_dim)
    dt = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]

    def desc(block, layout, ty=dt):
        return f"tensordesc<{ty}{list(block)},{layout!r}>"

    q_block, k_block = [1, cfg["BLOCK_M"], 1, head_dim], [1, cfg["BLOCK_N"], 1, head_dim]
    signature = {"q_desc": desc(q_block, qlay), "k_desc": desc(k_block, klay), "v_desc": desc(k_block, klay),
                 "do_desc": desc(q_block, qlay), "dk_desc": desc(k_block, klay), "dv_desc": desc(k_block, klay),
                 "lse_desc": desc([1, cfg["BLOCK_M"]], llay, "fp32"), "delta_desc": desc([1, cfg["BLOCK_M"]], llay, "fp32"),
                 "dq_desc": desc([cfg["BLOCK_M"], head_dim], dqlay, "fp32"), "Sem": "*i32", "Ticket": "*i32",
                 "DKpart": "*fp32", "DVpart": "*fp32", "Rng": "*i64" if dropout_p > 0 else "constexpr",
                 "Docs": "*i32" if documents else "constexpr",
                 "n_heads": "i32", "n_kv_heads": "i32", "n_q": "i32", "n_k": "i32", "n_q_pad": "i32",
                 "qk_scale": "fp32", "sm_scale": "fp32"}
    consts = dict(STAGES=cfg["STAGES"], DQ_BUFS=cfg["DQ_BUFS"], CAUSAL=causal, DETERMINISTIC=deterministic,
                  SPLIT_GROUP=bool(cfg.get("SPLIT_GROUP")), **{flag: cfg[flag] for flag in SCHEDULE},
                  SOFTCAP=float(softcap), DROPOUT_P=float(dropout_p), DOCS=documents, EXP2_ON_FMA=int(exp2_on_fma),
                  **({} if dropout_p > 0 else {"Rng": None}), **({} if documents else {"Docs": None}))
    signature.update({name: "constexpr" for name in consts})
    names = list(gluon_bwd_kernel.arg_names)
    pointers = ("Sem", "Ticket", "DKpart", "DVpart") + (("Rng",) if dropout_p > 0 else ()) + (("Docs",) if documents else ())
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in pointers}
    source = GluonASTSource(fn=gluon_bwd_kernel, signature={n: signature[n] for n in names}, constexprs=consts,
                            attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=launch_options())


def gluon_attention_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic=True, softcap=0.0):
    """dq, dk, dv of attention from its output `out` and log-sum-exp `lse`, on Hopper.

    Layouts as kernels.flash_attention_backward: q, dout, out (B, Nq, H, D); k, v (B, Nk, Hkv, D);
    lse (B, H, Nq) float32, natural log, -inf for rows that see no key; causal aligned bottom-right.
    dk, dv are summed over each GQA group. deterministic=True (default): dq's float32 sums are
    formed in a fixed order, so the gradients are bit-identical run to run; False: in arrival
    order. softcap > 0: the forward's scores were soft-capped at it (kernels/scores.py). Inputs no
    kernel takes, or that the Gluon kernels refuse (kernels.gluon.refusal), raise ValueError naming why.
    """
    check_inputs(q, k, v)
    check_like_q(q, dout=dout, out=out)
    check_lse(q, lse)
    check_flag(causal, "causal")
    check_flag(deterministic, "deterministic")
    tma = not any(tma_refusal(n, t) for n, t in (("q", q), ("k", k), ("v", v)))
    reason = refusal(device_arch(q.device), q.dtype, q.shape[-1], "none", tma)
    if reason is not None:
        raise ValueError(f"the Gluon backward cannot run this call: {reason}")
    return launch_backward(dout, q, k, v, out, lse, causal, softmax_scale_for(softmax_scale, q.shape[-1]),
                           deterministic, softcap=softcap)[:3]


def split_group(batch: int, heads: int, kv_heads: int, n_k: int, head_dim: int) -> bool:
    """Whether a GQA call's programs each take one query head (SPLIT_GROUP), their float32 shares of
    dK and dV summed afterwards, rather than one program looping over the group: group > 1, and
    the shares (2 B H Nk D float32) within SPLIT_MAX_BYTES."""
    return heads > kv_heads and 2 * batch * heads * n_k * head_dim * 4 <= SPLIT_MAX_BYTES


def _descriptor(t: torch.Tensor, block: list[int], layout) -> TensorDescriptor:
    return TensorDescriptor(t, list(t.shape), tma_strides(t) if t.dim() == 4 else list(t.stride()), block, layout)


def launch_backward(dout, q, k, v, out, lse, causal: bool, scale: float, deterministic: bool, cache=None, key=(),
                    config: dict | None = None, softcap: float = 0.0, dropout_p: float = 0.0, rng=None, grads=None,
                    doc_bounds=None):
    """The launches on inputs a kernel plan has accepted (no checks: kernels/flash_op.py's path);
    `cache` and `key` as kernels/launch.py's, `config` overrides TILES (the benchmarks'); dropout_p
    and rng (kernels/scores.py's dropout_seed) as the forward's; grads: the dq, dk, dv to write into
    (laid out as q, k, v), or None; doc_bounds: a causal call's document mask as
    kernels/masks.bounds_buffer lays it out, or None."""
    B, n_q, H, D = q.shape
    n_k, h_kv = k.shape[1], k.shape[2]
    cfg = config_for(D, dropout_p > 0, config, deterministic=deterministic, softcap=softcap > 0)
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    n_m = cdiv(n_q, block_m)
    n_q_pad = n_m * block_m
    if tma_refusal("dout", dout):   # autograd's incoming gradient may be any layout: one copy then
        dout = dout.contiguous()
    dev = q.device
    rows = torch.empty((2, B * H, n_q_pad), dtype=torch.float32, device=dev)   # L2, Delta
    dq_acc = torch.empty((B * H * n_q_pad, D), dtype=torch.float32, device=dev)
    counters = torch.empty(cdiv(B * H * n_m, 4) * 4 + 4, dtype=torch.int32, device=dev)
    sem, ticket = counters[:-4], counters[-4:]
    if grads is None:
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        dk = torch.empty((B, n_k, h_kv, D), dtype=k.dtype, device=dev)
        dv = torch.empty((B, n_k, h_kv, D), dtype=v.dtype, device=dev)
    else:
        dq, dk, dv = grads
    split = cfg.get("SPLIT_GROUP")
    if split is None:
        split = split_group(B, H, h_kv, n_k, D)
    shares = torch.empty((2, B * H, n_k, D), dtype=torch.float32, device=dev) if split else (dq_acc, dq_acc)

    launch(gluon_bwd_prep_kernel, (n_m, B * H),
           (out, dout, lse, rows[1], rows[0], dq_acc, sem, ticket, *out.stride(), *dout.stride(), H, n_q, n_q_pad),
           dict(HEAD_DIM=D, BLOCK_M=block_m, num_warps=4), cache, ("gluon-bwd-prep", *key))
    qlay, klay, llay, dqlay = _layouts(q.dtype, block_m, block_n, D)
    q_block, k_block = [1, block_m, 1, D], [1, block_n, 1, D]
    tensors = (q, k, v, dout, dk, dv, rows[0], rows[1], dq_acc)
    blocks = ((q_block, qlay), (k_block, klay), (k_block, klay), (q_block, qlay), (k_block, klay), (k_block, klay),
              ([1, block_m], llay), ([1, block_m], llay), ([block_m, D], dqlay))
    described = descriptors(cache, ("gluon-bwd-tma", *key), tensors,
                            lambda: [_descriptor(t, *block) for t, block in zip(tensors, blocks)])
    grad_scale = scale / (1.0 - dropout_p)   # dK's and dQ's: the kernel's dS is (1 - p) dS with dropout
    args = (*described, sem, ticket, shares[0], shares[1], rng if dropout_p > 0 else None, doc_bounds, H, h_kv, n_q,
            n_k, n_q_pad, scale * LOG2E.value, grad_scale)
    launch(gluon_bwd_kernel, (cdiv(n_k, block_n) * B * (H if split else h_kv),), args,
           dict(STAGES=cfg["STAGES"], DQ_BUFS=cfg["DQ_BUFS"], CAUSAL=causal, DETERMINISTIC=deterministic,
                SPLIT_GROUP=split, **{flag: cfg[flag] for flag in SCHEDULE}, SOFTCAP=float(softcap),
                DROPOUT_P=float(dropout_p), DOCS=doc_bounds is not None,
                EXP2_ON_FMA=exp2.on_fma("gluon-bwd", D, softcap, dropout_p, q.dtype),
                **launch_options()), cache, ("gluon-bwd", *key))
    if split:
        launch(gluon_bwd_dkdv_kernel, (cdiv(n_k, DKDV_ROWS), B * h_kv), (*shares, dk, dv, *dk.stride(), H, h_kv, n_k,
                                                                           grad_scale),
               dict(HEAD_DIM=D, BLOCK_N=DKDV_ROWS, num_warps=4), cache, ("gluon-bwd-dkdv", *key))
    dq_scale = grad_scale * (softcap / scale if softcap > 0 else 1.0)   # the folded K's scale / c out
    launch(gluon_bwd_dq_kernel, (n_m, B * H), (dq_acc, dq, *dq.stride(), H, n_q, n_q_pad, dq_scale),
           dict(HEAD_DIM=D, BLOCK_M=block_m, num_warps=4), cache, ("gluon-bwd-dq", *key))
    return dq, dk, dv, rows[1].view(B, H, n_q_pad)[..., :n_q]   # Delta, for the sinks' gradient


def compile_aux_for_sm90(head_dim: int, dtype: torch.dtype = torch.bfloat16):
    """The prologue and epilogue kernels compiled for sm_90a without a GPU (integers unspecialised i32)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    dt = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    compiled = []
    for kernel, pointers in ((gluon_bwd_prep_kernel, dict(Out=dt, dOut=dt, Sem="i32", Ticket="i32")),
                             (gluon_bwd_dq_kernel, dict(dQ=dt)), (gluon_bwd_dkdv_kernel, dict(dK=dt, dV=dt))):
        signature = {}
        for name in kernel.arg_names:
            if name in ("HEAD_DIM", "BLOCK_M", "BLOCK_N"):
                signature[name] = "constexpr"
            elif name.startswith("stride_") or name.startswith("n_"):
                signature[name] = "i32"
            elif name == "sm_scale":
                signature[name] = "fp32"
            else:
                signature[name] = "*" + pointers.get(name, "fp32")
        consts = {name: value for name, value in (("HEAD_DIM", head_dim), ("BLOCK_M", TILES[head_dim]["BLOCK_M"]),
                                                  ("BLOCK_N", DKDV_ROWS)) if name in kernel.arg_names}
        compiled.append(triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts),
                                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}))
    return compiled
