"""Ring attention: exact attention over a sequence split across a context-parallel group.

Each of the C ranks of the group holds two chunks of the sequence, i and 2C-1-i (see
model.context_parallel), concatenated in that order, so the local tensors keep global
order and every rank does the same causal work. Queries stay put; K/V chunks travel
around the ring (rank r sends to r+1 and receives from r-1), the transfer of the next
chunk overlapped with attention on the current one. Per step a block attention returning
the log-sum-exp runs on the visible part, and the partial outputs are merged exactly in
float32 (float64 for float64 inputs) with the lse:

- step 0 (own K/V): one causal call over the local 2c queries and keys, which is exactly
  the diagonal pairs plus chunk 2C-1-i seeing all of chunk i;
- K/V from a rank s < r: its first chunk s precedes both local chunks and its second
  chunk follows both: all queries attend to its first chunk, non-causal;
- K/V from a rank s > r: its first chunk follows local chunk r and precedes 2C-1-r, its
  second chunk lies between: only the second local query chunk attends, to both, non-causal.

Without a causal mask every step is a full non-causal call.

Document masks and sliding windows (causal): a query at position p sees the keys at positions
[max(doc_start(p), p - window + 1), p]. Which positions every rank holds is the batch's layout
(model.cp_layout, balanced over the documents), which every rank computes from the same whole
windows, so only K/V travel: each rank turns its queries' intervals into index intervals of
every step's keys once per batch, on the host (`masked_steps`). A step whose K/V hold no key a
local query sees is skipped, no kernel call (counted in STEP_COUNTS; the K/V still move on, the
next rank may need them); the others run on the block trimmed to the rows and columns that take
part, unmasked where every pair in it is visible, otherwise our kernel with those intervals as
its key_bounds, which skips the tiles outside them.

Grouped-query attention sends
only the Hkv key/value heads. The backward reruns the same blocks with the block backward
given the merged (global) out and lse, which yields each block's exact share of the
gradients; dq accumulates locally, dK/dV accumulate on a buffer that travels the ring with
its K/V and arrives back at its owner after C hops.

Soft-capping is elementwise on the scores, so every block caps its own. Sinks join the merge
once, after the last block, as one more block of weight exp(sink) and no value; the global lse
then includes them, so the blocks' backward needs nothing more, and each rank adds its rows'
share of the sinks' gradient (kernels/scores.py). Attention dropout is not run in the ring.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from kernels import attention_reference, attention_reference_backward, flash_attention, flash_attention_backward
from kernels.checks import check_scores
from kernels.scores import sink_grad
from model.cp_layout import Layout, host_to_device, zigzag_layout


@dataclass(frozen=True)
class BlockAttention:
    """The per-block compute a ring runs: forward (q, k, v, causal, softmax_scale, softcap) ->
    (out, lse) and backward (dout, q, k, v, out, lse, causal, softmax_scale, softcap) -> (dq, dk, dv),
    with the step's mask as keywords."""
    forward: Callable
    backward: Callable


# Keyed like the attention registry: our Triton kernel, and the plain-PyTorch formula
# (float64-capable, the CPU oracle). SDPA returns no lse and cannot serve as a block.
BLOCKS: dict[str, BlockAttention] = {
    "flash": BlockAttention(partial(flash_attention, return_lse=True), flash_attention_backward),
    "naive": BlockAttention(partial(attention_reference, return_lse=True), attention_reference_backward),
}


@dataclass(frozen=True)
class RingStep:
    """One ring step's block call: query rows and key columns of the local tensors it covers,
    and its mask within them (causal, bottom-right; or per-query key bounds; or nothing)."""
    rows: slice
    cols: slice
    causal: bool = False
    key_bounds: torch.Tensor | None = None   # (B or 1, 2, rows): kernels.flash_attention's keyword

    @property
    def kind(self) -> str:
        return "unmasked" if not self.causal and self.key_bounds is None else "masked"

    def masks(self, batch: int) -> dict:
        if self.key_bounds is None:
            return {}
        return {"key_bounds": self.key_bounds.expand(batch, -1, -1)}


