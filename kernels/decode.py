"""Decoding attention: a few new queries against a KV cache, split over the keys (flash-decoding).

A decode step has one query per (sequence, head). `flash_attention` would run one program per
(sequence, head), each walking the whole cache alone: at batch 1 that is 12 programs for
gpt2-small on a GPU with 132 SMs. Here the cache is cut into splits of SPLIT keys and

1. `flash_decode_split_kernel`, one program per (split, sequence, KV head), folds its split's
   keys into a running max m, sum l of exp(s - m) and weighted sum of values, for every new
   query of every query head sharing that KV head (GQA: K and V are read once for the group),
   and stores the split's normalised output o_s and log-sum-exp lse_s in float32;
2. `flash_decode_merge_kernel`, one program per (sequence, query, head), merges the splits
   exactly: O = sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M), M = max_s lse_s.

How many keys are valid is read on the device (`cache_len`), never on the host, so one launch
serves every step of a static cache and can be replayed from a CUDA graph as the cache fills:
splits past the end find no key and store lse = -inf, which the merge adds as exact zeros.
The new queries are the last `n_q` of the `cache_len` valid keys, causal among themselves
(bottom-right, as flash_attention's causal Nq != Nk), with an optional sliding window.
Scores and sums are float32 whatever the input dtype. Decoding reads every cached key once
per step and does a few FLOPs per byte, so the products are plain broadcasts, not tl.dot.
Soft-capping and sinks (kernels/scores.py) are the training kernels': the split kernel caps its
scores, and the merge starts every row from its head's sink (m = sink, l = 1) as the forward does.

`decode_reference` is the same function in plain PyTorch (the naive entry and the test oracle);
`decode_mask` is its mask, also what SDPA's decode entry in model/attention.py uses.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.checks import check_inputs, check_scores, softmax_scale_for
from kernels.launch import cdiv, next_power_of_2
from kernels.masks import check_masks
from kernels.scores import softcap_scores
from kernels.tiles import LN2, LOG2E

SPLIT = 256          # keys per split program: 16 splits per head at a 4K cache, 128 at 32K


@triton.jit
def _split_keys(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                n, cols, lo, hi, live, n_valid, scale, HEAD_DIM: tl.constexpr, SOFTCAP: tl.constexpr):
    """Fold the keys n into every row's running max m, sum l and weighted sum of values (the
    forward's online softmax; row r sees keys [lo_r, hi_r), keys past n_valid load as zeros)."""
    in_cache = (n < n_valid)[:, None] & (cols < HEAD_DIM)[None, :]
    k = tl.load(k_base + n[:, None].to(tl.int64) * stride_kn + cols[None, :] * stride_kd,
                mask=in_cache, other=0.0).to(tl.float32)
    if SOFTCAP > 0:   # capped, in the log2 domain
        s, _ = softcap_scores(tl.sum(q[:, None, :] * k[None, :, :], axis=2), scale, SOFTCAP, k_base.dtype.element_ty)
    else:
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale       # (BLOCK_R, BLOCK_N), log2 domain
    seen = (n[None, :] >= lo[:, None]) & (n[None, :] < hi[:, None]) & live[:, None]
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row that has seen no key yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    v = tl.load(v_base + n[:, None].to(tl.int64) * stride_vn + cols[None, :] * stride_vd,
                mask=in_cache, other=0.0).to(tl.float32)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return acc, l_i, m_new


