"""Cross-entropy over the vocabulary head without materialising the whole logits matrix.

For T tokens and vocabulary V the (T, V) logits dominate memory at long context
(a million tokens x 50K vocab is 100 GB in bf16). `chunked_linear_cross_entropy` walks
the tokens in chunks: each chunk's logits are formed, turned into its loss and into
its gradients with respect to the hidden states and the head weight (softmax minus
one-hot), and freed before the next chunk. Gradients are therefore finished during
forward (no recomputation in backward; same matmul count as the unchunked loss), and
peak extra memory is O(chunk_size * V) plus one gradient the size of the head.
"""
from __future__ import annotations

import torch


def at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """Softmax statistics in float32 (or float64 when the model is float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _chunk_logits_and_loss(hidden_chunk, weight, target_chunk, ignore_index):
    """Logits (at least float32) of one chunk and the summed loss of its non-ignored tokens."""
    logits = at_least_float32(hidden_chunk @ weight.t())
    valid = target_chunk != ignore_index
    safe_target = target_chunk.masked_fill(~valid, 0)
    target_logit = logits.gather(1, safe_target[:, None]).squeeze(1)
    lse = torch.logsumexp(logits, dim=-1)
    return logits, lse, safe_target, valid, ((lse - target_logit) * valid).sum()


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, ignore_index, reduction):
        count = (targets != ignore_index).sum() if reduction == "mean" else torch.ones((), device=hidden.device)
        accumulate_dtype = torch.promote_types(hidden.dtype, torch.float32)
        loss = torch.zeros((), device=hidden.device, dtype=accumulate_dtype)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=accumulate_dtype)
        weight_for_grad = weight.to(hidden.dtype)
        for start in range(0, hidden.shape[0], chunk_size):
            hidden_chunk = hidden[start:start + chunk_size]
            logits, lse, safe_target, valid, chunk_loss = _chunk_logits_and_loss(
                hidden_chunk, weight, targets[start:start + chunk_size], ignore_index
            )
            loss += chunk_loss
            # d(loss_sum)/d(logits) = softmax - one_hot, zero on ignored rows; in place on the logits.
            grad_logits = logits.sub_(lse[:, None]).exp_()
            grad_logits[torch.arange(len(safe_target), device=hidden.device), safe_target] -= 1.0
            grad_logits *= valid[:, None]
            grad_logits = grad_logits.to(hidden.dtype)
            grad_hidden[start:start + chunk_size] = grad_logits @ weight_for_grad
            grad_weight += grad_logits.t() @ hidden_chunk
        ctx.save_for_backward(grad_hidden, grad_weight, count)
        ctx.weight_dtype = weight.dtype
        return loss / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight, count = ctx.saved_tensors
        scale = grad_loss / count
        return (grad_hidden * scale.to(grad_hidden.dtype), (grad_weight * scale).to(ctx.weight_dtype),
                None, None, None, None)


def chunked_linear_cross_entropy(hidden, weight, targets, chunk_size: int, ignore_index: int = -100,
                                 reduction: str = "mean"):
    """Mean (or with reduction="sum", summed) cross-entropy of softmax(hidden @ weight.T) against
    targets, chunk_size tokens at a time.

    hidden (N, d), weight (V, d), targets (N,) int64; tokens whose target is ignore_index
    are left out. Equal (loss and gradients) to ``F.cross_entropy(at_least_float32(hidden @
    weight.T), targets, ignore_index=ignore_index, reduction=reduction)``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        # No backward coming: skip the gradient matmuls.
        total = sum(
            _chunk_logits_and_loss(hidden[s:s + chunk_size], weight, targets[s:s + chunk_size], ignore_index)[-1]
            for s in range(0, hidden.shape[0], chunk_size)
        )
        return total / (targets != ignore_index).sum() if reduction == "mean" else total
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk_size, ignore_index, reduction)
