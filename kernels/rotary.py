"""Rotary position embedding on a fused QKV projection, in one pass each way.

Rotary embedding (Su et al. 2021, "rotate half" layout) turns channel pair (i, i + D/2) of every
query and key head by the angle of its token's position: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
Written as tensor operations, that is a dozen elementwise kernels each way for q and again for k,
each reading and writing a (B, T, H, D) tensor, and q and k come out as new tensors, so the
attention call's backward cannot write one packed gradient of the projection
(kernels/flash_op.py, `_EagerPackedAttention`).

`rotary_qkv` instead reads the projection (B, T, (H + 2 Hkv) D) once and writes a tensor of the same
layout: its query and key heads rotated, its value heads copied. q, k and v are then slices of one
tensor again, and the backward is the same kernel turning the gradient back by the opposite angle
(the rotation is orthogonal). The arithmetic is float32 whatever the input dtype, rounded once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import INTERPRET
from kernels.launch import cdiv, next_power_of_2

BLOCK_ROWS = 16   # tokens per program; a program takes one head of them


@triton.jit
def rotary_qkv_kernel(X, Y, Cos, Sin, n_rows, seq_len, stride_xr, stride_yr, stride_cb, stride_ct, rotated_heads,
                      HEAD_DIM: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                      INVERSE: tl.constexpr):
    """Grid: (cdiv(n_rows, BLOCK_ROWS), heads). Rows are tokens (b, t) = divmod(row, seq_len); head j's
    channels are [j D, (j + 1) D) of a row. Heads below `rotated_heads` (the queries', then the
    keys') are rotated by their token's angles, Cos/Sin (B or 1, T, D/2) float32 (stride_cb 0 when the
    table is shared by the batch), by the opposite angle when INVERSE; the others are copied."""
    HALF: tl.constexpr = HEAD_DIM // 2
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK_HALF)
    ok = (rows[:, None] < n_rows) & (cols[None, :] < HALF)
    rows64 = rows.to(tl.int64)[:, None]
    x_first = X + rows64 * stride_xr + head * HEAD_DIM + cols[None, :]
    y_first = Y + rows64 * stride_yr + head * HEAD_DIM + cols[None, :]
    x1 = tl.load(x_first, mask=ok)
    x2 = tl.load(x_first + HALF, mask=ok)
    if head < rotated_heads:
        angle = (rows64 // seq_len) * stride_cb + (rows64 % seq_len) * stride_ct + cols[None, :]
        cos = tl.load(Cos + angle, mask=ok)
        sin = tl.load(Sin + angle, mask=ok)
        if INVERSE:
            sin = -sin
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(y_first, (a * cos - b * sin).to(Y.dtype.element_ty), mask=ok)
        tl.store(y_first + HALF, (b * cos + a * sin).to(Y.dtype.element_ty), mask=ok)
    else:
        tl.store(y_first, x1, mask=ok)
        tl.store(y_first + HALF, x2, mask=ok)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated_heads: int, head_dim: int,
            inverse: bool) -> torch.Tensor:
    x = x.contiguous()   # the projection's output is; a gradient nearly always
    seq_len, width = x.shape[-2], x.shape[-1]
    rows = x.numel() // width
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    cos3, sin3 = cos.reshape(-1, seq_len, cos.shape[-1]), sin.reshape(-1, seq_len, sin.shape[-1])
    stride_cb = 0 if cos3.shape[0] == 1 else cos3.stride(0)
    grid = (cdiv(rows, BLOCK_ROWS), width // head_dim)
    rotary_qkv_kernel[grid](x, y, cos3, sin3, rows, seq_len, x.stride(-2), y.stride(-2), stride_cb, cos3.stride(1),
                            rotated_heads, HEAD_DIM=head_dim, BLOCK_HALF=next_power_of_2(head_dim // 2),
                            BLOCK_ROWS=BLOCK_ROWS, INVERSE=inverse, num_warps=4)
    return y


class _RotaryQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, rotated_heads, head_dim):
        ctx.save_for_backward(cos, sin)
        ctx.rotated_heads, ctx.head_dim = rotated_heads, head_dim
        return _rotate(qkv, cos, sin, rotated_heads, head_dim, inverse=False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _rotate(dy, cos, sin, ctx.rotated_heads, ctx.head_dim, inverse=True), None, None, None, None


def rotary_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated_heads: int,
               head_dim: int) -> torch.Tensor:
    """qkv (B, T, W) with W a multiple of head_dim (even): a new tensor of the same shape, each row's
    first `rotated_heads` heads rotated by the row's angles, the rest copied. cos, sin: (T, D/2) or
    (B, T, D/2) float32 (model/rope.py's table). Differentiable with respect to qkv; on CUDA, or on the
    CPU under TRITON_INTERPRET=1 (tests)."""
    if head_dim % 2 or qkv.shape[-1] % head_dim or not 0 <= rotated_heads <= qkv.shape[-1] // head_dim:
        raise ValueError(f"rotary_qkv: a width of {qkv.shape[-1]} is not heads of {head_dim} channels (even) with "
                         f"{rotated_heads} of them rotated")
    if qkv.device.type != "cuda" and not INTERPRET:
        raise ValueError(f"rotary_qkv runs on CUDA (or in Triton's interpreter); got a {qkv.device.type} tensor")
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    if (qkv.dim() != 3 or cos.shape != sin.shape or cos.shape[-2:] != (qkv.shape[1], head_dim // 2)
            or (cos.dim() == 3 and cos.shape[0] not in (1, qkv.shape[0])) or cos.dim() not in (2, 3)):
        raise ValueError(f"rotary_qkv: tables of shape {tuple(cos.shape)} and {tuple(sin.shape)} for a projection of "
                         f"shape {tuple(qkv.shape)} and head dim {head_dim}")
    return _RotaryQKV.apply(qkv, cos, sin, rotated_heads, head_dim)