def causal_steps(rank: int, size: int, n_local: int, causal: bool) -> tuple[RingStep, ...]:
    """The zig-zag layout's steps without documents or a window: see the module docstring."""
    every, half = slice(None), n_local // 2
    if not causal:
        return (RingStep(every, every),) * size
    steps = [RingStep(every, every, causal=True)]
    for step in range(1, size):
        src = (rank - step) % size
        steps.append(RingStep(every, slice(0, half)) if src < rank else RingStep(slice(half, None), every))
    return tuple(steps)


def masked_steps(layout: Layout, rank: int, document_starts: torch.Tensor | None, window: int | None,
                 device) -> tuple[RingStep | None, ...]:
    """Each step's block for causal attention within documents and/or a window, None where the
    K/V chunks of that step hold no key any local query sees (the step is skipped).

    Query at position p sees the keys at positions [max(doc_start(p), p - window + 1), p]
    (`document_starts` (B, T): every token's document start, on the CPU; None: one document).
    In the local K/V of a step, whose positions are sorted, that is the index interval
    [#keys before the first, #keys up to p]: nondecreasing in the query, as the kernels want.
    The block is trimmed to the rows that see a key and the columns seen; when every pair in it
    is visible it runs unmasked, otherwise masked with those intervals as key_bounds.
    Computed on the host from host tensors (no device sync); the bounds are copied over once.
    """
    positions = layout.positions(rank)
    first = torch.zeros(1, len(positions), dtype=torch.long)
    if document_starts is not None:
        first = document_starts[:, positions].long()
    if window is not None:
        first = torch.maximum(first, positions - window + 1)
    last = (positions + 1).expand_as(first).contiguous()
    steps = []
    for step in range(layout.size):
        keys = layout.positions((rank - step) % layout.size)
        lo, hi = torch.searchsorted(keys, first), torch.searchsorted(keys, last)
        seen = hi > lo
        if step == 0 and not seen.all():
            raise RuntimeError("a query does not see its own key: the ring's first step must cover every row")
        if not seen.any():
            steps.append(None)
            continue
        seen_rows = seen.any(0).nonzero().flatten()
        r0, r1 = int(seen_rows[0]), int(seen_rows[-1]) + 1
        c0, c1 = int(lo[seen].min()), int(hi[seen].max())
        visible = int((hi - lo).clamp(min=0).sum())
        bounds = None
        if visible < first.shape[0] * (r1 - r0) * (c1 - c0):
            block_bounds = (torch.stack([lo, hi], 1)[:, :, r0:r1] - c0).clamp(0, c1 - c0)
            bounds = host_to_device(block_bounds.to(torch.int32), device)
        steps.append(RingStep(slice(r0, r1), slice(c0, c1), key_bounds=bounds))
    return tuple(steps)


@lru_cache(maxsize=64)
def _window_steps(size: int, rank: int, n_local: int, window: int, device) -> tuple[RingStep | None, ...]:
    """A sliding window without documents: the zig-zag layout's steps, the same for every batch."""
    return masked_steps(zigzag_layout(n_local * size, size), rank, None, window, device)


# The steps of a batch's documents, by the local document ids they were made for (by
# model.context_parallel.context_parallel_batch), with the window, rank and size they assume:
# the ids go through the model to every attention layer, so the plan is made once per batch.
_DOCUMENT_STEPS = WeakIdKeyDictionary()


def attach_document_steps(document_ids: torch.Tensor, steps, window, rank: int, size: int) -> None:
    _DOCUMENT_STEPS[document_ids] = (steps, window, rank, size)


def _document_steps(document_ids, window, rank: int, size: int):
    found = _DOCUMENT_STEPS.get(document_ids)
    if found is None:
        raise ValueError("ring_attention's document_ids must be the local ids model.context_parallel."
                         "context_parallel_batch returns (they carry which tokens every rank holds)")
    steps, made_window, made_rank, made_size = found
    if (made_window, made_rank, made_size) != (window, rank, size):
        raise ValueError(f"these document_ids were made for window={made_window} on rank {made_rank} of "
                         f"{made_size}, not window={window} on rank {rank} of {size}")
    return steps


