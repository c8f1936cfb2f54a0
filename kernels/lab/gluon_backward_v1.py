"""The first Gluon backward (superseded by kernels/gluon/backward.py), kept to time beside it.

scripts/kernel_dev/gluon_bwd_check.py runs it as variant `v1` (`_launch` with DEFAULT_VARIANT, on
inputs the production kernel's checks accept); kernels/LOG.md and
benchmarks/gluon/gluon_bwd_h200_rounds.md have what it measured and why it was replaced.

The five matmuls in one kernel.

With S = scale * Q K^T, P = softmax(S) and O = P V, the gradients are (kernels/flash_bwd.py)

    dV = P^T dO        dP = dO V^T        dS = P * (dP - Delta),  Delta_i = rowsum(dO_i * O_i)
    dK = scale * dS^T Q                    dQ = scale * dS K

and P is recomputed tile by tile from the forward's log-sum-exp L: P = exp2(S log2(e) - L log2(e)).

Work split (FlashAttention-3's): one program owns BLOCK_N keys of one (batch, KV head). It keeps
their K and V tiles in shared memory and their dK, dV accumulators in registers while it streams,
for every query head of the GQA group, every query tile that sees any of those keys:

    S^T  = K Q^T       (BLOCK_N x BLOCK_M; keys on the rows, so that dV and dK are plain products)
    dP^T = V dO^T
    P^T  = exp2(S^T * scale * log2(e) - L2)        L2 = L * log2(e), +inf for rows that see no key
    dV  += P^T dO      (P^T straight from the accumulator registers as the A operand)
    dS^T = P^T * (dP^T - Delta)
    dK  += dS^T Q      (A from registers)
    dQ_j = dS K        (dS^T through shared memory, read transposed as the A operand)

All five are wgmma (`warpgroup_mma`), issued asynchronously and waited on in the order the next
step needs them. Causal tiles that some key/query pair of cannot see (the diagonal), and every
tile of a ragged last key tile, run a masked copy of the step; fully visible tiles run unmasked,
in a separate loop. Query rows past Nq need no mask: TMA zero-fills their Q and dO, and the
padded L2 (+inf) and Delta (0) make their P and dS exactly 0.

Tiles (per head dim, `_CONFIGS`): BLOCK_N = 128 keys over two consumer warpgroups (8 warps,
64 key rows each), BLOCK_M = 64 queries per step, head dims 64 and 128.

Pipeline. `gluon_bwd_prep_kernel` (Triton, one program per query tile) first writes Delta and
L2 into padded (B*H, Nq_pad) float32 rows that TMA can load, zeroes the float32 dQ accumulator
and the per-query-tile counters. The main kernel loads K and V once, then Q, dO, L2 and Delta
tiles through a STAGES-deep ring of shared-memory buffers, each with a `ready` mbarrier that TMA
completes (expect-tx bytes) and, warp-specialised, an `empty` mbarrier the consumers arrive on
once their wgmmas have read the stage. Two ways to run it:

- WARP_SPECIALIZE=False: one partition of 8 warps issues step i + STAGES - 1's loads itself,
  before computing step i, into the stage step i - 1 freed.
- WARP_SPECIALIZE=True (`gl.warp_specialize`): the default partition (8 warps, two consumer
  warpgroups) computes; a 1-warp producer partition issues every TMA load, waiting on `empty`;
  with DQ_WRITER also a dQ-writer partition (DQ_WARPS warps) that takes each step's dQ tile from
  shared memory (`dq_ready` / `dq_empty` mbarriers, DQ_BUFS deep) and adds it to global memory,
  so that the consumers never wait on another program. DEFAULT_VARIANT (2 writer warps, 2
  buffers) was the fastest measured; kernels/LOG.md has the numbers and what bounds them.

Per step the consumers synchronise twice across both warpgroups (CTA barriers): once after
storing dS^T (dQ = dS K reads both warpgroups' rows), once when the step is done (then one thread
releases the ring stage and the dQ buffer). L2 and Delta are read from their TMA buffers straight
into the layout the scores have (LSE_DIRECT; the alternative loads and converts them).

dQ in a fixed order (DETERMINISTIC, the default). Query tile m of head h gets one dQ share from
every key tile that sees it: key tiles 0..c(m) of its KV head (c(m), the last one, is the causal
diagonal; Nk / BLOCK_N - 1 without a mask). They are added into the float32 accumulator in
DESCENDING key-tile order: counter[b, h, m] counts the shares added so far, and key tile n spins
(thread 0, `ld.acquire`) until it reads c(m) - n, adds its share with relaxed float32 atomics
(one at a time per address, so each sum is formed in the same order every run), and releases
(`bar.sync`, then thread 0's `atom.release` add of 1). Key tile 0 is always last: it reads the
sum, adds its own share, scales and writes dQ in the input dtype, so no conversion pass follows.
Why descending: under a causal mask key tile n+1 starts two query tiles further down the
diagonal than key tile n and so runs ahead of it; its share is ready before n needs to follow.
Why it cannot deadlock: programs take their (head, key tile) from an atomic ticket, in order of
descending key tile within each KV head, so a program only ever waits on programs that took
their tickets earlier, which are running or done; the oldest unfinished one waits on nobody.
Memory stays O(N * D): the accumulator is (B*H, Nq_pad, D) float32, the counters one int32 per
query tile. DETERMINISTIC=False skips the waiting; the program whose add brings the counter to
c(m) + 1 writes dQ (the additions' order, and so dQ's last bits, then vary run to run).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels.gluon import compat, tma_refusal
from kernels.gluon.backward import _acc_layout
from kernels.tiles import LOG2E

# Per head dim: BLOCK_M query rows per step, BLOCK_N keys per program, STAGES of the Q/dO ring.
# Shared memory per program at D = 128: K, V 2 x 32 KB, the ring 32 KB a stage, dS^T 16 KB and
# (dQ writer) 32 KB a dQ buffer, of Hopper's 227 KB.
_CONFIGS = {64: dict(BLOCK_M=64, BLOCK_N=128, STAGES=3), 128: dict(BLOCK_M=64, BLOCK_N=128, STAGES=2)}
NUM_WARPS = 8          # the consumer warpgroups (two of four warps)


# ---- the prep pass (plain Triton: no tensor cores, nothing to specialise) -----------------------

@triton.jit
def gluon_bwd_prep_kernel(Out, dOut, Lse, Delta, Lse2, DQacc, dQ, Sem, Ticket,
                          stride_ob, stride_on, stride_oh, stride_od,
                          stride_dob, stride_don, stride_doh, stride_dod,
                          n_heads, n_q, n_k, n_q_pad,
                          HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """One (query tile, batch x head) program: Delta and L2 rows (padded rows 0 and +inf), the
    tile's zeroed dQ accumulator and counter, and, for a causal tile that sees no key at all,
    its zero dQ (no key tile will visit it). Program (0, 0) resets the ticket counter."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    start_m = pid_m * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM)
    in_q = (rows < n_q)[:, None]
    o = tl.load(Out + b * stride_ob + h * stride_oh + rows[:, None] * stride_on + cols[None, :] * stride_od,
                mask=in_q, other=0.0)
    do = tl.load(dOut + b * stride_dob + h * stride_doh + rows[:, None] * stride_don + cols[None, :] * stride_dod,
                 mask=in_q, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse = tl.load(Lse + pid_bh.to(tl.int64) * n_q + rows, mask=rows < n_q, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    row0 = pid_bh.to(tl.int64) * n_q_pad + start_m
    tl.store(Delta + row0 + tl.arange(0, BLOCK_M), delta)
    tl.store(Lse2 + row0 + tl.arange(0, BLOCK_M), lse2)
    zeros = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    tl.store(DQacc + row0 * HEAD_DIM + tl.arange(0, BLOCK_M)[:, None] * HEAD_DIM + cols[None, :], zeros)
    tl.store(Sem + pid_bh * tl.num_programs(0) + pid_m, 0)
    if pid_m + pid_bh == 0:
        tl.store(Ticket, 0)
    if CAUSAL:
        if tl.minimum(start_m + BLOCK_M, n_q) - 1 + n_k - n_q < 0:
            tl.store(dQ + ((b * n_q + rows[:, None]) * n_heads + h) * HEAD_DIM + cols[None, :],
                     zeros.to(dQ.dtype.element_ty), mask=in_q)


# ---- the main kernel ------------------------------------------------------------------------

@gluon.constexpr_function
def _rows_layout(cols, num_warps):
    """A plain layout for (rows x cols) float32 chunks: 4 consecutive columns per thread."""
    across = min(32, cols // 4)
    return gl.BlockedLayout([1, 4], [32 // across, across], [num_warps, 1], [1, 0])


@gluon.jit
def _row_vector(buf, parent: gl.constexpr, DIRECT: gl.constexpr):
    """A [1, BLOCK_M] float32 row in shared memory as a vector to broadcast across `parent`'s rows.
    DIRECT: every thread reads the columns it holds straight from shared memory (the unswizzled TMA
    row viewed as 1-D); otherwise a plain load and a layout conversion (through shared memory,
    with its barriers)."""
    if DIRECT:
        flat = compat.smem_reinterpret(buf, gl.float32, [buf.shape[1]], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        return flat.load(gl.SliceLayout(0, parent))
    else:
        row = buf.load(gl.BlockedLayout([1, 1], [1, 32], [1, gl.num_warps()], [1, 0]))
        return gl.convert_layout(gl.sum(row, axis=0), gl.SliceLayout(0, parent))


@gluon.jit
def _tile_grads(k_s, v_s, q_s, do_s, lse_s, delta_s, ds_s, dk, dv, start_n, start_m, n_q, n_k, qk_scale,
                CAUSAL: gl.constexpr, MASK: gl.constexpr, LSE_DIRECT: gl.constexpr):
    """One (key tile, query tile) step: accumulate dK and dV, return this key tile's dQ share
    (unscaled, float32). Every wgmma of the step has completed when it returns."""
    BLOCK_N: gl.constexpr = k_s.shape[0]
    HEAD_DIM: gl.constexpr = k_s.shape[1]
    BLOCK_M: gl.constexpr = q_s.shape[0]
    NW: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = _acc_layout(BLOCK_N, BLOCK_M, NW)
    kv_layout: gl.constexpr = _acc_layout(BLOCK_N, HEAD_DIM, NW)
    q_layout: gl.constexpr = _acc_layout(BLOCK_M, HEAD_DIM, NW)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)

    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    s_t = warpgroup_mma(k_s, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    dp_t = warpgroup_mma(v_s, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    lse = _row_vector(lse_s, s_layout, LSE_DIRECT)
    delta = _row_vector(delta_s, s_layout, LSE_DIRECT)
    s_t = warpgroup_mma_wait(1, deps=(s_t,))
    p_t = gl.exp2(s_t * qk_scale - lse[None, :])
    if MASK:  # key j of query i: j < n_k, and causal j <= i + n_k - n_q (aligned bottom-right)
        keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        queries = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        seen = (keys[:, None] < n_k) & (queries[None, :] >= 0)
        if CAUSAL:
            seen = seen & (keys[:, None] <= queries[None, :] + (n_k - n_q))
        p_t = gl.where(seen, p_t, 0.0)
    # A operands from registers are read while the wgmma runs: they stay in the final wait's deps
    p_op = gl.convert_layout(p_t.to(k_s.dtype), a_layout)
    dv = warpgroup_mma(p_op, do_s, dv, is_async=True)
    dp_t = warpgroup_mma_wait(1, deps=(dp_t,))
    ds_t = (p_t * (dp_t - delta[None, :])).to(k_s.dtype)
    ds_op = gl.convert_layout(ds_t, a_layout)
    dk = warpgroup_mma(ds_op, q_s, dk, is_async=True)
    ds_s.store(ds_t)
    fence_async_shared()
    compat.thread_barrier()   # both warpgroups' rows of dS^T are in place: dS K reads all of them
    dq = warpgroup_mma(ds_s.permute((1, 0)), k_s, gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, q_layout),
                       use_acc=False, is_async=True)
    dq, dk, dv, p_op, ds_op = warpgroup_mma_wait(0, deps=(dq, dk, dv, p_op, ds_op))
    return dk, dv, dq


@gluon.jit
def _dq_target(start_m, pid_n, n_q, n_k, n_kt, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               CAUSAL: gl.constexpr):
    """(this key tile's rank among the dQ shares of query tile start_m, how many shares it gets).
    The shares come from key tiles c..0, c = the last key tile the query tile sees."""
    if CAUSAL:
        last_row = gl.minimum(start_m + BLOCK_M, n_q) - 1
        c = gl.minimum((last_row + n_k - n_q) // BLOCK_N, n_kt - 1)
    else:
        c = n_kt - 1
    return c - pid_n, c + 1


ADD = gl.constexpr(0)          # _dq_rows modes: atomically add this share to the accumulator
FINAL = gl.constexpr(1)        # write dQ = scale * (accumulator + this share)
FINAL_ADDED = gl.constexpr(2)  # write dQ = scale * accumulator (this share is in it already)


@gluon.jit
def _dq_rows(x, DQacc, dQ, acc_row0, out_row0, row0, rows_left, out_row_stride, scale, MODE: gl.constexpr):
    """Rows [row0, row0 + len(x)) of one query tile's dQ share x (float32, any layout).
    acc_row0 / out_row0: int64 element offsets of the tile's first row in the accumulator / dQ."""
    ROWS: gl.constexpr = x.shape[0]
    HEAD_DIM: gl.constexpr = x.shape[1]
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, x.type.layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, x.type.layout))
    acc = DQacc + acc_row0 + (rows[:, None] * HEAD_DIM + cols[None, :])
    if MODE == ADD:
        gl.atomic_add(acc, x, sem="relaxed")
    else:
        total = gl.load(acc)
        if MODE == FINAL:
            total = total + x
        gl.store(dQ + out_row0 + (rows[:, None] * out_row_stride + cols[None, :]), (total * scale).to(dQ.dtype.element_ty),
                 mask=(rows[:, None] < rows_left) & (cols[None, :] < HEAD_DIM))


@gluon.jit
def _dq_share(src, dq, DQacc, dQ, acc_row0, out_row0, rows_left, out_row_stride, scale,
              MODE: gl.constexpr, FROM_SMEM: gl.constexpr):
    """_dq_rows over a whole query tile: from registers (`dq`), or from shared memory (`src`) in
    chunks of rows small enough for a worker partition's registers (8 floats per thread)."""
    if FROM_SMEM:
        BLOCK_M: gl.constexpr = src.shape[0]
        HEAD_DIM: gl.constexpr = src.shape[1]
        CHUNK: gl.constexpr = min(BLOCK_M, max(4, 256 * gl.num_warps() // HEAD_DIM))   # >= the swizzle period
        gl.static_assert(BLOCK_M % CHUNK == 0, "dQ chunks must tile the query tile")
        for r in gl.static_range(0, BLOCK_M, CHUNK):
            x = src.slice(r, CHUNK).load(_rows_layout(HEAD_DIM, gl.num_warps()))
            _dq_rows(x, DQacc, dQ, acc_row0, out_row0, r, rows_left, out_row_stride, scale, MODE)
    else:
        _dq_rows(dq, DQacc, dQ, acc_row0, out_row0, 0, rows_left, out_row_stride, scale, MODE)


@gluon.jit
def _dq_wait(counter, rank):
    """Spin until `rank` shares are in (thread 0 polls with acquire; the others wait at its barrier)."""
    seen = gl.atomic_add(counter, 0, sem="acquire")
    while seen < rank:
        seen = gl.atomic_add(counter, 0, sem="acquire")


@gluon.jit
def _flush_dq(src, dq, DQacc, dQ, Sem, b, h, start_m, pid_n, n_heads, n_q, n_k, n_kt, n_q_pad, sm_scale,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
              DETERMINISTIC: gl.constexpr, FROM_SMEM: gl.constexpr):
    """Add this key tile's dQ share of query tile start_m of head h, in the order the module
    docstring gives (DETERMINISTIC), or in any order."""
    bh = b * n_heads + h
    counter = Sem + bh * gl.cdiv(n_q, BLOCK_M) + start_m // BLOCK_M
    acc_row0 = (bh.to(gl.int64) * n_q_pad + start_m) * HEAD_DIM
    out_row0 = ((b.to(gl.int64) * n_q + start_m) * n_heads + h) * HEAD_DIM
    rows_left = n_q - start_m
    out_stride = n_heads * HEAD_DIM
    rank, shares = _dq_target(start_m, pid_n, n_q, n_k, n_kt, BLOCK_M, BLOCK_N, CAUSAL)
    if DETERMINISTIC:
        _dq_wait(counter, rank)
        if pid_n == 0:   # the last share: key tile 0 sees every query that sees any key
            _dq_share(src, dq, DQacc, dQ, acc_row0, out_row0, rows_left, out_stride, sm_scale, FINAL, FROM_SMEM)
        else:
            _dq_share(src, dq, DQacc, dQ, acc_row0, out_row0, rows_left, out_stride, sm_scale, ADD, FROM_SMEM)
            compat.thread_barrier()       # every thread's adds precede thread 0's release
            gl.atomic_add(counter, 1, sem="release")
    else:
        _dq_share(src, dq, DQacc, dQ, acc_row0, out_row0, rows_left, out_stride, sm_scale, ADD, FROM_SMEM)
        compat.thread_barrier()
        arrived = gl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == shares - 1:         # the last to arrive has acquired every other share
            _dq_share(src, dq, DQacc, dQ, acc_row0, out_row0, rows_left, out_stride, sm_scale, FINAL_ADDED,
                      FROM_SMEM)


@gluon.jit
def _load_step(j, q_desc, do_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs, delta_bufs, ready,
               b, h0, lo, per_head, n_heads, pred):
    """Issue step j's TMA loads (Q, dO tiles; L2, Delta rows) into ring stage j % STAGES."""
    STAGES: gl.constexpr = q_bufs.shape[0]
    BLOCK_M: gl.constexpr = lse_bufs.shape[2]
    s = j % STAGES
    g = j // per_head
    start_m = (lo + j % per_head) * BLOCK_M
    h = h0 + g
    bar = ready.index(s)
    mbarrier.expect(bar, 2 * q_desc.block_type.nbytes + 2 * lse_desc.block_type.nbytes, pred=pred)
    compat.tma_load(q_desc, [b, start_m, h, 0], bar, q_bufs.index(s), pred=pred)
    compat.tma_load(do_desc, [b, start_m, h, 0], bar, do_bufs.index(s), pred=pred)
    compat.tma_load(lse_desc, [b * n_heads + h, start_m], bar, lse_bufs.index(s), pred=pred)
    compat.tma_load(delta_desc, [b * n_heads + h, start_m], bar, delta_bufs.index(s), pred=pred)


@gluon.jit
def _step(i, start_m, k_s, v_s, smem, bars, descs, dk, dv, work, scalars,
          CAUSAL: gl.constexpr, MASK: gl.constexpr, DETERMINISTIC: gl.constexpr,
          WARP_SPECIALIZE: gl.constexpr, DQ_WRITER: gl.constexpr, LSE_DIRECT: gl.constexpr):
    """Step i of the consumers: wait for its stage, compute, hand the stage and the dQ share on."""
    q_bufs, do_bufs, lse_bufs, delta_bufs, ds_s, dq_bufs = smem
    ready, empty, dq_ready, dq_empty = bars
    q_desc, do_desc, lse_desc, delta_desc, DQacc, dQ, Sem = descs
    b, h_kv, h0, pid_n, start_n, lo, per_head, total = work
    n_heads, n_q, n_k, n_kt, n_q_pad, qk_scale, sm_scale = scalars
    STAGES: gl.constexpr = q_bufs.shape[0]
    BLOCK_M: gl.constexpr = lse_bufs.shape[2]
    BLOCK_N: gl.constexpr = k_s.shape[0]
    HEAD_DIM: gl.constexpr = k_s.shape[1]
    s = i % STAGES
    if not WARP_SPECIALIZE:
        # step i - 1 freed stage (i - 1) % STAGES (all warps passed the barrier after it)
        fence_async_shared()
        nxt = i + STAGES - 1
        _load_step(nxt, q_desc, do_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs, delta_bufs, ready,
                   b, h0, lo, gl.maximum(per_head, 1), n_heads, nxt < total)
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    q_s = q_bufs.index(s).reshape([BLOCK_M, HEAD_DIM])
    do_s = do_bufs.index(s).reshape([BLOCK_M, HEAD_DIM])
    dk, dv, dq = _tile_grads(k_s, v_s, q_s, do_s, lse_bufs.index(s), delta_bufs.index(s), ds_s, dk, dv,
                             start_n, start_m, n_q, n_k, qk_scale, CAUSAL, MASK, LSE_DIRECT)
    h = h0 + (i // gl.maximum(per_head, 1))
    if DQ_WRITER:
        DQ_BUFS: gl.constexpr = dq_bufs.shape[0]
        jb = i % DQ_BUFS
        mbarrier.wait(dq_empty.index(jb), ((i // DQ_BUFS) & 1) ^ 1)
        dq_bufs.index(jb).store(dq)
    fence_async_shared()
    compat.thread_barrier()   # every warp is done with stage s, dS^T (and has stored its dQ rows)
    if WARP_SPECIALIZE:
        mbarrier.arrive(empty.index(s), count=1)
    if DQ_WRITER:
        mbarrier.arrive(dq_ready.index(i % dq_bufs.shape[0]), count=1)
    else:
        _flush_dq(ds_s, dq, DQacc, dQ, Sem, b, h, start_m, pid_n, n_heads, n_q, n_k, n_kt, n_q_pad, sm_scale,
                  BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, DETERMINISTIC, False)
    return dk, dv


@gluon.jit
def _consume(k_s, v_s, smem, bars, kv_bar, descs, work, scalars, mid, n_m, group,
             CAUSAL: gl.constexpr, DETERMINISTIC: gl.constexpr, WARP_SPECIALIZE: gl.constexpr,
             DQ_WRITER: gl.constexpr, LSE_DIRECT: gl.constexpr):
    """The consumers' loop: per query head of the group, the masked query tiles, then the unmasked
    ones. Returns dK (unscaled) and dV, float32."""
    BLOCK_M: gl.constexpr = smem[2].shape[2]
    BLOCK_N: gl.constexpr = k_s.shape[0]
    HEAD_DIM: gl.constexpr = k_s.shape[1]
    kv_layout: gl.constexpr = _acc_layout(BLOCK_N, HEAD_DIM, gl.num_warps())
    lo = work[5]
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    mbarrier.wait(kv_bar, 0)
    i = 0
    for g in range(group):
        for m in range(lo, mid):
            dk, dv = _step(i, m * BLOCK_M, k_s, v_s, smem, bars, descs, dk, dv, work, scalars,
                           CAUSAL, True, DETERMINISTIC, WARP_SPECIALIZE, DQ_WRITER, LSE_DIRECT)
            i += 1
        for m in range(mid, n_m):
            dk, dv = _step(i, m * BLOCK_M, k_s, v_s, smem, bars, descs, dk, dv, work, scalars,
                           CAUSAL, False, DETERMINISTIC, WARP_SPECIALIZE, DQ_WRITER, LSE_DIRECT)
            i += 1
    return dk, dv


@gluon.jit
def _load_partition(k_s4, v_s4, smem, bars, kv_bar, descs, work, scalars,
                    CAUSAL: gl.constexpr, DETERMINISTIC: gl.constexpr):
    """The TMA producer (one warp): K and V once, then every step's Q, dO, L2 and Delta."""
    q_bufs, do_bufs, lse_bufs, delta_bufs, ds_s, dq_bufs = smem
    ready, empty, dq_ready, dq_empty = bars
    q_desc, do_desc, lse_desc, delta_desc, DQacc, dQ, Sem, k_desc, v_desc = descs
    b, h_kv, h0, pid_n, start_n, lo, per_head, total = work
    n_heads = scalars[0]
    STAGES: gl.constexpr = q_bufs.shape[0]
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    compat.tma_load(k_desc, [b, start_n, h_kv, 0], kv_bar, k_s4)
    compat.tma_load(v_desc, [b, start_n, h_kv, 0], kv_bar, v_s4)
    for j in range(total):
        mbarrier.wait(empty.index(j % STAGES), ((j // STAGES) & 1) ^ 1)
        _load_step(j, q_desc, do_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs, delta_bufs, ready,
                   b, h0, lo, per_head, n_heads, True)


@gluon.jit
def _dq_partition(k_s4, v_s4, smem, bars, kv_bar, descs, work, scalars,
                  CAUSAL: gl.constexpr, DETERMINISTIC: gl.constexpr):
    """The dQ writer: each step's share from shared memory into the accumulator, in order."""
    q_bufs, do_bufs, lse_bufs, delta_bufs, ds_s, dq_bufs = smem
    ready, empty, dq_ready, dq_empty = bars
    q_desc, do_desc, lse_desc, delta_desc, DQacc, dQ, Sem, k_desc, v_desc = descs
    b, h_kv, h0, pid_n, start_n, lo, per_head, total = work
    n_heads, n_q, n_k, n_kt, n_q_pad, qk_scale, sm_scale = scalars
    BLOCK_M: gl.constexpr = lse_bufs.shape[2]
    BLOCK_N: gl.constexpr = ds_s.shape[0]
    HEAD_DIM: gl.constexpr = dq_bufs.shape[2]
    DQ_BUFS: gl.constexpr = dq_bufs.shape[0]
    for j in range(total):
        jb = j % DQ_BUFS
        mbarrier.wait(dq_ready.index(jb), (j // DQ_BUFS) & 1)
        h = h0 + j // per_head
        start_m = (lo + j % per_head) * BLOCK_M
        _flush_dq(dq_bufs.index(jb), None, DQacc, dQ, Sem, b, h, start_m, pid_n, n_heads, n_q, n_k, n_kt, n_q_pad,
                  sm_scale, BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, DETERMINISTIC, True)
        compat.thread_barrier()   # all of this partition's reads of the buffer are done
        mbarrier.arrive(dq_empty.index(jb), count=1)


@gluon.jit
def _work_item(Ticket, n_heads, n_kv_heads, n_q, n_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               CAUSAL: gl.constexpr):
    """This program's key tile, from a ticket (KV heads in order, key tiles in descending order
    within each), and the query tiles it visits: [lo, mid) masked, [mid, n_m) unmasked (causal:
    [lo, n_m) are those seeing any key), per query head of its GQA group."""
    n_kt = gl.cdiv(n_k, BLOCK_N)
    ticket = gl.atomic_add(Ticket, 1, sem="relaxed")
    bh_kv = ticket // n_kt
    pid_n = n_kt - 1 - ticket % n_kt
    b = bh_kv // n_kv_heads
    h_kv = bh_kv % n_kv_heads
    group = n_heads // n_kv_heads
    h0 = h_kv * group
    start_n = pid_n * BLOCK_N
    n_m = gl.cdiv(n_q, BLOCK_M)
    if CAUSAL:
        shift = n_k - n_q
        lo = gl.maximum(start_n - shift, 0) // BLOCK_M
        mid = gl.maximum(gl.cdiv(gl.maximum(start_n + BLOCK_N - 1 - shift, 0), BLOCK_M), lo)
        mid = gl.minimum(mid, n_m)
    else:
        lo = n_m * 0
        mid = n_m * 0
    if start_n + BLOCK_N > n_k:   # ragged last key tile: mask the keys past n_k everywhere
        mid = n_m
    per_head = n_m - lo
    return n_kt, n_m, b, h_kv, group, h0, pid_n, start_n, lo, mid, per_head, group * per_head


@gluon.jit
def _allocate(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc,
              STAGES: gl.constexpr, DQ_WRITER: gl.constexpr, DQ_BUFS: gl.constexpr):
    """Shared memory (the K and V tiles, the STAGES-deep ring of Q, dO, L2 and Delta, dS^T, the dQ
    buffers) and the mbarriers, initialised."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[3]
    dtype: gl.constexpr = k_desc.dtype
    blk_layout: gl.constexpr = q_desc.layout
    k_s4 = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_s4 = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, blk_layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + delta_desc.block_type.shape, delta_desc.layout)
    ds_s = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype))
    if DQ_WRITER:
        # 32-byte chunks XOR-swizzled by row % 4: the accumulator layout's stores (8 rows x 32 bytes
        # per warp instruction) hit 4 bank groups instead of one
        dq_bufs = gl.allocate_shared_memory(gl.float32, [DQ_BUFS, BLOCK_M, HEAD_DIM],
                                            gl.SwizzledSharedLayout(8, 1, 4, order=[1, 0]))
    else:
        dq_bufs = ds_s
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    dq_ready = gl.allocate_shared_memory(gl.int64, [DQ_BUFS, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_BUFS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    for s in gl.static_range(DQ_BUFS):
        mbarrier.init(dq_ready.index(s), count=1)
        mbarrier.init(dq_empty.index(s), count=1)
    return k_s4, v_s4, (q_bufs, do_bufs, lse_bufs, delta_bufs, ds_s, dq_bufs), (ready, empty, dq_ready, dq_empty), kv_bar


@gluon.jit
def _prefetch(k_desc, v_desc, k_s4, v_s4, kv_bar, q_desc, do_desc, lse_desc, delta_desc, smem, bars,
              b, h_kv, h0, start_n, lo, per_head, total, n_heads):
    """Without warp specialisation: the K and V tiles' loads, then the first STAGES - 1 steps'."""
    q_bufs, do_bufs, lse_bufs, delta_bufs, ds_s, dq_bufs = smem
    ready = bars[0]
    STAGES: gl.constexpr = q_bufs.shape[0]
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    compat.tma_load(k_desc, [b, start_n, h_kv, 0], kv_bar, k_s4)
    compat.tma_load(v_desc, [b, start_n, h_kv, 0], kv_bar, v_s4)
    for j in gl.static_range(STAGES - 1):
        _load_step(j, q_desc, do_desc, lse_desc, delta_desc, q_bufs, do_bufs, lse_bufs, delta_bufs, ready,
                   b, h0, lo, gl.maximum(per_head, 1), n_heads, j < total)


@gluon.jit
def _store_dk_dv(dk_desc, dv_desc, k_s, v_s, k_s4, v_s4, dk, dv, sm_scale, b, start_n, h_kv):
    """Epilogue: dK = scale * dS^T Q and dV through the K and V buffers (every wgmma that read them
    is done) to TMA stores, which drop the rows past n_k of a ragged last tile."""
    dtype: gl.constexpr = dk_desc.dtype
    compat.thread_barrier()
    k_s.store((dk * sm_scale).to(dtype))
    v_s.store(dv.to(dtype))
    fence_async_shared()
    compat.thread_barrier()
    compat.tma_store(dk_desc, [b, start_n, h_kv, 0], k_s4)
    compat.tma_store(dv_desc, [b, start_n, h_kv, 0], v_s4)
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["n_heads", "n_kv_heads", "n_q", "n_k", "n_q_pad"])
def gluon_bwd_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_desc, delta_desc,
                     DQacc, dQ, Sem, Ticket,
                     n_heads, n_kv_heads, n_q, n_k, n_q_pad, qk_scale, sm_scale,
                     STAGES: gl.constexpr, CAUSAL: gl.constexpr, DETERMINISTIC: gl.constexpr,
                     WARP_SPECIALIZE: gl.constexpr, DQ_WRITER: gl.constexpr, DQ_BUFS: gl.constexpr,
                     DQ_WARPS: gl.constexpr, LSE_DIRECT: gl.constexpr):
    """Grid: (cdiv(Nk, BLOCK_N) * B * Hkv,). Descriptors: q/do (B, Nq, H, D) and k/v/dk/dv
    (B, Nk, Hkv, D) in blocks [1, rows, 1, D]; L2 and Delta (B*H, Nq_pad) in blocks [1, BLOCK_M]."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[3]
    gl.static_assert(HEAD_DIM % 16 == 0 and HEAD_DIM <= 256, "wgmma takes head dims in steps of 16")
    gl.static_assert(BLOCK_N == 16 * gl.num_warps(), "each consumer warp owns 16 key rows")
    gl.static_assert(BLOCK_M % 64 == 0 and BLOCK_M <= 128, "query tiles of 64 or 128 rows")
    gl.static_assert(BLOCK_N % BLOCK_M == 0, "a key tile spans whole query tiles")
    gl.static_assert(STAGES >= 2, "the ring needs a stage to fill while one is read")
    gl.static_assert(not DQ_WRITER or WARP_SPECIALIZE, "the dQ writer is a partition of its own")
    n_kt, n_m, b, h_kv, group, h0, pid_n, start_n, lo, mid, per_head, total = _work_item(
        Ticket, n_heads, n_kv_heads, n_q, n_k, BLOCK_M, BLOCK_N, CAUSAL)
    k_s4, v_s4, smem, bars, kv_bar = _allocate(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc,
                                               STAGES, DQ_WRITER, DQ_BUFS)
    k_s = k_s4.reshape([BLOCK_N, HEAD_DIM])
    v_s = v_s4.reshape([BLOCK_N, HEAD_DIM])

    descs = (q_desc, do_desc, lse_desc, delta_desc, DQacc, dQ, Sem)
    work = (b, h_kv, h0, pid_n, start_n, lo, per_head, total)
    scalars = (n_heads, n_q, n_k, n_kt, n_q_pad, qk_scale, sm_scale)
    if WARP_SPECIALIZE:
        # (tuples built inline: a tuple assigned to a name first turns its constexprs into tensors)
        wdescs = descs + (k_desc, v_desc)
        if DQ_WRITER:
            dk, dv = gl.warp_specialize([
                (_consume, (k_s, v_s, smem, bars, kv_bar, descs, work, scalars, mid, n_m, group,
                            CAUSAL, DETERMINISTIC, WARP_SPECIALIZE, DQ_WRITER, LSE_DIRECT)),
                (_load_partition, (k_s4, v_s4, smem, bars, kv_bar, wdescs, work, scalars, CAUSAL, DETERMINISTIC)),
                (_dq_partition, (k_s4, v_s4, smem, bars, kv_bar, wdescs, work, scalars, CAUSAL, DETERMINISTIC)),
            ], [1, DQ_WARPS], [56, 56])   # one warpgroup: one register count
        else:
            dk, dv = gl.warp_specialize([
                (_consume, (k_s, v_s, smem, bars, kv_bar, descs, work, scalars, mid, n_m, group,
                            CAUSAL, DETERMINISTIC, WARP_SPECIALIZE, DQ_WRITER, LSE_DIRECT)),
                (_load_partition, (k_s4, v_s4, smem, bars, kv_bar, wdescs, work, scalars, CAUSAL, DETERMINISTIC)),
            ], [1], [24])
    else:
        _prefetch(k_desc, v_desc, k_s4, v_s4, kv_bar, q_desc, do_desc, lse_desc, delta_desc, smem, bars,
                  b, h_kv, h0, start_n, lo, per_head, total, n_heads)
        dk, dv = _consume(k_s, v_s, smem, bars, kv_bar, descs, work, scalars, mid, n_m, group,
                          CAUSAL, DETERMINISTIC, WARP_SPECIALIZE, DQ_WRITER, LSE_DIRECT)

    _store_dk_dv(dk_desc, dv_desc, k_s, v_s, k_s4, v_s4, dk, dv, sm_scale, b, start_n, h_kv)


# ---- host side ------------------------------------------------------------------------------

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
_SIG_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _tile_layouts(dtype: torch.dtype, block_m: int, block_n: int, head_dim: int):
    """Shared-memory layouts of the TMA blocks: (query/dO tile, key/value tile, L2/Delta row)."""
    gdt = _GL_DTYPES[dtype]
    return (gl.NVMMASharedLayout.get_default_for([1, block_m, 1, head_dim], gdt),
            gl.NVMMASharedLayout.get_default_for([1, block_n, 1, head_dim], gdt),
            gl.NVMMASharedLayout.get_default_for([1, block_m], gl.float32))


def _variant_consts(warp_specialize: bool, dq_writer: bool, dq_bufs: int = 1, dq_warps: int = 1,
                    lse_direct: bool = True) -> dict:
    return dict(WARP_SPECIALIZE=warp_specialize, DQ_WRITER=dq_writer, DQ_BUFS=dq_bufs, DQ_WARPS=dq_warps,
                LSE_DIRECT=lse_direct)


def _launch_options(warp_specialize: bool, dq_writer: bool, dq_warps: int) -> dict:
    """num_warps, and with worker partitions the per-thread register cap the 64K registers of
    an SM allow for every warp (the compiler then moves registers from the workers to the
    consumers)."""
    if not warp_specialize:
        return {"num_warps": NUM_WARPS}
    warps = NUM_WARPS + 1 + (dq_warps if dq_writer else 0)
    warps = -(-warps // 4) * 4
    return {"num_warps": NUM_WARPS, "maxnreg": min(255, 65536 // (32 * warps)) // 8 * 8}


def compile_for_sm90(head_dim: int, dtype: torch.dtype = torch.bfloat16, causal: bool = True,
                     deterministic: bool = True, warp_specialize: bool = True, dq_writer: bool = False,
                     dq_bufs: int = 1, dq_warps: int = 1, lse_direct: bool = True, config: dict | None = None):
    """The main kernel compiled for sm_90a without a GPU (a launch's signature: descriptors, the
    pointers 16-byte aligned): CI checks it compiles, and kernel reports read its registers."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = dict(_CONFIGS[head_dim], **(config or {}))
    qlay, klay, llay = _tile_layouts(dtype, cfg["BLOCK_M"], cfg["BLOCK_N"], head_dim)
    dt = _SIG_DTYPES[dtype]

    def desc(block, layout, ty=dt):
        return f"tensordesc<{ty}{list(block)},{layout!r}>"

    q_block, k_block, l_block = [1, cfg["BLOCK_M"], 1, head_dim], [1, cfg["BLOCK_N"], 1, head_dim], [1, cfg["BLOCK_M"]]
    signature = {"q_desc": desc(q_block, qlay), "k_desc": desc(k_block, klay), "v_desc": desc(k_block, klay),
                 "do_desc": desc(q_block, qlay), "dk_desc": desc(k_block, klay), "dv_desc": desc(k_block, klay),
                 "lse_desc": desc(l_block, llay, "fp32"), "delta_desc": desc(l_block, llay, "fp32"),
                 "DQacc": "*fp32", "dQ": f"*{dt}", "Sem": "*i32", "Ticket": "*i32",
                 "n_heads": "i32", "n_kv_heads": "i32", "n_q": "i32", "n_k": "i32", "n_q_pad": "i32",
                 "qk_scale": "fp32", "sm_scale": "fp32"}
    consts = dict(STAGES=cfg["STAGES"], CAUSAL=causal, DETERMINISTIC=deterministic,
                  **_variant_consts(warp_specialize, dq_writer, dq_bufs, dq_warps, lse_direct))
    signature.update({name: "constexpr" for name in consts})
    names = list(gluon_bwd_kernel.arg_names)
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in ("DQacc", "dQ", "Sem", "Ticket")}
    source = GluonASTSource(fn=gluon_bwd_kernel, signature={n: signature[n] for n in names}, constexprs=consts,
                            attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=_launch_options(warp_specialize, dq_writer, dq_warps))


# How the main kernel runs by default: warp-specialised, a TMA producer warp and a 2-warp dQ writer
# with two hand-off buffers, the fastest variant on the H200 at every measured shape
# (benchmarks/gluon/gluon_bwd_h200_rounds.md; kernels/LOG.md has why it was short of cuDNN).
DEFAULT_VARIANT = dict(warp_specialize=True, dq_writer=True, dq_bufs=2, dq_warps=2)


def _launch(dout, q, k, v, out, lse, causal: bool, scale: float, deterministic: bool, warp_specialize: bool,
            dq_writer: bool, dq_bufs: int = 1, dq_warps: int = 1, lse_direct: bool = True,
            config: dict | None = None):
    """The two launches (prep, main) on checked inputs; the variant arguments pick how the main
    kernel is built (the benchmarks compare them)."""
    B, n_q, H, D = q.shape
    n_k, h_kv = k.shape[1], k.shape[2]
    cfg = dict(_CONFIGS[D], **(config or {}))
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    n_m = triton.cdiv(n_q, block_m)
    n_q_pad = n_m * block_m
    if tma_refusal("dout", dout):   # autograd's incoming gradient may be any layout: one copy then
        dout = dout.contiguous()
    lse = lse.contiguous()
    dev = q.device
    rows = torch.empty((2, B * H, n_q_pad), dtype=torch.float32, device=dev)   # L2, Delta
    lse2, delta = rows[0], rows[1]
    dq_acc = torch.empty((B * H * n_q_pad, D), dtype=torch.float32, device=dev)
    n_sem = triton.cdiv(B * H * n_m, 4) * 4
    counters = torch.empty(n_sem + 4, dtype=torch.int32, device=dev)
    sem, ticket = counters[:n_sem], counters[n_sem:n_sem + 1]
    dq = torch.empty((B, n_q, H, D), dtype=q.dtype, device=dev)
    dk = torch.empty((B, n_k, h_kv, D), dtype=k.dtype, device=dev)
    dv = torch.empty((B, n_k, h_kv, D), dtype=v.dtype, device=dev)

    gluon_bwd_prep_kernel[(n_m, B * H)](
        out, dout, lse, delta, lse2, dq_acc, dq, sem, ticket, *out.stride(), *dout.stride(),
        H, n_q, n_k, n_q_pad, HEAD_DIM=D, BLOCK_M=block_m, CAUSAL=causal, num_warps=4)

    qlay, klay, llay = _tile_layouts(q.dtype, block_m, block_n, D)
    q_block, k_block = [1, block_m, 1, D], [1, block_n, 1, D]

    def desc(t, block, layout):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)

    grid = (triton.cdiv(n_k, block_n) * B * h_kv,)
    gluon_bwd_kernel[grid](
        desc(q, q_block, qlay), desc(k, k_block, klay), desc(v, k_block, klay), desc(dout, q_block, qlay),
        desc(dk, k_block, klay), desc(dv, k_block, klay), desc(lse2, [1, block_m], llay),
        desc(delta, [1, block_m], llay), dq_acc, dq, sem, ticket,
        H, h_kv, n_q, n_k, n_q_pad, scale * 1.4426950408889634, scale,
        STAGES=cfg["STAGES"], CAUSAL=causal, DETERMINISTIC=deterministic,
        **_variant_consts(warp_specialize, dq_writer, dq_bufs, dq_warps, lse_direct),
        **_launch_options(warp_specialize, dq_writer, dq_warps))
    return dq, dk, dv
