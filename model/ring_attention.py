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

Without a causal mask every step is a full non-causal call. Grouped-query attention sends
only the Hkv key/value heads. The backward reruns the same blocks with the block backward
given the merged (global) out and lse, which yields each block's exact share of the
gradients; dq accumulates locally, dK/dV accumulate on a buffer that travels the ring with
its K/V and arrives back at its owner after C hops.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from kernels import attention_reference, attention_reference_backward, flash_attention, flash_attention_backward


@dataclass(frozen=True)
class BlockAttention:
    """The per-block compute a ring runs: forward (q, k, v, causal, softmax_scale) ->
    (out, lse) and backward (dout, q, k, v, out, lse, causal, softmax_scale) -> (dq, dk, dv)."""
    forward: Callable
    backward: Callable


# Keyed like the attention registry: our Triton kernel, and the plain-PyTorch formula
# (float64-capable, the CPU oracle). SDPA returns no lse and cannot serve as a block.
BLOCKS: dict[str, BlockAttention] = {
    "flash": BlockAttention(partial(flash_attention, return_lse=True), flash_attention_backward),
    "naive": BlockAttention(partial(attention_reference, return_lse=True), attention_reference_backward),
}


def _step_blocks(step: int, rank: int, size: int, n_local: int, causal: bool):
    """(query rows, key rows, causal) of the one block call of ring step `step`, or the
    whole local tensors when nothing is masked; see the module docstring for the cases."""
    every = slice(None)
    if not causal:
        return every, every, False
    if step == 0:
        return every, every, True
    src = (rank - step) % size
    half = n_local // 2
    if src < rank:
        return every, slice(0, half), False
    return slice(half, None), every, False


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


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, softmax_scale, block):
        ring = _Ring(group)
        acc = torch.promote_types(q.dtype, torch.float32)
        n_local = q.shape[1]
        kv = torch.stack((k, v))           # one contiguous buffer of the K/V heads to pass on
        out = lse = None
        for step in range(ring.size):
            if step + 1 < ring.size:
                next_kv, pending = ring.start(kv, _KV_TAG)
            rows, cols, block_causal = _step_blocks(step, ring.rank, ring.size, n_local, causal)
            part_out, part_lse = block.forward(q[:, rows], kv[0][:, cols], kv[1][:, cols],
                                               causal=block_causal, softmax_scale=softmax_scale)
            if out is None:                # step 0 covers every query row
                out, lse = part_out.to(acc), part_lse.to(acc)
            else:
                _merge_(out, lse, part_out, part_lse, rows)
            if step + 1 < ring.size:
                ring.wait(pending)
                kv = next_kv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.softmax_scale, ctx.block = group, causal, softmax_scale, block
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        ring, block = _Ring(ctx.group), ctx.block
        acc = torch.promote_types(q.dtype, torch.float32)
        n_local = q.shape[1]
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack((k, v))
        dkv = dkv_pending = None
        for step in range(ring.size):
            if step + 1 < ring.size:
                next_kv, kv_pending = ring.start(kv, _KV_TAG)
            rows, cols, block_causal = _step_blocks(step, ring.rank, ring.size, n_local, ctx.causal)
            dq_part, dk_part, dv_part = block.backward(
                dout[:, rows], q[:, rows], kv[0][:, cols], kv[1][:, cols], out[:, rows], lse[:, :, rows],
                causal=block_causal, softmax_scale=ctx.softmax_scale)
            dq[:, rows] += dq_part
            if dkv_pending is None:        # this K/V's gradient buffer starts here
                dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
            else:                          # ... or arrived from the previous rank with its K/V
                ring.wait(dkv_pending)
                dkv = dkv_recv
            dkv[0][:, cols] += dk_part
            dkv[1][:, cols] += dv_part
            if ring.size > 1:              # after the last hop each buffer is back at its owner
                dkv_recv, dkv_pending = ring.start(dkv, _DKV_TAG)
            if step + 1 < ring.size:
                ring.wait(kv_pending)
                kv = next_kv
        if dkv_pending is not None:
            ring.wait(dkv_pending)
            dkv = dkv_recv
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _check_group(group) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("ring_attention needs torch.distributed initialised (init_process_group) for its group")
    if dist.get_rank(group) < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the ring's group")


def ring_attention(q, k, v, group=None, causal=False, softmax_scale=None, return_lse=False, block="flash"):
    """Exact attention of this rank's queries over the whole sequence of the CP `group`.

    q (B, N, H, D), k and v (B, N, Hkv, D) are this rank's two chunks i and 2C-1-i,
    concatenated (model.context_parallel.split_for_context_parallel); `group` is the CP
    process group (None: the default group), its rank order is the chunk order. `block` picks the
    per-block compute: 'flash' (our Triton kernel) or 'naive' (plain PyTorch, any float
    dtype). Returns out (B, N, H, D) in q's dtype and, with return_lse, the lse over the
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
    _check_group(group)
    out, lse = _ring_apply(q, k, v, group, bool(causal), softmax_scale, BLOCKS[block])
    return (out, lse) if return_lse else out


@torch.compiler.disable
def _ring_apply(*args):
    """The ring runs eagerly under torch.compile: its point-to-point ops cannot be traced, and
    one clean graph break per attention layer beats dynamo stopping inside the loop."""
    return _RingAttention.apply(*args)
