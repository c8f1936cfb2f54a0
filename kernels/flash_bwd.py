"""FlashAttention backward: gradients from the saved log-sum-exp, tile by tile.

With P = softmax(S), S = scale * Q K^T and O = P V, the gradients are

    dV = P^T dO
    dP = dO V^T
    dS = P * (dP - Delta),     Delta_i = rowsum(dO_i * O_i)   (= rowsum(P_i * dP_i))
    dQ = scale * dS K
    dK = scale * dS^T Q

Nothing of size N x N is stored: P is recomputed per tile as exp(S - L) from the
forward's per-row log-sum-exp L, which is exact (it is the final normaliser, so no
online rescaling is needed here).

Deterministic (the default): two kernels, so that every gradient element has exactly one
writer, with no atomics, and therefore gradients are bit-identical run to run:

- `flash_bwd_q_kernel` (launched first): one program owns BLOCK_M queries of one head,
  computes their Delta from its O and dO tiles and stores it, and streams the key tiles
  they can see, accumulating dQ (the forward's loop, run again);
- `flash_bwd_kv_kernel`: one program owns BLOCK_N keys of one KV head, keeps dK and dV
  for them in registers, and streams every query tile that can see those keys, for
  every query head of the GQA group, so dK and dV arrive already summed over the group.

The cost of determinism is recomputing S and dP in the second kernel (7 tile matmuls
instead of 5). Non-deterministic: `flash_bwd_kv_dq_kernel` is the dK/dV kernel that also
adds each tile's dQ share, dS^T K, into a float32 dQ with atomics (5 matmuls, one
launch after the small `flash_bwd_delta_kernel`); the order of those additions varies
from run to run, so dQ's last bits do. Masking follows the forward: tiles that are fully visible and in bounds
run unmasked; the causal diagonal and ragged edges are masked. With documents or a
window, the dQ kernel visits the forward's key range, and the dK/dV kernel the query
tiles that see any of its keys (from its first and last key: `query_ranges`); the
other tiles are skipped, so the backward's cost follows the mask as the forward's does.

Score options (kernels/scores.py), recomputed per tile like P: soft-capping recomputes the capped
scores and multiplies dS by the cap's derivative 1 - tanh^2; dropout regenerates the forward's mask
from the call's seed, so that dP is 0 where a probability was dropped and scaled by 1 / (1 - p)
where kept, and dV sums only the kept probabilities (scaled in the epilogue). Delta = rowsum(dO * O)
still holds with both. Sinks change nothing here: P = exp(S - L) with the sink inside L.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.scores import dropout_keep, dropout_seed_of, softcap_scores
from kernels.tiles import (LOG2E, key_ranges, load_tile, mask_row, query_program, query_ranges, row_key_bounds, stage_range,
                           store_tile, tile_offsets, visible)
from kernels.tuning import (bwd_kv_configs, bwd_kv_dq_configs, bwd_kv_dq_prune, bwd_kv_prune, bwd_q_configs,
                            bwd_q_prune, persistent)


@triton.jit
def _tile_and_head(n_heads, BLOCK: tl.constexpr):
    """(first row of the program's tile, batch, head) in a (cdiv(rows, BLOCK), B * n_heads) grid;
    batch and head in int64 for addressing."""
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    return pid * BLOCK, b, h


@triton.jit
def flash_bwd_delta_kernel(
    Out, dOut, Delta,
    stride_ob, stride_on, stride_oh, stride_od,
    stride_db, stride_dn, stride_dh, stride_dd,
    n_heads, n_q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Delta[b, h, i] = sum_d O[b, i, h, d] * dO[b, i, h, d], in float32 (before the atomic
    backward; the deterministic one computes it in flash_bwd_q_kernel)."""
    tl.static_assert(BLOCK_D >= HEAD_DIM, "BLOCK_D is the head dim padded to a power of two")
    start_m, b, h = _tile_and_head(n_heads, BLOCK_M)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    o = load_tile(Out + b * stride_ob + h * stride_oh, start_m, stride_on,
                  tile_offsets(rows, cols, stride_on, stride_od), rows, n_q, cols, HEAD_DIM, BLOCK_D, True)
    do = load_tile(dOut + b * stride_db + h * stride_dh, start_m, stride_dn,
                   tile_offsets(rows, cols, stride_dn, stride_dd), rows, n_q, cols, HEAD_DIM, BLOCK_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    offs_m = start_m + rows
    tl.store(Delta + (b * n_heads + h) * n_q + offs_m, delta, mask=offs_m < n_q)


@triton.jit
def _lse_log2(lse):
    """The forward's natural-log L in the exp2 domain of the recomputed scores. Rows that
    saw no key have L = -inf; +inf makes their P = exp2(S - L) exactly 0 instead of NaN."""
    return tl.where(lse == float("-inf"), float("inf"), lse) * LOG2E


@triton.jit
def _bwd_kv_tile(dk, dv, k, v, Q_bh, dO_bh, Lse_bh, Delta_bh, Docs_b, dQ_bh, q_offs, do_offs, dq_offs,
                 stride_qn, stride_don, stride_dqn,
                 start_m, rows_m, start_n, offs_n, offs_d, n_q, n_k, window, qk_scale, sm_scale, seed, offset, bh,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                 DOCS: tl.constexpr, WINDOW: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr,
                 DQ_ATOMIC: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT_P: tl.constexpr):
    """Add queries [start_m, start_m + BLOCK_M)'s contribution to this program's dK, dV
    (and with DQ_ATOMIC, this key tile's share of their dQ, atomically, into float32 dQ).

    Works on transposed scores S^T (keys x queries) so that dV += P^T dO and
    dK += dS^T Q are plain matmuls with the key dimension leading.
    """
    q = load_tile(Q_bh, start_m, stride_qn, q_offs, rows_m, n_q, offs_d, HEAD_DIM, BLOCK_D, MASK)
    do = load_tile(dO_bh, start_m, stride_don, do_offs, rows_m, n_q, offs_d, HEAD_DIM, BLOCK_D, MASK)
    offs_m = start_m + rows_m
    if MASK:
        lse = tl.load(Lse_bh + offs_m, mask=offs_m < n_q, other=0.0)
        delta = tl.load(Delta_bh + offs_m, mask=offs_m < n_q, other=0.0)
    else:
        lse = tl.load(Lse_bh + offs_m)
        delta = tl.load(Delta_bh + offs_m)
    lse = _lse_log2(lse)
    if SOFTCAP > 0:  # the capped scores, and u whose 1 - u^2 is the cap's derivative (kernels/scores.py)
        s_t, u_t = softcap_scores(tl.dot(k, tl.trans(q), input_precision=PRECISION), qk_scale, SOFTCAP, q.dtype)
    else:
        s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale   # (BLOCK_N, BLOCK_M)
    p_t = tl.math.exp2(s_t - lse[None, :])
    if MASK:  # query i sees keys [lo_i, hi_i), within [0, n_k); rows past n_q see none
        row_lo, row_hi = row_key_bounds(offs_m, n_q, n_k, Docs_b, window, CAUSAL, WINDOW, DOCS)
        seen = (offs_m[None, :] < n_q) & (offs_n[:, None] >= row_lo[None, :]) & (offs_n[:, None] < row_hi[None, :])
        p_t = tl.where(seen, p_t, 0.0)
    if DROPOUT_P > 0:  # the forward's mask, transposed; dV's 1 / (1 - p) is applied in the epilogue
        keep_t = tl.trans(dropout_keep(seed, offset, bh, start_m, start_n, q.shape[0], offs_n.shape[0],
                                      DROPOUT_P).to(tl.int8)) != 0
        dv = tl.dot(tl.where(keep_t, p_t, 0.0).to(do.dtype), do, dv, input_precision=PRECISION)
    else:
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    if DROPOUT_P > 0:  # dL/dP of a dropped probability is 0, of a kept one scaled by 1 / (1 - p)
        dp_t = tl.where(keep_t, dp_t * (1.0 / (1.0 - DROPOUT_P)), 0.0)
    ds_t = p_t * (dp_t - delta[None, :])
    if SOFTCAP > 0:
        ds_t = ds_t * (1.0 - u_t * u_t)
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
    if DQ_ATOMIC:  # keys past n_k never reach here unmasked (see _bwd_kv_program)
        dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k, input_precision=PRECISION) * sm_scale
        tl.atomic_add(dQ_bh + tl.cast(start_m, tl.int64) * stride_dqn + dq_offs, dq, sem="relaxed",
                      mask=(offs_m < n_q)[:, None] & (offs_d < HEAD_DIM)[None, :])
    return dk, dv


@triton.jit
def _key_program(n_kv_heads, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Where a program of a (cdiv(n_k, BLOCK_N), B * Hkv) grid works (the dK/dV kernels'): batch b,
    KV head h_kv, its key tile's first row start_n, rows rows_n and positions offs_n, a query
    tile's rows rows_m, the head dim's columns offs_d (indices only: see tiles.query_program)."""
    start_n, b, h_kv = _tile_and_head(n_kv_heads, BLOCK_N)
    rows_n = tl.arange(0, BLOCK_N)
    offs_n = start_n + rows_n
    rows_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    return b, h_kv, start_n, rows_n, offs_n, rows_m, offs_d


@triton.jit
def _bwd_kv_epilogue(dK, dV, b, h_kv, sdk, sdv, dk, dv, sm_scale, start_n, rows_n, offs_d, n_k, HEAD_DIM: tl.constexpr):
    """Epilogue: the key tile's dK = scale * dS^T Q and dV = P^T dO, summed over its group's query heads."""
    store_tile(dK + b * sdk[0] + h_kv * sdk[2], start_n, sdk[1],
               tile_offsets(rows_n, offs_d, sdk[1], sdk[3]), rows_n, n_k, offs_d, dk * sm_scale, HEAD_DIM)
    store_tile(dV + b * sdv[0] + h_kv * sdv[2], start_n, sdv[1],
               tile_offsets(rows_n, offs_d, sdv[1], sdv[3]), rows_n, n_k, offs_d, dv, HEAD_DIM)


@triton.jit
def _bwd_kv_program(
    Q, K, V, dOut, Lse, Delta, Docs, dK, dV, dQ, sq, sk, sv, sdo, sdk, sdv, sdq,
    n_heads, n_kv_heads, kv_group, n_q, n_k, qk_scale, sm_scale, window, Rng,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    DOCS: tl.constexpr, WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, DQ_ATOMIC: tl.constexpr,
    SOFTCAP: tl.constexpr, DROPOUT_P: tl.constexpr,
):
    """One (key tile, batch x KV head) program of the dK/dV kernels (both kernels below). sq .. sdq:
    each tensor's strides (batch, sequence, head, head dim) as one tuple."""
    tl.static_assert(BLOCK_D >= HEAD_DIM, "BLOCK_D is the head dim padded to a power of two")
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot takes tiles of 16 rows or more")
    qk_scale = tl.cast(qk_scale, tl.float32)  # torch.compile passes Python floats as fp64
    sm_scale = tl.cast(sm_scale, tl.float32)
    b, h_kv, start_n, rows_n, offs_n, rows_m, offs_d = _key_program(n_kv_heads, BLOCK_N, BLOCK_M, BLOCK_D)
    Docs_b = mask_row(Docs, b, n_q, n_k)
    # Load the K and V tile once; dK and dV stay in registers while the query tiles stream past.
    k = load_tile(K + b * sk[0] + h_kv * sk[2], start_n, sk[1],
                  tile_offsets(rows_n, offs_d, sk[1], sk[3]), rows_n, n_k, offs_d, HEAD_DIM, BLOCK_D, True)
    v = load_tile(V + b * sv[0] + h_kv * sv[2], start_n, sv[1],
                  tile_offsets(rows_n, offs_d, sv[1], sv[3]), rows_n, n_k, offs_d, HEAD_DIM, BLOCK_D, True)
    q_offs = tile_offsets(rows_m, offs_d, sq[1], sq[3])
    do_offs = tile_offsets(rows_m, offs_d, sdo[1], sdo[3])
    dq_offs = tile_offsets(rows_m, offs_d, sdq[1], sdq[3])
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    seed, offset = dropout_seed_of(Rng, DROPOUT_P)

    # Query tiles that see any of these keys: masked, unmasked, masked (`stage_range`); others skipped.
    # A ragged last key tile's keys past n_k load as zeros and only make rows of dK/dV never stored,
    # but their dQ share 0 * P can overflow (P = exp2(0 - L)): with DQ_ATOMIC that tile runs all masked.
    lo, mid_lo, mid_hi, hi = query_ranges(start_n, n_q, n_k, Docs_b, window, BLOCK_N, BLOCK_M, CAUSAL, WINDOW, DOCS)
    if DQ_ATOMIC:
        if start_n + BLOCK_N > n_k:
            mid_hi = mid_lo
    for g in range(0, kv_group):  # every query head of the GQA group: dK, dV arrive summed over it
        h = h_kv * kv_group + g
        Q_bh = Q + b * sq[0] + h * sq[2]
        dO_bh = dOut + b * sdo[0] + h * sdo[2]
        dQ_bh = dQ + b * sdq[0] + h * sdq[2]
        Lse_bh = Lse + (b * n_heads + h) * n_q
        Delta_bh = Delta + (b * n_heads + h) * n_q
        for stage in tl.static_range(3):
            first, end = stage_range(stage, lo, mid_lo, mid_hi, hi)
            for start_m in range(first, end, BLOCK_M):
                dk, dv = _bwd_kv_tile(dk, dv, k, v, Q_bh, dO_bh, Lse_bh, Delta_bh, Docs_b, dQ_bh, q_offs, do_offs,
                                      dq_offs, sq[1], sdo[1], sdq[1], start_m, rows_m, start_n, offs_n, offs_d,
                                      n_q, n_k, window, qk_scale, sm_scale, seed, offset, b * n_heads + h,
                                      HEAD_DIM, BLOCK_D, CAUSAL, DOCS, WINDOW,
                                      stage != 1, PRECISION, DQ_ATOMIC, SOFTCAP, DROPOUT_P)

    if DROPOUT_P > 0:
        dv = dv * (1.0 / (1.0 - DROPOUT_P))
    _bwd_kv_epilogue(dK, dV, b, h_kv, sdk, sdv, dk, dv, sm_scale, start_n, rows_n, offs_d, n_k, HEAD_DIM)


@triton.autotune(configs=bwd_kv_configs(), key=["HEAD_DIM", "CAUSAL", "DOCS", "WINDOW", "SOFTCAP", "DROPOUT_P", "seq_bucket"],
                 prune_configs_by=bwd_kv_prune(), **persistent())
@triton.jit
def flash_bwd_kv_kernel(
    Q, K, V, dOut, Lse, Delta, Docs, Rng, dK, dV,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_dob, stride_don, stride_doh, stride_dod,
    stride_dkb, stride_dkn, stride_dkh, stride_dkd,
    stride_dvb, stride_dvn, stride_dvh, stride_dvd,
    n_heads, n_kv_heads, kv_group, n_q, n_k, qk_scale, sm_scale, seq_bucket, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    DOCS: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, DROPOUT_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Grid: (cdiv(n_k, BLOCK_N), B * Hkv). qk_scale = sm_scale * log2(e). Deterministic:
    reads the Delta that flash_bwd_q_kernel stored, writes dK and dV only. SOFTCAP, DROPOUT_P and
    Rng as in the forward (kernels/flash_fwd.py); sinks need nothing here (kernels/scores.py)."""
    # DQ_ATOMIC=False: the program never touches dQ, so dK and its strides fill dQ's slots.
    sdk = (stride_dkb, stride_dkn, stride_dkh, stride_dkd)
    _bwd_kv_program(Q, K, V, dOut, Lse, Delta, Docs, dK, dV, dK,  # dK in dQ's slot
                    (stride_qb, stride_qn, stride_qh, stride_qd), (stride_kb, stride_kn, stride_kh, stride_kd),
                    (stride_vb, stride_vn, stride_vh, stride_vd), (stride_dob, stride_don, stride_doh, stride_dod),
                    sdk, (stride_dvb, stride_dvn, stride_dvh, stride_dvd), sdk,  # dK's strides in dQ's slot
                    n_heads, n_kv_heads, kv_group, n_q, n_k, qk_scale, sm_scale, window, Rng,
                    HEAD_DIM, BLOCK_D, CAUSAL, DOCS, WINDOW, PRECISION, BLOCK_N, BLOCK_M, False, SOFTCAP, DROPOUT_P)


@triton.autotune(configs=bwd_kv_dq_configs(), key=["HEAD_DIM", "CAUSAL", "DOCS", "WINDOW", "SOFTCAP", "DROPOUT_P", "seq_bucket"],
                 prune_configs_by=bwd_kv_dq_prune(), reset_to_zero=["dQ"], **persistent())
@triton.jit
def flash_bwd_kv_dq_kernel(
    Q, K, V, dOut, Lse, Delta, Docs, Rng, dK, dV, dQ,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_dob, stride_don, stride_doh, stride_dod,
    stride_dkb, stride_dkn, stride_dkh, stride_dkd,
    stride_dvb, stride_dvn, stride_dvh, stride_dvd,
    stride_dqb, stride_dqn, stride_dqh, stride_dqd,
    n_heads, n_kv_heads, kv_group, n_q, n_k, qk_scale, sm_scale, seq_bucket, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    DOCS: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, DROPOUT_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """The whole backward in one pass over the key tiles: dK, dV as flash_bwd_kv_kernel, and
    dQ (float32, zeroed by the caller; the autotuner re-zeroes it between its trial runs)
    accumulated with atomic adds, already scaled. Delta from flash_bwd_delta_kernel.
    Grid: (cdiv(n_k, BLOCK_N), B * Hkv)."""
    _bwd_kv_program(Q, K, V, dOut, Lse, Delta, Docs, dK, dV, dQ,
                    (stride_qb, stride_qn, stride_qh, stride_qd), (stride_kb, stride_kn, stride_kh, stride_kd),
                    (stride_vb, stride_vn, stride_vh, stride_vd), (stride_dob, stride_don, stride_doh, stride_dod),
                    (stride_dkb, stride_dkn, stride_dkh, stride_dkd), (stride_dvb, stride_dvn, stride_dvh, stride_dvd),
                    (stride_dqb, stride_dqn, stride_dqh, stride_dqd),
                    n_heads, n_kv_heads, kv_group, n_q, n_k, qk_scale, sm_scale, window, Rng,
                    HEAD_DIM, BLOCK_D, CAUSAL, DOCS, WINDOW, PRECISION, BLOCK_N, BLOCK_M, True, SOFTCAP, DROPOUT_P)


@triton.jit
def _delta_and_lse(Out, Lse, Delta, b, h, n_heads, stride_ob, stride_on, stride_oh, stride_od,
                   do, start_m, rows_m, offs_m, offs_d, n_q, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Delta_i = rowsum(dO_i * O_i) of the query tile (as flash_bwd_delta_kernel), stored for
    flash_bwd_kv_kernel; and the tile's L in the exp2 domain, from which P is recomputed."""
    o = load_tile(Out + b * stride_ob + h * stride_oh, start_m, stride_on,
                  tile_offsets(rows_m, offs_d, stride_on, stride_od), rows_m, n_q, offs_d, HEAD_DIM, BLOCK_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + (b * n_heads + h) * n_q + offs_m, delta, mask=offs_m < n_q)
    lse = tl.load(Lse + (b * n_heads + h) * n_q + offs_m, mask=offs_m < n_q, other=0.0)
    return delta, _lse_log2(lse)


@triton.jit
def _bwd_q_tile(dq, q, do, lse, delta, K_bh, V_bh, k_offs, v_offs, stride_kn, stride_vn,
                start_n, offs_n, offs_d, n_k, row_lo, row_hi, qk_scale, seed, offset, bh, start_m,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr,
                SOFTCAP: tl.constexpr, DROPOUT_P: tl.constexpr):
    """Add keys [start_n, start_n + BLOCK_N)'s contribution to this program's dQ."""
    k = load_tile(K_bh, start_n, stride_kn, k_offs, offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D, MASK)
    v = load_tile(V_bh, start_n, stride_vn, v_offs, offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D, MASK)
    if SOFTCAP > 0:  # as in the forward, with u for the cap's derivative 1 - u^2
        s, u = softcap_scores(tl.dot(q, tl.trans(k), input_precision=PRECISION), qk_scale, SOFTCAP, q.dtype)
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    p = tl.math.exp2(s - lse[:, None])
    if MASK:  # as in the forward
        p = tl.where(visible(start_n + offs_n, row_lo, row_hi), p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    if DROPOUT_P > 0:  # the forward's mask: dL/dP is 0 where dropped, scaled by 1 / (1 - p) where kept
        keep = dropout_keep(seed, offset, bh, start_m, start_n, q.shape[0], offs_n.shape[0], DROPOUT_P)
        dp = tl.where(keep, dp * (1.0 / (1.0 - DROPOUT_P)), 0.0)
    ds = p * (dp - delta[:, None])
    if SOFTCAP > 0:
        ds = ds * (1.0 - u * u)
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)


@triton.autotune(configs=bwd_q_configs(), key=["HEAD_DIM", "CAUSAL", "DOCS", "WINDOW", "SOFTCAP", "DROPOUT_P", "seq_bucket"],
                 prune_configs_by=bwd_q_prune(), **persistent())
@triton.jit
def flash_bwd_q_kernel(
    Q, K, V, Out, dOut, Lse, Delta, Docs, Rng, dQ,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_ob, stride_on, stride_oh, stride_od,
    stride_dob, stride_don, stride_doh, stride_dod,
    stride_dqb, stride_dqn, stride_dqh, stride_dqd,
    n_heads, kv_group, n_q, n_k, qk_scale, sm_scale, seq_bucket, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    DOCS: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, DROPOUT_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid: (cdiv(n_q, BLOCK_M), B * H). Also stores Delta = rowsum(O * dO) of its rows, for
    flash_bwd_kv_kernel launched after it (one launch fewer than a separate Delta kernel)."""
    tl.static_assert(BLOCK_D >= HEAD_DIM, "BLOCK_D is the head dim padded to a power of two")
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot takes tiles of 16 rows or more")
    qk_scale = tl.cast(qk_scale, tl.float32)  # torch.compile passes Python floats as fp64
    sm_scale = tl.cast(sm_scale, tl.float32)
    b, h, h_kv, start_m, rows_m, offs_m, offs_n, offs_d = query_program(n_heads, kv_group, BLOCK_M, BLOCK_N, BLOCK_D)
    Docs_b = mask_row(Docs, b, n_q, n_k)

    # Load the Q and dO tiles once; K and V tiles stream past them.
    q = load_tile(Q + b * stride_qb + h * stride_qh, start_m, stride_qn,
                  tile_offsets(rows_m, offs_d, stride_qn, stride_qd), rows_m, n_q, offs_d, HEAD_DIM, BLOCK_D, True)
    do = load_tile(dOut + b * stride_dob + h * stride_doh, start_m, stride_don,
                   tile_offsets(rows_m, offs_d, stride_don, stride_dod), rows_m, n_q, offs_d, HEAD_DIM, BLOCK_D, True)
    delta, lse = _delta_and_lse(Out, Lse, Delta, b, h, n_heads, stride_ob, stride_on, stride_oh, stride_od,
                                do, start_m, rows_m, offs_m, offs_d, n_q, HEAD_DIM, BLOCK_D)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    seed, offset = dropout_seed_of(Rng, DROPOUT_P)
    K_bh = K + b * stride_kb + h_kv * stride_kh
    V_bh = V + b * stride_vb + h_kv * stride_vh
    k_offs = tile_offsets(offs_n, offs_d, stride_kn, stride_kd)
    v_offs = tile_offsets(offs_n, offs_d, stride_vn, stride_vd)

    # the forward's key tiles: masked, unmasked, masked (`stage_range`); the rest skipped
    row_lo, row_hi = row_key_bounds(offs_m, n_q, n_k, Docs_b, window, CAUSAL, WINDOW, DOCS)
    lo, mid_lo, mid_hi, hi = key_ranges(start_m, n_q, n_k, Docs_b, window, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, DOCS)
    for stage in tl.static_range(3):
        first, end = stage_range(stage, lo, mid_lo, mid_hi, hi)
        for start_n in range(first, end, BLOCK_N):
            dq = _bwd_q_tile(dq, q, do, lse, delta, K_bh, V_bh, k_offs, v_offs, stride_kn, stride_vn,
                             start_n, offs_n, offs_d, n_k, row_lo, row_hi, qk_scale, seed, offset,
                             b * n_heads + h, start_m, HEAD_DIM, BLOCK_D, stage != 1, PRECISION, SOFTCAP, DROPOUT_P)

    store_tile(dQ + b * stride_dqb + h * stride_dqh, start_m, stride_dqn,
               tile_offsets(rows_m, offs_d, stride_dqn, stride_dqd), rows_m, n_q, offs_d, dq * sm_scale, HEAD_DIM)
