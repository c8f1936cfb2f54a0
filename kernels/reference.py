"""Attention in plain PyTorch: the naive baseline and the test oracle.

This is the formula FlashAttention must reproduce, written the obvious way:
S = scale * Q K^T is materialised as a (B, H, Nq, Nk) tensor, masked, soft-maxed
and multiplied by V. Memory is O(N^2), which is exactly what `attention=naive`
is there to show; nothing beyond the formula's own N x N tensors is allocated, so
the naive baseline's memory is not inflated. Same signature and layout as `kernels.flash_attention`.
`attention_reference_backward` is the matching plain-PyTorch twin of
`kernels.flash_attention_backward` (gradients from a given out and lse). Soft-capping, sinks and
dropout (kernels/scores.py) are written out the same obvious way: tanh on the scores, the sink as
one more column of the softmax, the dropped probabilities zeroed and the kept ones scaled.
"""
from __future__ import annotations

import math

import torch

from kernels.masks import check_masks, visible_mask

def _masked_scores(q, k, causal, softmax_scale, document_ids=None, window=None, key_bounds=None, softcap=None):
    """scale * Q K^T as (B, H, Nq, Nk) (capped to softcap * tanh(s / softcap) with a softcap), -inf
    where the mask (causal, documents, window) hides a key, the heads-first q, k-heads repeated to H
    (B, H, N, D) for the caller's other products, the scale, and the cap's derivative 1 - tanh^2
    (None without a cap)."""
    B, Nq, H, D = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    if H % Hkv:
        raise ValueError(f"q has {H} heads, not a multiple of k's {Hkv}")
    check_masks(q, k, causal, document_ids, window, key_bounds)
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    qh = q.transpose(1, 2)                                     # (B, H, Nq, D)
    kh = k.transpose(1, 2).repeat_interleave(H // Hkv, dim=1)  # (B, H, Nk, D)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    slope = None
    if softcap is not None:
        tanh = torch.tanh(scores / softcap)
        scores, slope = softcap * tanh, 1 - tanh * tanh
    mask = visible_mask(Nq, Nk, causal, document_ids, window, q.device, key_bounds)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return scores, qh, kh, scale, slope


def attention_reference(q, k, v, causal=False, softmax_scale=None, return_lse=False, *,
                        document_ids=None, window=None, key_bounds=None, dropout_p=0.0, dropout_mask=None,
                        softcap=None, sinks=None):
    """softmax(scale * Q K^T + mask) V with q (B, Nq, H, D), k/v (B, Nk, Hkv, D).

    Computes in the inputs' dtype (so it is also the "same dtype" error baseline);
    pass float64 inputs for an exact oracle. Causal masking with Nq != Nk is aligned
    bottom-right: query i sees keys j <= i + Nk - Nq. A query row that sees no key
    (only possible when Nq > Nk) yields zeros and lse = -inf, as the kernel does.
    document_ids (B, N), window and key_bounds (B, 2, Nq): the masks of `kernels.flash_attention`,
    applied here as one dense boolean mask (kernels/masks.visible_mask).
    Returns out (B, Nq, H, D) and, if asked, lse (B, H, Nq) (natural log) in float32,
    or float64 for float64 inputs so that the oracle stays exact.
    softcap and sinks as in kernels.flash_attention; dropout_p drops each probability with that
    probability (the kept ones scaled by 1 / (1 - dropout_p)), where `dropout_mask` (B, H, Nq, Nk)
    bool says which are kept, or else torch draws them. lse is the undropped softmax's.
    """
    scores, _, _, _, _ = _masked_scores(q, k, causal, softmax_scale, document_ids, window, key_bounds, softcap)
    vh = v.transpose(1, 2).repeat_interleave(q.shape[2] // k.shape[2], dim=1)
    if sinks is not None:   # one more column per row: the head's sink logit, whose probability has no value
        sink = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    elif (causal and q.shape[1] > k.shape[1]) or window is not None or key_bounds is not None:
        probs = torch.nan_to_num(probs, nan=0.0)            # rows that see no key -> 0
    if dropout_p:
        keep = torch.rand_like(probs) >= dropout_p if dropout_mask is None else dropout_mask
        probs = probs.masked_fill(~keep, 0.0) / (1 - dropout_p)
    out = torch.matmul(probs, vh).transpose(1, 2)           # (B, Nq, H, D)
    if not return_lse:
        return out
    return out, torch.logsumexp(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1)


def attention_reference_backward(dout, q, k, v, out, lse, causal=False, softmax_scale=None, *,
                                 document_ids=None, window=None, key_bounds=None, softcap=None):
    """dq, dk, dv of attention from its output `out` and log-sum-exp `lse` (B, H, Nq).

    The FlashAttention backward identity, written out: P = exp(S - lse),
    dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)), dQ = scale dS K,
    dK = scale dS^T Q. Given the out and lse of attention over a longer key set (the
    merged result of a ring), it returns this key block's exact share of the gradients.
    dk, dv are summed over each GQA group, shaped like k, v; computed in q's dtype. The masks
    are the block's own, as in attention_reference; softcap multiplies dS by the cap's derivative
    (sinks need nothing: their share of the softmax is in lse).
    """
    scores, qh, kh, scale, slope = _masked_scores(q, k, causal, softmax_scale, document_ids, window, key_bounds,
                                                  softcap)
    Hkv, group = k.shape[2], q.shape[2] // k.shape[2]
    vh = v.transpose(1, 2).repeat_interleave(group, dim=1)
    lse = lse.to(scores.dtype)[..., None]
    probs = torch.where(torch.isinf(lse), 0.0, torch.exp(scores - lse))  # rows that see no key -> 0
    doh = dout.transpose(1, 2)                                           # (B, H, Nq, D)
    delta = (dout * out).sum(-1).transpose(1, 2)[..., None]              # (B, H, Nq, 1)
    ds = probs * (torch.matmul(doh, vh.transpose(-1, -2)) - delta)
    if slope is not None:
        ds = ds * slope
    dq = torch.matmul(ds, kh) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qh) * scale                  # (B, H, Nk, D)
    dv = torch.matmul(probs.transpose(-1, -2), doh)

    def per_kv_head(t):  # (B, H, Nk, D) -> (B, Nk, Hkv, D), summed over the heads sharing one
        return t.unflatten(1, (Hkv, group)).sum(2).transpose(1, 2)

    return dq.transpose(1, 2), per_kv_head(dk), per_kv_head(dv)
