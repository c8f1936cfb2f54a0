"""The pieces of a pre-norm decoder block: norm, attention, MLP, and the block itself.

A block is split in three stages so activation checkpointing can choose what to keep:
``pre_attention`` (norm, fused QKV projection, RoPE), the attention kernel, and
``post_attention`` (output projection, residual, norm, MLP, residual).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from model.attention import AttentionFn
from model.config import GPTConfig
from model.rope import apply_rope


def make_norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.d_model, eps=config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)


class CausalSelfAttention(nn.Module):
    """Grouped-query self-attention with one fused QKV projection.

    q, k and v are strided views into the projection's output, handed to the attention
    function as they are (it accepts any strides); only RoPE makes new q and k tensors.
    Attention probabilities are not dropped out: the kernels compute exact attention.
    """

    def __init__(self, config: GPTConfig, attention: AttentionFn):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        qkv_width = (config.n_head + 2 * config.n_kv_head) * config.head_dim
        self.qkv = nn.Linear(config.d_model, qkv_width, bias=config.bias)
        self.proj = nn.Linear(config.n_head * config.head_dim, config.d_model, bias=config.bias)
        self.attention = attention

    def project(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, d_model) -> q (B, T, H, D), k and v (B, T, Hkv, D)."""
        q, k, v = self.qkv(x).split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim], dim=-1
        )
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in (q, k, v))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k, v


class MLP(nn.Module):
    """GELU (GPT-2) or SwiGLU (Shazeer 2020; gate and up projections fused in one matmul)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.gated = config.mlp == "swiglu"
        self.up = nn.Linear(config.d_model, (2 if self.gated else 1) * config.d_ff, bias=config.bias)
        self.proj = nn.Linear(config.d_ff, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = self.up(x).chunk(2, dim=-1)
            return self.proj(F.silu(gate) * up)
        return self.proj(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(x)), with optional activation checkpointing.

    - ``none``: autograd keeps every intermediate.
    - ``full``: only the block input is kept; backward reruns the whole block.
    - ``selective``: everything but the attention kernel is recomputed. The kernel keeps
      what its own backward needs (q, k, v, output, and for flash the log-sum-exp: O(T)
      memory), so backward never reruns the O(T^2) attention forward, while the wide
      MLP interior, the norms and the projections (cheap to redo) are dropped.
    """

    def __init__(self, config: GPTConfig, attention: AttentionFn):
        super().__init__()
        self.norm_attn = make_norm(config)
        self.attn = CausalSelfAttention(config, attention)
        self.norm_mlp = make_norm(config)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)
        self.checkpointing = config.activation_checkpointing

    def pre_attention(self, x, rope):
        return self.attn.project(self.norm_attn(x), rope)

    def post_attention(self, x, y):
        x = x + self.dropout(self.attn.proj(y.flatten(2)))
        return x + self.dropout(self.mlp(self.norm_mlp(x)))

    def attend(self, q, k, v, document_ids=None, window=None, causal=True):
        """The attention call; the masks are passed only when set (the ring takes none)."""
        masks = {name: m for name, m in (("document_ids", document_ids), ("window", window)) if m is not None}
        return self.attn.attention(q, k, v, causal=causal, **masks)

    def _forward(self, x, rope, document_ids=None, window=None):
        return self.post_attention(x, self.attend(*self.pre_attention(x, rope), document_ids, window))

    def forward_cached(self, x: torch.Tensor, rope, cache, layer: int, window=None) -> torch.Tensor:
        """The block for generation: x's keys and values join `cache`, queries attend to all of it.
        One new token sees every cached key, so its attention needs no causal mask (a sliding
        window is causal, aligned bottom-right: the new rows of the mask)."""
        q, k, v = self.pre_attention(x, rope)
        k, v = cache.append(layer, k, v)
        return self.post_attention(x, self.attend(q, k, v, window=window,
                                                  causal=q.shape[1] > 1 or window is not None))

    def forward(self, x: torch.Tensor, rope, document_ids=None, window=None) -> torch.Tensor:
        """document_ids (B, T) and window (int) as in kernels.flash_attention, None: not masked."""
        if self.checkpointing == "full":
            return checkpoint(self._forward, x, rope, document_ids, window, use_reentrant=False)
        if self.checkpointing == "selective":
            q, k, v = checkpoint(self.pre_attention, x, rope, use_reentrant=False)
            y = self.attend(q, k, v, document_ids, window)
            return checkpoint(self.post_attention, x, y, use_reentrant=False)
        return self._forward(x, rope, document_ids, window)


def init_linear_(module: nn.Linear, std: float) -> None:
    nn.init.normal_(module.weight, mean=0.0, std=std)
    if module.bias is not None:
        nn.init.zeros_(module.bias)


def init_block_(block: Block, std: float, n_layer: int) -> None:
    """GPT-2 init: N(0, std) weights, zero biases, and the two projections that write into
    the residual stream scaled by 1/sqrt(2 * n_layer) so its variance does not grow with depth."""
    init_linear_(block.attn.qkv, std)
    init_linear_(block.mlp.up, std)
    for residual_proj in (block.attn.proj, block.mlp.proj):
        init_linear_(residual_proj, std / math.sqrt(2 * n_layer))
