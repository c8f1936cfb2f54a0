"""Rotary position embedding (RoPE, Su et al. 2021), "rotate half" layout.

Channel i of the first half of each head is paired with channel i of the second half
and the pair is rotated by angle pos * theta^(-2i/D). Nothing is tabulated up front:
cos/sin are computed per forward for the current length, once for all layers, so a
million-token context needs no precomputed table and no maximum to outgrow.
"""
from __future__ import annotations

import torch


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each (seq_len, head_dim // 2) in float32.

    Angles are formed in float64: in float32 a position near 10^6 times the fastest
    frequency (1 rad/token) is off by up to 0.06 rad, which would blur long contexts.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, H, D) by position; returns a new tensor, x (often a strided view
    of the fused QKV projection) is only read."""
    cos = cos.to(x.dtype)[:, None, :]   # (T, 1, D/2): broadcast over batch and heads
    sin = sin.to(x.dtype)[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
