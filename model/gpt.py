"""A GPT-style decoder: embeddings -> pre-norm blocks -> final norm -> vocabulary head.

``build_model(cfg.model, vocab_size, attention, window=...)`` is the one way the rest of the
project makes a model; the attention name is already resolved (see model.attention) and the
sliding window (`attention.window`) is part of the function the weights are trained for.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.masks import document_bounds
from model.attention import check_score_options, get_attention, get_decode_attention
from model.config import GPTConfig
from model.kv_cache import KVCache
from model.layers import Block, init_block_, init_linear_, make_norm
from model.losses import at_least_float32, chunked_linear_cross_entropy
from model.offload import block_offload
from model.rope import rope_table

IGNORE_INDEX = -100


def document_positions(positions: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) positions counted from each token's document start: a packed document gets the
    positions it would have alone. On the device (the kernels' document_bounds), no host sync."""
    positions = positions.expand(document_ids.shape)
    start = document_bounds(document_ids)[:, 0].long()
    return positions - positions.gather(1, start)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, attention: str, window: int | None = None,
                 deterministic: bool = True, kernel="auto"):
        super().__init__()
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"attention.window={window!r}: must be null or an integer >= 1")
        check_score_options(attention, config.attention_softcap, config.attention_sinks, config.attention_dropout)
        self.config = config
        self.attention_name = attention
        self.drops_attention = config.attention_dropout > 0   # in training only (forward passes self.training)
        self.window = window   # each query sees the last `window` keys (Mistral's sliding window)
        # model.reset_positions from the document ids (model.context_parallel swaps in its own: there
        # a rank's ids are its tokens' document starts, as the documents may begin on another rank)
        self.document_positions = document_positions
        attention_fn = get_attention(attention, deterministic, kernel)
        self.decode_attention = get_decode_attention(attention)   # a static KV cache's one-token steps
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model) if config.pos_emb == "learned" else None
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, attention_fn) for _ in range(config.n_layer))
        self.norm_out = make_norm(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self._init_weights()

    def _init_weights(self) -> None:
        std = self.config.init_std
        nn.init.normal_(self.tok_emb.weight, mean=0.0, std=std)
        if self.pos_emb is not None:
            nn.init.normal_(self.pos_emb.weight, mean=0.0, std=std)
        for block in self.blocks:
            init_block_(block, std, self.config.n_layer)
        if not self.config.tie_embeddings:
            init_linear_(self.lm_head, std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                document_ids: torch.Tensor | None = None,
                positions: int | torch.Tensor | None = None, cache: KVCache | None = None,
                logits_to_keep: int = 0, reduction: str = "mean") -> torch.Tensor:
        """idx (B, T) -> logits (B, T, V); with targets (B, T) -> mean cross-entropy
        over the tokens whose target is not -100.

        Keyword-only, for packed windows, for tokens that are not 0..T-1 and for generation:
        - document_ids: (B, T) integers, a packed window's per-token document ids (a document is a
          run of equal ids, data/sampler.py's `return_doc_ids`); every token attends only to
          earlier tokens of its own document, and with `model.reset_positions` its position
          counts from its document's first token (computed on the device, no host sync); a
          context-parallel rank's are what context_parallel_batch hands it (its tokens' document
          starts, model.context_parallel);
        - positions: an int, the first token's position (default 0, or the cache's length), or a
          (T,) / (B, T) integer tensor of every token's true position (a context-parallel rank's
          chunks, model.context_parallel); RoPE and learned position embeddings use it;
        - cache: a KVCache (or StaticKVCache); these tokens' keys and values are added to it and
          attention reads all cached tokens (the new ones are the last rows of the causal mask);
        - logits_to_keep: > 0 returns only the last that many positions' logits (a long
          prompt's full logits would not fit);
        - reduction: "sum" returns the summed loss of the non-ignored tokens (a context-parallel
          rank's share, normalised by the whole sequence's token count: training.parallel.context).
        """
        self._check_call(document_ids, cache)
        positions = self._positions(idx, positions, document_ids, cache)
        x, rope = self._embed(idx, positions)
        if self.config.attention_length_scale is not None:
            rope = (*rope, self._log_keys_seen(positions, document_ids))
        x = self._run_blocks(x, rope, document_ids, cache)
        if targets is None:
            x = self.norm_out(x)
            return self.lm_head(x[:, -logits_to_keep:] if logits_to_keep > 0 else x)
        return self.head_loss(x, targets, reduction)

    def _check_call(self, document_ids: torch.Tensor | None, cache: KVCache | None) -> None:
        """What forward refuses before any work: a packed window decoded through a KV cache."""
        if document_ids is not None and cache is not None:
            raise ValueError("document_ids cannot be used with a KV cache: generation decodes one document "
                             "(split a packed prompt into its documents)")

    def _positions(self, idx: torch.Tensor, positions: int | torch.Tensor | None,
                   document_ids: torch.Tensor | None, cache: KVCache | None) -> torch.Tensor:
        """Every token's position as a (T,) or (B, T) tensor on idx's device, from forward's
        `positions` (None: after the cache's tokens, or from 0), counted from each document's start
        under `model.reset_positions`. A start past model.max_seq_len is refused here."""
        seq_len = idx.shape[1]
        if positions is None:
            positions = cache.next_positions(seq_len) if cache is not None else 0
        if isinstance(positions, int):
            if positions + seq_len > self.config.max_seq_len:
                raise ValueError(f"sequence length {positions + seq_len} exceeds "
                                 f"model.max_seq_len={self.config.max_seq_len}")
            positions = torch.arange(positions, positions + seq_len, device=idx.device)
        elif positions.dim() not in (1, 2) or positions.shape[-1] != seq_len:
            raise ValueError(f"positions of shape {tuple(positions.shape)} do not give one position "
                             f"per token of a {seq_len}-token sequence")
        else:
            positions = positions.to(idx.device)
        if document_ids is not None and self.config.reset_positions:
            positions = self.document_positions(positions, document_ids)
        return positions

    def _log_keys_seen(self, positions: torch.Tensor, document_ids: torch.Tensor | None) -> torch.Tensor:
        """log(n), n the keys each token's query sees: its position in its document + 1, at most the
        sliding window; (T, 1) or (B, T, 1) float32, split with the RoPE table it rides on."""
        if document_ids is not None and not self.config.reset_positions:
            positions = self.document_positions(positions, document_ids)
        seen = positions + 1 if self.window is None else (positions + 1).clamp(max=self.window)
        return seen.to(torch.float32).log()[..., None]

    def _embed(self, idx: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The token embeddings (plus learned position embeddings, after dropout) and the RoPE
        table the blocks rotate with (None with learned positions)."""
        x = self.tok_emb(idx)
        rope = None
        if self.pos_emb is None:
            rope = rope_table(positions, self.config.head_dim, self.config.rope_theta, self.config.rotated_pairs)
        else:
            x = x + self.pos_emb(positions)
        return self.dropout(x), rope

    def _run_blocks(self, x: torch.Tensor, rope: torch.Tensor | None, document_ids: torch.Tensor | None,
                    cache: KVCache | None) -> torch.Tensor:
        """The blocks in order: a training/eval pass (block inputs offloaded to the host with
        `model.offload_activations`), or a generation step through the KV cache, which then
        counts these tokens as cached."""
        if cache is None:
            offload = block_offload(self.config.offload_activations, x, len(self.blocks))
            for i, block in enumerate(self.blocks):
                with offload(i, x):
                    x = block(x, rope, document_ids, self.window, self.drops_attention and self.training)
            return x
        for layer, block in enumerate(self.blocks):
            x = block.forward_cached(x, rope, cache, layer, self.window, self.decode_attention)
        cache.advance(x.shape[1])
        return x

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """The final norm, the head and the cross-entropy of the blocks' output: a method of its
        own so that training can compile it apart from the blocks (under FSDP2)."""
        x = self.norm_out(x)
        if self.config.loss_chunk_size > 0:
            return chunked_linear_cross_entropy(
                x.flatten(0, 1), self.lm_head.weight, targets.flatten(), self.config.loss_chunk_size, IGNORE_INDEX,
                reduction
            )
        logits = self.lm_head(x)
        return F.cross_entropy(at_least_float32(logits.flatten(0, 1)), targets.flatten(), ignore_index=IGNORE_INDEX,
                               reduction=reduction)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameter count (a tied matrix counted once). With exclude_embeddings, only the
        blocks and final norm: no token/position tables and no head, tied or not
        (Kaplan et al.'s non-embedding N, the same for tied and untied models)."""
        total = sum(p.numel() for p in self.parameters())
        if not exclude_embeddings:
            return total
        vocab_matrices = {id(self.tok_emb.weight): self.tok_emb.weight, id(self.lm_head.weight): self.lm_head.weight}
        embedding = sum(p.numel() for p in vocab_matrices.values())
        if self.pos_emb is not None:
            embedding += self.pos_emb.weight.numel()
        return total - embedding

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward) at this sequence length.

        6 * N_matmul + 6 * n_layer * d_model * seq_len, where
        - N_matmul = num_params(exclude_embeddings=True) + vocab_size * d_model: every
          weight that takes part in a matmul (blocks and head; lookups are free), 2 FLOPs
          per weight per token forward, 4 backward;
        - attention scores and the weighted sum take 2 * 2 * d_model * seq_len FLOPs per
          token per layer forward, times 3 with backward: 12 * n_layer * d_model * seq_len,
          halved because causal attention skips the masked half (as causal kernels do).
        Activation-checkpointing recomputation is not counted (MFU counts model FLOPs).
        """
        c = self.config
        n_matmul = self.num_params(exclude_embeddings=True) + c.vocab_size * c.d_model
        return 6.0 * n_matmul + 12.0 * c.n_layer * c.d_model * seq_len / 2


def build_model(cfg_model, vocab_size: int, attention: str, window: int | None = None,
                deterministic: bool = True, kernel="auto") -> GPT:
    """GPT from the `model` config node, the tokenizer's vocabulary size, a resolved
    attention name (naive | sdpa | flash), `attention.window` (None: full causal attention),
    `attention.deterministic` (which backward our kernel runs) and our kernel's words (one for both
    directions or a (forward, backward) pair, model/attention.py's get_attention); raises
    ValueError naming a bad config value."""
    return GPT(GPTConfig.from_cfg(cfg_model, vocab_size), attention, window, deterministic, kernel)