# Ring steps run, by kind ("unmasked", "masked", "skipped": no key of that step's K/V visible),
# counted in the forward of every call; the backward runs the same steps again.
STEP_COUNTS: Counter = Counter()


class _Ring:
    """Send to the next rank and receive from the previous one, waited on later."""

    def __init__(self, group):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def start(self, send: torch.Tensor, tag: int):
        """Start passing `send` on; returns (buffer being received, handles to wait on)."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, group=self.group, group_peer=(self.rank + 1) % self.size, tag=tag),
               dist.P2POp(dist.irecv, recv, group=self.group, group_peer=(self.rank - 1) % self.size, tag=tag)]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(handles) -> None:
        for handle in handles:
            handle.wait()


_KV_TAG, _DKV_TAG = 0, 1


def _merge_(out, lse, part_out, part_lse, rows: slice) -> None:
    """Fold one block's (out, lse) for query `rows` into the running (out, lse), in place:
    out = out * exp(lse - new) + part * exp(part_lse - new), new = logaddexp(lse, part_lse)."""
    acc_out, acc_lse = out[:, rows], lse[:, :, rows]
    part_lse = part_lse.to(lse.dtype)
    new_lse = torch.logaddexp(acc_lse, part_lse)
    acc_out.mul_(torch.exp(acc_lse - new_lse).transpose(1, 2)[..., None])
    acc_out.add_(part_out.to(out.dtype) * torch.exp(part_lse - new_lse).transpose(1, 2)[..., None])
    acc_lse.copy_(new_lse)


def _add_sinks_(out, lse, sinks) -> None:
    """Fold the sinks into the merged (out, lse), in place: a block of lse = sink and no value."""
    new_lse = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None])
    out.mul_(torch.exp(lse - new_lse).transpose(1, 2)[..., None])
    lse.copy_(new_lse)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, steps, softmax_scale, block, softcap, sinks):
        ring = _Ring(group)
        acc = torch.promote_types(q.dtype, torch.float32)
        kv = torch.stack((k, v))           # one contiguous buffer of the K/V heads to pass on
        out = lse = None
        for index, step in enumerate(steps):
            if index + 1 < ring.size:
                next_kv, pending = ring.start(kv, _KV_TAG)
            STEP_COUNTS["skipped" if step is None else step.kind] += 1
            if step is not None:
                part_out, part_lse = block.forward(q[:, step.rows], kv[0][:, step.cols], kv[1][:, step.cols],
                                                   causal=step.causal, softmax_scale=softmax_scale, softcap=softcap,
                                                   **step.masks(q.shape[0]))
                if out is None:            # step 0 covers every query row
                    out, lse = part_out.to(acc), part_lse.to(acc)
                else:
                    _merge_(out, lse, part_out, part_lse, step.rows)
            if index + 1 < ring.size:
                ring.wait(pending)
                kv = next_kv
        if sinks is not None:
            _add_sinks_(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.group, ctx.steps, ctx.softmax_scale, ctx.block, ctx.softcap = group, steps, softmax_scale, block, softcap
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        ring, block = _Ring(ctx.group), ctx.block
        acc = torch.promote_types(q.dtype, torch.float32)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack((k, v))
        dkv = dkv_pending = None
        for index, step in enumerate(ctx.steps):
            if index + 1 < ring.size:
                next_kv, kv_pending = ring.start(kv, _KV_TAG)
            if step is not None:
                rows, cols = step.rows, step.cols
                dq_part, dk_part, dv_part = block.backward(
                    dout[:, rows], q[:, rows], kv[0][:, cols], kv[1][:, cols], out[:, rows], lse[:, :, rows],
                    causal=step.causal, softmax_scale=ctx.softmax_scale, softcap=ctx.softcap,
                    **step.masks(q.shape[0]))
                dq[:, rows] += dq_part
            if dkv_pending is None:        # this K/V's gradient buffer starts here
                dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
            else:                          # ... or arrived from the previous rank with its K/V
                ring.wait(dkv_pending)
                dkv = dkv_recv
            if step is not None:
                dkv[0][:, cols] += dk_part
                dkv[1][:, cols] += dv_part
            if ring.size > 1:              # after the last hop each buffer is back at its owner
                dkv_recv, dkv_pending = ring.start(dkv, _DKV_TAG)
            if index + 1 < ring.size:
                ring.wait(kv_pending)
                kv = next_kv
        if dkv_pending is not None:
            ring.wait(dkv_pending)
            dkv = dkv_recv
        dsinks = sink_grad(dout, out, lse, sinks) if sinks is not None else None   # this rank's rows' share
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, dsinks

def _check_group(group) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("ring_attention needs torch.distributed initialised (init_process_group) for its group")
    if dist.get_rank(group) < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the ring's group")


def ring_attention(q, k, v, group=None, causal=False, softmax_scale=None, return_lse=False, block="flash", *,
                   document_ids=None, window=None, softcap=None, sinks=None, dropout_p=0.0):
    """Exact attention of this rank's queries over the whole sequence of the CP `group`.

    q (B, N, H, D), k and v (B, N, Hkv, D) are this rank's chunks, concatenated
    (model.context_parallel: chunks i and 2C-1-i, or with documents the balanced chunks of
    its context_parallel_batch); `group` is the CP process group (None: the default group), its
    rank order is the chunk order. `block` picks the per-block compute: 'flash' (our Triton
    kernel) or 'naive' (plain PyTorch, any float dtype). Masks, with causal=True:
    - document_ids: the local ids context_parallel_batch returns for the whole windows' ids
      (each token's document start; they bring the layout and the steps of the batch):
      a query sees only earlier keys of its own document, wherever they are held;
    - window: each query sees only the last `window` keys (itself included).
    softcap and sinks ((H,) logits, differentiable) as in kernels.flash_attention; dropout_p > 0 is
    refused (the ring runs no attention dropout).
    Returns out (B, N, H, D) in q's dtype and, with return_lse, the lse over the
    whole sequence (B, H, N), float32 (float64 for float64 inputs). Every rank of the
    group must call it with the same shapes and arguments.
    """
    if block not in BLOCKS:
        raise ValueError(f"ring_attention block {block!r} is not one of {', '.join(BLOCKS)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, local seqlen, heads, head_dim), "
                             f"got {tuple(getattr(t, 'shape', ()))}")
    if k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"ring_attention is self-attention: k and v must be (B, N, Hkv, D) with q's B, N, D; "
                         f"got q={tuple(q.shape)}, k={tuple(k.shape)}, v={tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"q has {q.shape[2]} heads, not a multiple of k's {k.shape[2]}")
    if q.shape[1] % 2:
        raise ValueError(f"local sequence length {q.shape[1]} is odd; each rank holds two equal chunks")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int (keys each query sees), got {window!r}")
    check_scores(q, 0.0, softcap, sinks)
    if dropout_p:
        raise ValueError(f"ring_attention runs no attention dropout, got dropout_p={dropout_p} "
                         "(train with model.attention_dropout=0 under context parallelism)")
    if (document_ids is not None or window is not None) and not causal:
        raise ValueError("ring_attention's document_ids and window need causal=True (each rank knows where its "
                         "queries' documents start, not where they end)")
    _check_group(group)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if document_ids is not None:
        steps = _document_steps(document_ids, window, rank, size)
    elif window is not None:
        steps = _window_steps(size, rank, q.shape[1], window, q.device)
    else:
        steps = causal_steps(rank, size, q.shape[1], bool(causal))
    out, lse = _ring_apply(q, k, v, group, steps, softmax_scale, BLOCKS[block], softcap, sinks)
    return (out, lse) if return_lse else out


@torch.compiler.disable
def _ring_apply(*args):
    """The ring runs eagerly under torch.compile: its point-to-point ops cannot be traced, and
    one clean graph break per attention layer beats dynamo stopping inside the loop."""
    return _RingAttention.apply(*args)
