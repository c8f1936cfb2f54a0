"""The pieces of a pre-norm decoder block: norm, attention, MLP, and the block itself.

A block is split in three stages so activation checkpointing can choose what to keep:
``pre_attention`` (norm, fused QKV projection, RoPE), the attention kernel, and
``post_attention`` (output projection, residual, norm, MLP, residual). The two outer stages
are per-token, so with ``block_chunk_size`` they run over the sequence a chunk at a time,
each chunk checkpointed (`per_token_chunks`).
"""
from __future__ import annotations

import itertools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from kernels.rotary import rotary_qkv
from model.attention import AttentionFn
from model.config import GPTConfig
from model.rope import apply_rope, fuses_rotary


def _split_sequence(arg, size: int):
    """The sequence chunks of one stage argument: (B, T, ...) tensors along dim 1, the RoPE
    table (cos, sin), each (T, D/2) or (B, T, D/2), along its T dim; None stays None."""
    if arg is None:
        return itertools.repeat(None)
    if isinstance(arg, tuple):
        return zip(*(t.split(size, dim=-2) for t in arg))
    return arg.split(size, dim=1)


def _contiguous(fn):
    """fn with its outputs made contiguous, so a chunk's output is not a view that keeps the
    chunk's whole intermediate alive (v is a view into the fused QKV projection)."""
    def run(*args):
        out = fn(*args)
        return tuple(t.contiguous() for t in out) if isinstance(out, tuple) else out.contiguous()
    return run


def per_token_chunks(fn, size: int, *args):
    """fn(*args) for a per-token fn, run over the sequence in chunks of `size` tokens, each
    chunk under its own activation checkpoint, outputs concatenated along the sequence.

    Only one chunk's interior (the MLP's 4 x d_model hidden, norm outputs, the projection
    before RoPE) exists at a time, forward or backward; what is kept is the inputs (already
    alive) and the outputs. Splitting is one `split` per input, so backward gathers each
    input's gradient with one concatenation instead of one full-size add per chunk. Equal to
    fn(*args) up to the rounding of a matmul over fewer rows.
    """
    # No RNG state to replay: chunks refuse dropout (GPTConfig), the only randomness in a block.
    parts = [checkpoint(_contiguous(fn), *chunk_args, use_reentrant=False, preserve_rng_state=False)
             for chunk_args in zip(*(_split_sequence(a, size) for a in args))]
    if not isinstance(parts[0], tuple):
        return torch.cat(parts, dim=1)
    outputs = []
    for i in range(len(parts[0])):   # one output at a time, its chunks freed as it is joined
        outputs.append(torch.cat([p[i] for p in parts], dim=1))
        parts = [tuple(None if j == i else t for j, t in enumerate(p)) for p in parts]
    return tuple(outputs)


def make_norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.d_model, eps=config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)


