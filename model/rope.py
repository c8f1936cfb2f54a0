"""Rotary position embedding (RoPE, Su et al. 2021), "rotate half" layout.

Channel i of the first half of each head is paired with channel i of the second half
and the pair is rotated by angle pos * theta^(-2i/D). Nothing is tabulated up front:
cos/sin are computed per forward for the current length, once for all layers, so a
million-token context needs no precomputed table and no maximum to outgrow.
"""
from __future__ import annotations

import torch


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device, *,
                 positions: int | torch.Tensor = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each (seq_len, head_dim // 2) in float32.

    `positions` says where the seq_len tokens sit: an int is the first one's position (0 for
    training, the cache length when decoding continues a prompt); a tensor gives every token's
    position, (seq_len,) or (B, seq_len), and the result then has its shape plus head_dim // 2.
    Angles are formed in float64: in float32 a position near 10^6 times the fastest
    frequency (1 rad/token) is off by up to 0.06 rad, which would blur long contexts.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)
    if isinstance(positions, torch.Tensor):
        if positions.shape[-1] != seq_len or positions.dim() > 2:
            raise ValueError(f"positions of shape {tuple(positions.shape)} do not give one position "
                             f"per token of a {seq_len}-token sequence")
        pos = positions.to(device=device, dtype=torch.float64)
    else:
        pos = torch.arange(positions, positions + seq_len, device=device, dtype=torch.float64)
    angles = pos[..., None] * inv_freq
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, H, D) by position; returns a new tensor, x (often a strided view
    of the fused QKV projection) is only read. cos/sin are (T, D/2) or per sequence (B, T, D/2)."""
    cos = cos.to(x.dtype)[..., None, :]   # (T, 1, D/2) or (B, T, 1, D/2): broadcast over heads
    sin = sin.to(x.dtype)[..., None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