@triton.jit
def _split_epilogue(PartO, PartLse, acc, l_i, m_i, b, t, head, split, n_q, n_heads, n_splits, live, cols,
                    HEAD_DIM: tl.constexpr):
    """Epilogue: the split's normalised output o_s and log-sum-exp lse_s of every row (a row that
    saw no key of the split: o_s = 0, lse_s = -inf, which the merge adds as exact zeros)."""
    has_keys = l_i > 0
    out = tl.where(has_keys[:, None], acc / tl.where(has_keys, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * LN2, float("-inf"))
    row_offs = ((b * n_q + t) * n_heads + head) * n_splits + split          # (BLOCK_R,) into PartLse
    tl.store(PartLse + row_offs, lse, mask=live)
    tl.store(PartO + row_offs[:, None] * HEAD_DIM + cols[None, :], out,
             mask=live[:, None] & (cols < HEAD_DIM)[None, :])


@triton.jit
def flash_decode_split_kernel(
        Q, K, V, PartO, PartLse, Len,
        stride_qb, stride_qt, stride_qh, stride_qd,
        stride_kb, stride_kn, stride_kh, stride_kd,
        stride_vb, stride_vn, stride_vh, stride_vd,
        n_q, n_heads, n_kv_heads, n_splits, window, qk_scale,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, SPLIT_N: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr = 0.0):
    """Rows r = t * GROUP + i: new query t of query head kv_head * GROUP + i. PartO is
    (B, n_q, H, n_splits, HEAD_DIM) and PartLse (B, n_q, H, n_splits), both float32, contiguous.
    SOFTCAP > 0: the scores are capped at it."""
    split = tl.program_id(0)
    pid = tl.program_id(1)
    b = (pid // n_kv_heads).to(tl.int64)
    kv_head = (pid % n_kv_heads).to(tl.int64)
    n_valid = tl.load(Len).to(tl.int32)

    rows = tl.arange(0, BLOCK_R)
    t = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    live = rows < n_q * GROUP
    cols = tl.arange(0, BLOCK_D)
    q_ptrs = Q + b * stride_qb + t[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh \
        + cols[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=live[:, None] & (cols < HEAD_DIM)[None, :], other=0.0).to(tl.float32)

    # Query t sits at position n_valid - n_q + t and sees keys [lo, hi) of it.
    hi = n_valid - n_q + t + 1
    lo = hi * 0
    if WINDOW:
        lo = tl.maximum(lo, hi - window)
    first = split * SPLIT_N
    start_lo = tl.maximum(first, tl.min(tl.where(live, lo, n_valid), 0)) // BLOCK_N * BLOCK_N
    end = tl.minimum(first + SPLIT_N, tl.max(tl.where(live, hi, 0), 0))

    scale = tl.cast(qk_scale, tl.float32)   # fp64 where torch.compile passes Python floats
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    keys = tl.arange(0, BLOCK_N)
    k_base = K + b * stride_kb + kv_head * stride_kh
    v_base = V + b * stride_vb + kv_head * stride_vh
    for start in range(start_lo, end, BLOCK_N):
        acc, l_i, m_i = _split_keys(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                    start + keys, cols, lo, hi, live, n_valid, scale, HEAD_DIM, SOFTCAP)
    _split_epilogue(PartO, PartLse, acc, l_i, m_i, b, t, head, split, n_q, n_heads, n_splits, live, cols, HEAD_DIM)


@triton.jit
def flash_decode_merge_kernel(PartO, PartLse, Out, Sinks, stride_ob, stride_ot, stride_oh, stride_od,
                              n_q, n_heads, n_splits,
                              HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (sequence, new query, head): the splits' outputs weighted by their share
    of the softmax mass, merged in a fixed order (BLOCK_S splits at a time, online). Sinks (H,)
    float32: every row starts from its head's sink, a split of weight 1 and no value (None: none)."""
    pid = tl.program_id(0).to(tl.int64)
    head = pid % n_heads
    t = (pid // n_heads) % n_q
    b = pid // (n_heads * n_q)
    cols = tl.arange(0, BLOCK_D)
    splits = tl.arange(0, BLOCK_S)
    if Sinks is None:
        m = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
        l = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
    else:
        m = tl.load(Sinks + head).to(tl.float32)
        l = tl.full([], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for first in range(0, n_splits, BLOCK_S):
        s = first + splits
        lse = tl.load(PartLse + pid * n_splits + s, mask=s < n_splits, other=float("-inf"))
        o = tl.load(PartO + (pid * n_splits + s)[:, None] * HEAD_DIM + cols[None, :],
                    mask=(s < n_splits)[:, None] & (cols < HEAD_DIM)[None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp(lse - m_safe)
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        m = m_new
    out = tl.where(l > 0, acc / tl.where(l > 0, l, 1.0), 0.0)
    tl.store(Out + b * stride_ob + t * stride_ot + head * stride_oh + cols * stride_od,
             out.to(Out.dtype.element_ty), mask=cols < HEAD_DIM)


def _check_decode(q, k, v, cache_len, window) -> None:
    check_inputs(q, k, v)
    check_masks(q, k, True, None, window)
    if not isinstance(cache_len, torch.Tensor) or cache_len.numel() != 1 or cache_len.dtype.is_floating_point \
            or cache_len.dtype == torch.bool:
        raise ValueError("cache_len must be an integer tensor of one element: the number of valid keys")
    if cache_len.device != q.device:
        raise ValueError(f"cache_len is on {cache_len.device} but q is on {q.device}")
    if q.shape[1] > k.shape[1]:
        raise ValueError(f"{q.shape[1]} new queries do not fit a cache of {k.shape[1]} keys")


def flash_decode(q, k, v, cache_len, softmax_scale=None, *, window=None, softcap=None, sinks=None):
    """Attention of the n_q newest tokens over a KV cache buffer, split over its keys.

    q (B, n_q, H, D); k, v (B, N, Hkv, D), the cache's whole buffers (any strides), of which
    the first `cache_len` keys are valid (a one-element integer tensor on q's device, read only
    by the kernels: keep it in [n_q, N]); the queries are the last n_q of those keys, causal
    among themselves. window=W: each query sees its last W keys. softcap and sinks as in
    kernels.flash_attention. Returns (B, n_q, H, D) in q's dtype. Not differentiable (inference only)."""
    _check_decode(q, k, v, cache_len, window)
    _, softcap = check_scores(q, 0.0, softcap, sinks)
    B, n_q, H, D = q.shape
    n_keys, h_kv = k.shape[1], k.shape[2]
    group = H // h_kv
    scale = softmax_scale_for(softmax_scale, D)
    n_splits = cdiv(n_keys, SPLIT)
    part_o = torch.empty((B, n_q, H, n_splits, D), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((B, n_q, H, n_splits), dtype=torch.float32, device=q.device)
    out = torch.empty((B, n_q, H, D), dtype=q.dtype, device=q.device)
    block_r = max(1, next_power_of_2(n_q * group))
    block_d = max(16, next_power_of_2(D))
    block_n = max(16, min(64, 4096 // (block_r * block_d)))   # the (rows x keys x dim) product: ~32 registers a thread
    flash_decode_split_kernel[(n_splits, B * h_kv)](
        q, k, v, part_o, part_lse, cache_len, *q.stride(), *k.stride(), *v.stride(),
        n_q, H, h_kv, n_splits, window or 0, scale * LOG2E.value,
        GROUP=group, HEAD_DIM=D, BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_D=block_d, SPLIT_N=SPLIT,
        WINDOW=window is not None, SOFTCAP=softcap, num_warps=4)
    flash_decode_merge_kernel[(B * n_q * H,)](
        part_o, part_lse, out, None if sinks is None else sinks.float(), *out.stride(), n_q, H, n_splits,
        HEAD_DIM=D, BLOCK_S=min(32, next_power_of_2(n_splits)), BLOCK_D=block_d, num_warps=1)
    return out


def decode_mask(n_q: int, n_keys: int, cache_len: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """(n_q, n_keys) bool, True where new query t (at position cache_len - n_q + t) sees the key;
    built on the device from `cache_len`, no host sync."""
    positions = cache_len.reshape(()).to(torch.long) - n_q + torch.arange(n_q, device=cache_len.device)
    keys = torch.arange(n_keys, device=cache_len.device)
    mask = keys[None, :] <= positions[:, None]
    if window is not None:
        mask &= keys[None, :] > positions[:, None] - window
    return mask


def decode_reference(q, k, v, cache_len, softmax_scale=None, *, window=None, softcap=None, sinks=None):
    """flash_decode in plain PyTorch: the scores over the whole buffer, the invalid keys masked.
    Computes in the inputs' dtype (float64 inputs: an exact oracle)."""
    check_masks(q, k, True, None, window)
    group = q.shape[2] // k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~decode_mask(q.shape[1], k.shape[1], cache_len, window), float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), vh).transpose(1, 2)
    sink = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]   # the sink has no value
    return torch.matmul(probs, vh).transpose(1, 2)
