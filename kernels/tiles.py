"""Tile addressing, loads, stores and key ranges shared by the forward and backward kernels.

Every Q/K/V/O/dO tile is BLOCK rows of one (sequence x head_dim) matrix, addressed as

    base + start * row_stride  +  offs            offs = rows * row_stride + cols * col_stride

The first term is a scalar formed in int64 (at a million tokens, start * row_stride
passes 2^31 elements); `offs` is an int32 tile computed once per program. Keeping the
per-iteration state down to one scalar matters on Hopper: a loop-carried tile of 64-bit
addresses costs two registers per element and made the kernels spill (kernels/NOTES.md).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def query_heads(pid_bh, n_heads, kv_group):
    """(batch, query head, KV head) of a program in a (..., B * H) grid, in int64 for addressing.
    GQA: query head h reads KV head h // kv_group."""
    h = pid_bh % n_heads
    return (pid_bh // n_heads).to(tl.int64), h.to(tl.int64), (h // kv_group).to(tl.int64)


@triton.jit
def tile_offsets(rows, cols, row_stride, col_stride):
    return rows[:, None] * row_stride + cols[None, :] * col_stride


@triton.jit
def load_tile(base, start, row_stride, offs, rows, n_rows, cols,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_ROWS: tl.constexpr):
    """Rows [start, start + len(rows)) of a (n_rows x HEAD_DIM) matrix, zero-padded.

    Bounds are checked only where they can fail: rows on ragged tiles (MASK_ROWS),
    columns only when the head dim is padded up to BLOCK_D.
    """
    ptrs = base + tl.cast(start, tl.int64) * row_stride + offs
    if MASK_ROWS:
        return tl.load(ptrs, mask=((start + rows) < n_rows)[:, None] & (cols < HEAD_DIM)[None, :], other=0.0)
    elif BLOCK_D != HEAD_DIM:
        return tl.load(ptrs, mask=(cols < HEAD_DIM)[None, :], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def store_tile(base, start, row_stride, offs, rows, n_rows, cols, value, HEAD_DIM: tl.constexpr):
    ptrs = base + tl.cast(start, tl.int64) * row_stride + offs
    tl.store(ptrs, value.to(base.dtype.element_ty),
             mask=((start + rows) < n_rows)[:, None] & (cols < HEAD_DIM)[None, :])


@triton.jit
def key_ranges(start_m, n_q, n_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Keys the query tile [start_m, start_m + BLOCK_M) must visit, as two ranges:
    [0, unmasked_end) of tiles needing no mask, then [unmasked_end, hi) of tiles that do
    (the causal diagonal and the ragged last tile). Causal is aligned bottom-right:
    query i sees key j iff j <= i + (n_k - n_q)."""
    full_end = (n_k // BLOCK_N) * BLOCK_N                    # tiles wholly inside [0, n_k)
    if CAUSAL:
        shift = n_k - n_q
        hi = tl.maximum(tl.minimum(n_k, start_m + BLOCK_M + shift), 0)  # past the last row's view
        # tiles whose every key is visible to the tile's first row, hence to all its rows
        unmasked_end = tl.minimum(tl.maximum(start_m + shift + 1, 0) // BLOCK_N * BLOCK_N, full_end)
    else:
        hi = n_k
        unmasked_end = full_end
    return unmasked_end, hi
