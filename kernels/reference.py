"""Attention in plain PyTorch: the naive baseline and the test oracle.

This is the formula FlashAttention must reproduce, written the obvious way:
S = scale * Q K^T is materialised as a (B, H, Nq, Nk) tensor, masked, soft-maxed
and multiplied by V. Memory is O(N^2), which is exactly what `attention=naive`
is there to show; nothing beyond the formula's own N x N tensors is allocated, so
the naive baseline's memory is not inflated. Same signature and layout as `kernels.flash_attention`.
"""
from __future__ import annotations

import math

import torch

from kernels.masks import check_masks, visible_mask


def attention_reference(q, k, v, causal=False, softmax_scale=None, return_lse=False, *,
                        document_ids=None, window=None):
    """softmax(scale * Q K^T + mask) V with q (B, Nq, H, D), k/v (B, Nk, Hkv, D).

    Computes in the inputs' dtype (so it is also the "same dtype" error baseline);
    pass float64 inputs for an exact oracle. Causal masking with Nq != Nk is aligned
    bottom-right: query i sees keys j <= i + Nk - Nq. A query row that sees no key
    (only possible when Nq > Nk) yields zeros and lse = -inf, as the kernel does.
    document_ids (B, N) and window: the masks of `kernels.flash_attention`, applied
    here as one dense boolean mask (kernels/masks.visible_mask).
    Returns out (B, Nq, H, D) and, if asked, lse (B, H, Nq) in float32 (natural log).
    """
    B, Nq, H, D = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    if H % Hkv:
        raise ValueError(f"q has {H} heads, not a multiple of k's {Hkv}")
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    group = H // Hkv
    qh = q.transpose(1, 2)                                  # (B, H, Nq, D)
    kh = k.transpose(1, 2).repeat_interleave(group, dim=1)  # (B, H, Nk, D)
    vh = v.transpose(1, 2).repeat_interleave(group, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    check_masks(q, k, causal, document_ids, window)
    mask = visible_mask(Nq, Nk, causal, document_ids, window, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if mask is not None and (Nq > Nk or window is not None):
        probs = torch.nan_to_num(probs, nan=0.0)            # rows that see no key -> 0
    out = torch.matmul(probs, vh).transpose(1, 2)           # (B, Nq, H, D)
    if not return_lse:
        return out
    return out, torch.logsumexp(scores.float(), dim=-1)      # (B, H, Nq)
