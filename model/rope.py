"""Rotary position embedding (RoPE, Su et al. 2021), "rotate half" layout.

Channel i of the first half of each head is paired with channel i of the second half
and the pair is rotated by angle pos * theta^(-2i/D). Nothing is tabulated up front:
cos/sin are computed per forward for the positions at hand, once for all layers, so a
million-token context needs no precomputed table and no maximum to outgrow.

The table is built by one opaque op (`flashtrain::rope_cos_sin`). Written as plain
pointwise code, torch.compile fused the float64 cos/sin into every consumer and so
recomputed them for q and k of every layer, forward and backward: at gpt2-small,
T = 4K, that recomputation was 29% of a training step on an H200
(benchmarks/training/train_h200_profile_before.txt). As an op its output is computed once per forward
and the layers only read it.
"""
from __future__ import annotations

from typing import Optional

import torch


@torch.library.custom_op("flashtrain::rope_cos_sin", mutates_args=())
def rope_table(positions: torch.Tensor, head_dim: int, theta: float,
               rotated_pairs: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles at `positions` (any shape of integers), each
    (*positions.shape, head_dim // 2) in float32.

    Angles are formed in float64: in float32 a position near 10^6 times the fastest
    frequency (1 rad/token) is off by up to 0.06 rad, which would blur long contexts.

    `rotated_pairs` (None: all): only the fastest that many pairs rotate; the slower rest get
    frequency 0 (cos 1, sin 0), channels whose match does not depend on distance at all
    (p-RoPE: Barbero et al. 2024, "Round and Round We Go! What makes Rotary Positional
    Encodings useful?"). Every consumer of the table (the rotary kernel, apply_rope, the
    KV cache) then leaves them as they are, with nothing of its own to change.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim)
    if rotated_pairs is not None:
        inv_freq[rotated_pairs:] = 0.0
    angles = positions.to(torch.float64)[..., None] * inv_freq
    return angles.cos().float(), angles.sin().float()


@rope_table.register_fake
def _(positions, head_dim, theta, rotated_pairs=None):
    shape = (*positions.shape, head_dim // 2)
    return positions.new_empty(shape, dtype=torch.float32), positions.new_empty(shape, dtype=torch.float32)


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The table for positions 0 .. seq_len - 1: cos and sin, each (seq_len, head_dim // 2)."""
    return rope_table(torch.arange(seq_len, device=device), head_dim, theta)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, H, D) by position; cos/sin are (T, D/2) or (B, T, D/2). Returns a new
    tensor, x (often a strided view of the fused QKV projection) is only read. The arithmetic is
    float32, rounded once to x's dtype, as kernels/rotary.py's."""
    cos = cos.float().unsqueeze(-2)   # (..., T, 1, D/2): broadcast over heads (and batch)
    sin = sin.float().unsqueeze(-2)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def fuses_rotary(qkv: torch.Tensor) -> bool:
    """Whether the model rotates its fused projection with kernels/rotary.py's one kernel each way
    (eager on CUDA) rather than apply_rope's tensor operations on q and k (elsewhere, and under
    torch.compile, which fuses those itself)."""
    return qkv.is_cuda and not torch.compiler.is_compiling()
