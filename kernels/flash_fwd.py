"""FlashAttention forward: exact attention without the N x N matrix in HBM.

Algorithm (Dao et al. 2022, with FlashAttention-2's loop order):

One program owns BLOCK_M query rows of one (batch, head). It loads that Q tile into
SRAM once, then streams the K and V tiles of the matching KV head past it, BLOCK_N keys
at a time. For each tile it computes S = Q K^T (BLOCK_M x BLOCK_N, in registers),
and keeps for every row a running maximum m and a running sum l of exp(S - m):

    m_new = max(m, rowmax(S))
    alpha = exp(m - m_new)             # how much the old partial results shrink
    P     = exp(S - m_new)
    l     = alpha * l + rowsum(P)
    acc   = alpha * acc + P V

After the last tile, O = acc / l and the log-sum-exp L = m + log(l) are the only
things written back: O is (BLOCK_M x D), L is one float per row. The backward pass
recomputes P = exp(S - L) from L, so nothing of size N x N ever leaves the chip.

Details that matter for speed and exactness:
- exponentials are exp2 of scale * log2(e) * S - m, one fused multiply-add per score
  (the row max is taken on raw scores and then scaled); L is converted back to natural
  log when stored;
- key tiles that are fully visible and in bounds run without any masking; only the
  tiles on the causal diagonal and the ragged last tile pay for masks;
- causal masking with Nq != Nk is aligned bottom-right: query i sees key j iff
  j <= i + (Nk - Nq). A query row that sees no key at all gets O = 0 and L = -inf;
- document masks and sliding windows make every row's visible keys an interval
  [lo_i, hi_i) (kernels/masks.py); the tile's first and last rows bound the key tiles
  it can see, and every other key tile is skipped, never loaded (kernels/tiles.py);
- GQA: query head h reads KV head h // (H / Hkv); K and V are never repeated;
- all offsets that can exceed 2^31 (batch and sequence strides at 1M tokens) are
  scalars formed in int64 (kernels/tiles.py), so long sequences index correctly.

What a call may do to its scores besides masking them (kernels/scores.py): soft-capping bends each
S through c tanh(S / c) before the max is taken, and with bfloat16 inputs needs no max at all: the
capped scores lie in [-c, c], so m stays one constant that keeps every exp in float32's range
(`softcap_shift`), and alpha is 1; sinks start every row's (m, l) at (sink, 1)
instead of (-inf, 0); dropout zeroes the dropped entries of P after l has summed them all (the
normaliser is the undropped softmax's) and scales O by 1 / (1 - p) at the end.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.exp2 import exp2_split
from kernels.scores import drop_scores, dropout_seed_of, dropout_words, sink_start, softcap_tanh
from kernels.tiles import (LN2, LOG2E, key_ranges, load_tile, mask_row, query_program, row_key_bounds, stage_range,
                           store_tile, tile_offsets, visible)
from kernels.tuning import fwd_configs, fwd_prune, persistent


@triton.jit
def _fwd_tile(acc, l_i, m_i, q, K_bh, V_bh, k_offs, v_offs, stride_kn, stride_vn,
              start_n, offs_n, offs_d, n_k, row_lo, row_hi, qk_scale, seed, offset, bh, start_m,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr,
              SOFTCAP: tl.constexpr, DROPOUT_P: tl.constexpr, SHARE_DRAW: tl.constexpr, PACKED_MASK: tl.constexpr,
              EXP2_ON_FMA: tl.constexpr, SHIFT: tl.constexpr):
    """Fold keys [start_n, start_n + BLOCK_N) into the running (acc, l, m) of a query tile."""
    k = load_tile(K_bh, start_n, stride_kn, k_offs, offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D, MASK)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # raw scores; scaled below
    scale = qk_scale
    if SOFTCAP > 0:  # c tanh(scale s / c): u = tanh(scale s / c) here, and c log2(e) its scale below
        s = softcap_tanh(s, qk_scale, SOFTCAP, q.dtype)   # (kernels/scores.py), one FMA a score for P
        scale = SOFTCAP * LOG2E
    if MASK:  # row i sees keys [row_lo_i, row_hi_i), which lies within [0, n_k)
        s = tl.where(visible(start_n + offs_n, row_lo, row_hi), s, float("-inf"))
    if SHIFT >= 0:
        # Soft-capped scores lie in [-c, c]: every exponent is shifted by the constant m_i = SHIFT
        # log2(e) (kernels/scores.py, softcap_shift), so no max is taken and nothing is rescaled.
        m_new = m_i
        p = exp2_split(s * scale - m_i[:, None], 0 if MASK else EXP2_ON_FMA)
        l_i = l_i + tl.sum(p, 1)
    else:
        # The running max lives in the scaled log2 domain. Scaling the row max (qk_scale > 0,
        # and rounding is monotonic, so this is exactly the max of the scaled scores) rather
        # than the whole tile leaves one fused multiply-add per score for P below.
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
        m_shift = m_new
        if MASK:
            # A row that has seen only masked keys keeps m = -inf (so its first visible key
            # later still gets P = 1 exactly); its exponents shift by 0 instead so that
            # exp2(-inf - -inf) never produces NaN. Its P, l and acc stay exactly 0.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_shift)
        # EXP2_ON_FMA of every 4 exponentials on the FMA units (kernels/exp2.py), in unmasked tiles (no -inf)
        p = exp2_split(s * scale - m_shift[:, None], 0 if MASK else EXP2_ON_FMA)
        l_i = l_i * alpha + tl.sum(p, 1)  # the normaliser sums every probability, dropped or not
    if DROPOUT_P > 0:  # the dropped ones leave O; 1 / (1 - p) scales it at the end
        if PACKED_MASK:  # cast first: the 16-bit P holds half the registers while the mask is drawn
            p = p.to(q.dtype)
        words, r, c = dropout_words(seed, offset, bh, start_m, start_n, q.shape[0], offs_n.shape[0], SHARE_DRAW)
        p = drop_scores(words, r, c, p, q.dtype, DROPOUT_P, PACKED_MASK)
    v = load_tile(V_bh, start_n, stride_vn, v_offs, offs_n, n_k, offs_d, HEAD_DIM, BLOCK_D, MASK)
    if SHIFT < 0:
        acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def _fwd_epilogue(Out, Lse, b, h, n_heads, stride_ob, stride_on, stride_oh, stride_od,
                  acc, l_i, m_i, start_m, rows_m, offs_m, offs_d, n_q, HEAD_DIM: tl.constexpr):
    """Epilogue: O = acc / l and the natural-log L = (m + log2(l)) * ln 2 of the tile's rows.
    Rows that saw no key (causal with n_q > n_k, or a window before the keys): O = 0, L = -inf."""
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * LN2, float("-inf"))
    store_tile(Out + b * stride_ob + h * stride_oh, start_m, stride_on,
               tile_offsets(rows_m, offs_d, stride_on, stride_od), rows_m, n_q, offs_d,
               acc / l_safe[:, None], HEAD_DIM)
    tl.store(Lse + (b * n_heads + h) * n_q + offs_m, lse, mask=offs_m < n_q)


@triton.autotune(configs=fwd_configs(),
                 key=["HEAD_DIM", "CAUSAL", "DOCS", "WINDOW", "SOFTCAP", "DROPOUT_P", "PACKED_MASK", "EXP2_ON_FMA",
                      "SHIFT", "seq_bucket"],
                 prune_configs_by=fwd_prune(), **persistent())
@triton.jit
def flash_fwd_kernel(
    Q, K, V, Out, Lse, Docs, Rng, Sinks,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_ob, stride_on, stride_oh, stride_od,
    n_heads, kv_group, n_q, n_k, qk_scale, seq_bucket, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    DOCS: tl.constexpr, WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, DROPOUT_P: tl.constexpr, SHARE_DRAW: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PACKED_MASK: tl.constexpr = 0, EXP2_ON_FMA: tl.constexpr = 0, SHIFT: tl.constexpr = -1.0,
):
    """Grid: (cdiv(n_q, BLOCK_M), B * H). qk_scale = softmax_scale * log2(e).
    Docs: (B, 2, N) int32 document bounds when DOCS (any pointer otherwise); window is
    read when WINDOW. kernels/scores.py: SOFTCAP > 0 caps the scores at it; Sinks (H,) float32
    holds each head's sink logit (None: no sinks); DROPOUT_P > 0 drops probabilities, Rng holding
    the call's seed and offset (None without dropout). Without the three, the code is the plain
    kernel's: None arguments and the constexprs compile to nothing. SHARE_DRAW=1 (kernels/scores.py's
    SHARE, on S): the two lanes that read each Philox call split the calls, which is right only where
    S is a wgmma accumulator: `_triton_forward` sets it on sm_90, where tl.dot's result is one
    (tests/test_attention_scores.py reads that off the compiled kernel). PACKED_MASK=1 (only with
    SHARE_DRAW=1 and 16-bit inputs): P is cast first and the mask zeroes halves of its packed pairs
    (kernels/scores.py's drop_scores); `_triton_forward` sets it from kernels.scores.packed_mask.
    EXP2_ON_FMA (0 to 4): of every 4 exponentials of P in an unmasked tile, how many the FMA units
    compute (kernels/exp2.py), from kernels.exp2.on_fma. SHIFT >= 0 (soft-capping only, from
    kernels.scores.softcap_shift): P's exponents are shifted by that constant instead of a running max."""
    tl.static_assert(BLOCK_D >= HEAD_DIM, "BLOCK_D is the head dim padded to a power of two")
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16, "tl.dot takes tiles of 16 rows or more")
    # torch.compile passes Python floats as fp64; keep every score in fp32.
    qk_scale = tl.cast(qk_scale, tl.float32)
    b, h, h_kv, start_m, rows_m, offs_m, offs_n, offs_d = query_program(n_heads, kv_group, BLOCK_M, BLOCK_N, BLOCK_D)
    Docs_b = mask_row(Docs, b, n_q, n_k)

    # Load the Q tile once; K and V tiles stream past it.
    Q_bh = Q + b * stride_qb + h * stride_qh
    K_bh = K + b * stride_kb + h_kv * stride_kh
    V_bh = V + b * stride_vb + h_kv * stride_vh
    q = load_tile(Q_bh, start_m, stride_qn, tile_offsets(rows_m, offs_d, stride_qn, stride_qd),
                  rows_m, n_q, offs_d, HEAD_DIM, BLOCK_D, True)
    k_offs = tile_offsets(offs_n, offs_d, stride_kn, stride_kd)
    v_offs = tile_offsets(offs_n, offs_d, stride_vn, stride_vd)

    m_i, l_i = sink_start(Sinks, h, BLOCK_M)   # (-inf, 0), or the sink as every row's first score
    if SHIFT >= 0:   # the constant every soft-capped exponent is shifted by (no sinks then)
        m_i = tl.full([BLOCK_M], SHIFT * LOG2E, dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    seed, offset = dropout_seed_of(Rng, DROPOUT_P)
    bh = b * n_heads + h

    # Key tiles: masked, unmasked, masked (`stage_range`); the rest lie wholly outside every
    # row's view (other documents, past the window, causal) and are never loaded.
    row_lo, row_hi = row_key_bounds(offs_m, n_q, n_k, Docs_b, window, CAUSAL, WINDOW, DOCS)
    lo, mid_lo, mid_hi, hi = key_ranges(start_m, n_q, n_k, Docs_b, window, BLOCK_M, BLOCK_N, CAUSAL, WINDOW, DOCS)
    for stage in tl.static_range(3):
        first, end = stage_range(stage, lo, mid_lo, mid_hi, hi)
        for start_n in range(first, end, BLOCK_N):
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, K_bh, V_bh, k_offs, v_offs, stride_kn, stride_vn,
                                      start_n, offs_n, offs_d, n_k, row_lo, row_hi, qk_scale, seed, offset, bh,
                                      start_m, HEAD_DIM, BLOCK_D, stage != 1, PRECISION, SOFTCAP, DROPOUT_P,
                                      SHARE_DRAW, PACKED_MASK, EXP2_ON_FMA, SHIFT)

    if DROPOUT_P > 0:
        acc = acc * (1.0 / (1.0 - DROPOUT_P))
    _fwd_epilogue(Out, Lse, b, h, n_heads, stride_ob, stride_on, stride_oh, stride_od,
                  acc, l_i, m_i, start_m, rows_m, offs_m, offs_d, n_q, HEAD_DIM)
