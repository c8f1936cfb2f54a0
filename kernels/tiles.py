"""Tile addressing, loads, stores, masks and tile ranges shared by the forward and backward kernels.

Every Q/K/V/O/dO tile is BLOCK rows of one (sequence x head_dim) matrix, addressed as

    base + start * row_stride  +  offs            offs = rows * row_stride + cols * col_stride

The first term is a scalar formed in int64 (at a million tokens, start * row_stride
passes 2^31 elements); `offs` is an int32 tile computed once per program. Keeping the
per-iteration state down to one scalar matters on Hopper: a loop-carried tile of 64-bit
addresses costs two registers per element and made the kernels spill (kernels/LOG.md).
"""
from __future__ import annotations

import triton
import triton.language as tl

# The softmax runs in base 2 (exp2, log2: one instruction each): scores are scaled by
# softmax_scale * LOG2E, and a base-2 log-sum-exp times LN2 is the natural one the API returns.
# constexpr, since jit code may only read constexpr globals; host code reads `.value`.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def query_heads(pid_bh, n_heads, kv_group):
    """(batch, query head, KV head) of a program in a (..., B * H) grid, in int64 for addressing.
    GQA: query head h reads KV head h // kv_group."""
    h = pid_bh % n_heads
    return (pid_bh // n_heads).to(tl.int64), h.to(tl.int64), (h // kv_group).to(tl.int64)


@triton.jit
def query_tile_longest_first():
    """The query tile of a program in a (cdiv(n_q, BLOCK_M), B * H) grid, last tile first.

    Under a causal mask query tile i visits i + 1 key tiles, and the GPU dispatches programs
    in grid order; taking the tiles of each head from the last (the longest) down leaves the
    shortest programs for the end, so the SMs finish together instead of waiting on the
    longest tiles of the last heads (list scheduling, longest first). Heads stay in order,
    so the programs resident at once share the K/V of one or two heads in L2.
    """
    return tl.num_programs(0) - 1 - tl.program_id(0)


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
def mask_row(Docs, b, n_q, n_k):
    """Batch row b's part of the mask buffer (kernels/masks.bounds_buffer): per query [lo, hi) at
    [0, n_q) and [n_q, 2 n_q), per key the queries [lo, hi) that see it at 2 n_q + [0, n_k) and
    2 n_q + n_k + [0, n_k), and at 2 n_q + 2 n_k whether all those bounds are nondecreasing."""
    return Docs + b * (2 * n_q + 2 * n_k + 1)


@triton.jit
def bounds_nondecreasing(Docs_b, n_q, n_k):
    return tl.load(Docs_b + 2 * n_q + 2 * n_k) != 0


@triton.jit
def row_key_bounds(rows, n_q, n_k, Docs_b, window,
                   CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr):
    """Query row i (a scalar or a vector of rows) sees exactly the keys [lo_i, hi_i).

    Causal is aligned bottom-right (query i sees key j iff j <= i + (n_k - n_q)); a window
    keeps the last `window` of those; with DOCS, Docs_b (this batch row's intervals, see
    `mask_row`) keeps the row's own interval: its document, or the key bounds it was given.
    Every bound is nondecreasing in i (a mask whose bounds are not says so, `bounds_nondecreasing`),
    which is what lets a tile's first and last rows bound the tile.
    Rows past n_q (a ragged tile) read the last row's interval.
    """
    shift = n_k - n_q
    lo = rows * 0
    hi = rows * 0 + n_k
    if CAUSAL:
        hi = tl.minimum(hi, rows + shift + 1)
    if WINDOW:
        lo = tl.maximum(lo, rows + shift - window + 1)
    if DOCS:
        row = tl.minimum(rows, n_q - 1)
        lo = tl.maximum(lo, tl.load(Docs_b + row))
        hi = tl.minimum(hi, tl.load(Docs_b + n_q + row))
    return lo, hi


@triton.jit
def key_query_bounds(cols, n_q, n_k, Docs_b, window,
                     CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr):
    """The transpose of `row_key_bounds`: key j is seen by exactly the queries [lo_j, hi_j)."""
    shift = n_k - n_q
    lo = cols * 0
    hi = cols * 0 + n_q
    if CAUSAL:
        lo = tl.maximum(lo, cols - shift)
    if WINDOW:
        hi = tl.minimum(hi, cols - shift + window)
    if DOCS:
        col = tl.minimum(cols, n_k - 1)
        lo = tl.maximum(lo, tl.load(Docs_b + 2 * n_q + col))
        hi = tl.minimum(hi, tl.load(Docs_b + 2 * n_q + n_k + col))
    return lo, hi


@triton.jit
def tile_ranges(first_lo, first_hi, last_lo, last_hi, BLOCK: tl.constexpr):
    """Tiles of BLOCK (aligned to multiples of BLOCK) that one program must visit, from the
    visible interval [lo, hi) of its first and last row (both nondecreasing in the row):

        [lo, mid_lo)        masked: the tiles some row sees only in part
        [mid_lo, mid_hi)    unmasked: inside [last_lo, first_hi), seen whole by every row
        [mid_hi, hi)        masked: the causal diagonal, the window's or document's end,
                            the ragged last tile

    Everything before lo or from hi on is seen by no row and is never loaded: that is
    the skipping that makes documents cost the sum of their squared lengths and a window
    cost linear in the length. Loops over [lo, min(mid_lo, hi)) stop at hi.
    """
    lo = first_lo // BLOCK * BLOCK
    hi = tl.maximum(last_hi, 0)
    mid_lo = tl.maximum(tl.cdiv(last_lo, BLOCK) * BLOCK, lo)
    mid_hi = tl.maximum(tl.maximum(first_hi, 0) // BLOCK * BLOCK, mid_lo)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def every_tile_unless(nondecreasing, lo, mid_lo, mid_hi, hi, n):
    """The ranges as they are for nondecreasing bounds; otherwise every tile of [0, n), masked
    (the first and last rows no longer bound the others, the per-element mask still holds)."""
    lo = tl.where(nondecreasing, lo, 0)
    mid_lo = tl.where(nondecreasing, mid_lo, 0)
    mid_hi = tl.where(nondecreasing, mid_hi, 0)
    hi = tl.where(nondecreasing, hi, n)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def key_ranges(start_m, n_q, n_k, Docs_b, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr):
    """Key tiles the query tile [start_m, start_m + BLOCK_M) visits (see `tile_ranges`).
    Without documents or a window this is [0, unmasked_end) unmasked, then the causal
    diagonal and the ragged last tile masked (the plain causal loop of the paper)."""
    first_lo, first_hi = row_key_bounds(start_m, n_q, n_k, Docs_b, window, CAUSAL, WINDOW, DOCS)
    last_lo, last_hi = row_key_bounds(start_m + BLOCK_M - 1, n_q, n_k, Docs_b, window, CAUSAL, WINDOW, DOCS)
    lo, mid_lo, mid_hi, hi = tile_ranges(first_lo, first_hi, last_lo, last_hi, BLOCK_N)
    if DOCS:
        lo, mid_lo, mid_hi, hi = every_tile_unless(bounds_nondecreasing(Docs_b, n_q, n_k), lo, mid_lo, mid_hi, hi, n_k)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def query_ranges(start_n, n_q, n_k, Docs_b, window, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                 CAUSAL: tl.constexpr, WINDOW: tl.constexpr, DOCS: tl.constexpr):
    """Query tiles that see any key of [start_n, start_n + BLOCK_N) (see `tile_ranges`)."""
    first_lo, first_hi = key_query_bounds(start_n, n_q, n_k, Docs_b, window, CAUSAL, WINDOW, DOCS)
    last_lo, last_hi = key_query_bounds(start_n + BLOCK_N - 1, n_q, n_k, Docs_b, window, CAUSAL, WINDOW, DOCS)
    lo, mid_lo, mid_hi, hi = tile_ranges(first_lo, first_hi, last_lo, last_hi, BLOCK_M)
    if DOCS:
        lo, mid_lo, mid_hi, hi = every_tile_unless(bounds_nondecreasing(Docs_b, n_q, n_k), lo, mid_lo, mid_hi, hi, n_q)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def stage_range(STAGE: tl.constexpr, lo, mid_lo, mid_hi, hi):
    """The tiles of stage STAGE of a program's loop over the ranges of `tile_ranges`: 0 the
    masked tiles before the unmasked ones, 1 the unmasked tiles, 2 the masked ones after them
    (the diagonal). Kernels run `for stage in tl.static_range(3)` with MASK = stage != 1: one
    loop body for the causal and the full case (the STAGE of Triton's fused-attention tutorial)."""
    start = mid_hi
    end = hi
    if STAGE == 0:
        start = lo
        end = tl.minimum(mid_lo, hi)
    if STAGE == 1:
        start = mid_lo
        end = mid_hi
    return start, end


@triton.jit
def query_program(n_heads, kv_group, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Where a program of a (cdiv(n_q, BLOCK_M), B * H) grid works (the forward's and dQ's):
    batch b, query head h, KV head h_kv, its query tile's first row start_m, the tile's rows
    rows_m and positions offs_m, a key tile's rows offs_n, the head dim's columns offs_d.

    Helpers return indices, never a pointer into a kernel argument: Inductor's mutation analysis
    (torch.compile) takes an argument whose pointer a helper returns for written, and an argument
    slot filled with another tensor then reads stale copies (tests/test_kernel_compile.py,
    test_inductor_sees_each_kernel_write_only_its_outputs)."""
    pid_m = query_tile_longest_first()
    b, h, h_kv = query_heads(tl.program_id(1), n_heads, kv_group)
    start_m = pid_m * BLOCK_M
    rows_m = tl.arange(0, BLOCK_M)
    offs_m = start_m + rows_m
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    return b, h, h_kv, start_m, rows_m, offs_m, offs_n, offs_d


@triton.jit
def visible(cols, lo, hi):
    """(len(lo) x len(cols)): row r sees key cols[c] iff lo[r] <= cols[c] < hi[r] (`row_key_bounds`)."""
    return (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