class CausalSelfAttention(nn.Module):
    """Grouped-query self-attention with one fused QKV projection.

    q, k and v are strided views into the projection's output, handed to the attention
    function as they are (it accepts any strides); only RoPE makes new q and k tensors.
    With `model.attention_sinks`, `sinks` holds one learned logit per query head (starting at 0)
    that joins each of its rows' softmax denominators; `model.attention_softcap` caps the scores.
    With `model.attention_length_scale` = L, each query is multiplied by s_h log(n), n the number of
    keys it sees (the RoPE table's third entry) and s_h a learned scale per head starting at
    1 / log(L): Scalable-Softmax (Nakanishi 2025), so that one key's weight among n need not fade as
    n grows, where a plain softmax spreads over every key a long prompt adds.
    """

    def __init__(self, config: GPTConfig, attention: AttentionFn):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        qkv_width = (config.n_head + 2 * config.n_kv_head) * config.head_dim
        self.qkv = nn.Linear(config.d_model, qkv_width, bias=config.bias)
        self.proj = nn.Linear(config.n_head * config.head_dim, config.d_model, bias=config.bias)
        self.sinks = nn.Parameter(torch.zeros(config.n_head)) if config.attention_sinks else None
        scale = config.attention_length_scale
        self.length_scale = None if scale is None else nn.Parameter(torch.full((config.n_head,), 1 / math.log(scale)))
        self.softcap = config.attention_softcap
        self.attention = attention

    def score_options(self) -> dict:
        """The attention call's soft cap and sinks keywords, those that are set."""
        options = {"softcap": self.softcap, "sinks": self.sinks}
        return {name: value for name, value in options.items() if value is not None}

    def project(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, d_model) -> q (B, T, H, D), k and v (B, T, Hkv, D)."""
        qkv = self.qkv(x)
        fused = rope is not None and fuses_rotary(qkv)
        if fused:   # q and k rotated into a new tensor that v joins: q, k, v stay slices of one tensor
            qkv = rotary_qkv(qkv, *rope[:2], self.n_head + self.n_kv_head, self.head_dim)
        q, k, v = qkv.split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim], dim=-1
        )
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in (q, k, v))
        if rope is not None and not fused:
            q, k = apply_rope(q, *rope[:2]), apply_rope(k, *rope[:2])
        if self.length_scale is not None:   # rope[2]: log(n), (T, 1) or (B, T, 1)
            q = q * (rope[2][..., None] * self.length_scale[:, None]).to(q.dtype)
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

    With ``block_chunk_size`` > 0 (either checkpointing mode) ``pre_attention`` and
    ``post_attention`` run over chunks of that many tokens, each chunk checkpointed on its
    own, so their interiors never exist for the whole sequence, not even while ``full``
    checkpointing recomputes the block in backward; attention itself sees the whole sequence.
    """

    def __init__(self, config: GPTConfig, attention: AttentionFn):
        super().__init__()
        self.norm_attn = make_norm(config)
        self.attn = CausalSelfAttention(config, attention)
        self.norm_mlp = make_norm(config)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)
        self.attention_dropout = config.attention_dropout
        self.checkpointing = config.activation_checkpointing
        self.chunk_size = config.block_chunk_size

    def pre_attention(self, x, rope):
        return self.attn.project(self.norm_attn(x), rope)

    def post_attention(self, x, y):
        x = x + self.dropout(self.attn.proj(y.flatten(2)))
        return x + self.dropout(self.mlp(self.norm_mlp(x)))

    def attend(self, q, k, v, document_ids=None, window=None, causal=True, drop=False):
        """The attention call; the masks, the soft cap and the sinks are passed only when set, and
        the attention dropout only when `drop` (training: GPT.drops_attention)."""
        masks = {name: m for name, m in (("document_ids", document_ids), ("window", window)) if m is not None}
        if drop:
            masks["dropout_p"] = self.attention_dropout
        return self.attn.attention(q, k, v, causal=causal, **masks, **self.attn.score_options())

    def _stage(self, fn, *args):
        """A per-token stage, over chunks when block_chunk_size is set."""
        return per_token_chunks(fn, self.chunk_size, *args) if self.chunk_size else fn(*args)

    def _recomputed(self, fn, *args):
        """A per-token stage recomputed in backward: checkpointed per chunk or as a whole."""
        return self._stage(fn, *args) if self.chunk_size else checkpoint(fn, *args, use_reentrant=False)

    def _forward(self, x, rope, document_ids=None, window=None, drop=False):
        y = self.attend(*self._stage(self.pre_attention, x, rope), document_ids, window, drop=drop)
        return self._stage(self.post_attention, x, y)

    def forward_cached(self, x: torch.Tensor, rope, cache, layer: int, window=None, decode=None) -> torch.Tensor:
        """The block for generation: x's keys and values join `cache`, queries attend to all of it.
        One new token sees every cached key, so its attention needs no causal mask (a sliding
        window is causal, aligned bottom-right: the new rows of the mask). A static cache's
        one-token step hands over its whole buffers and the valid length as a device tensor:
        `decode` (the attention's DECODE entry, model/attention.py) masks the rest."""
        q, k, v = self.pre_attention(x, rope)
        k, v, valid = cache.append(layer, k, v)
        if valid is not None:
            return self.post_attention(x, decode(q, k, v, valid, window=window, **self.attn.score_options()))
        return self.post_attention(x, self.attend(q, k, v, window=window,
                                                  causal=q.shape[1] > 1 or window is not None))

    def forward(self, x: torch.Tensor, rope, document_ids=None, window=None, drop=False) -> torch.Tensor:
        """document_ids (B, T) and window (int) as in kernels.flash_attention, None: not masked;
        drop: apply the attention dropout (full checkpointing replays its RNG state in backward)."""
        if self.checkpointing == "full":
            return checkpoint(self._forward, x, rope, document_ids, window, drop, use_reentrant=False)
        if self.checkpointing == "selective":
            q, k, v = self._recomputed(self.pre_attention, x, rope)
            y = self.attend(q, k, v, document_ids, window, drop=drop)
            return self._recomputed(self.post_attention, x, y)
        return self._forward(x, rope, document_ids, window, drop)


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
