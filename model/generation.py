"""Autoregressive decoding: prefill the prompt into a KV cache, then one token per model call.

`decode` yields each step's logits and chosen tokens and leaves stopping to the caller (a stop
string is a property of the decoded text, not of one token). With `use_cache=False` every step
reruns the whole sequence instead: the slow reference the cache is tested against.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from model.kv_cache import KVCache


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy (argmax); top_k 0 and top_p 1.0 keep every token."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0: greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0: no limit)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, V) logits -> (B,) token ids, by argmax or by sampling from the tempered, truncated softmax."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        # Nucleus: the smallest set of most likely tokens whose probability reaches top_p.
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs        # mass of the more likely tokens
        sorted_logits = sorted_logits.masked_fill(before >= sampling.top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def decode(model, prompt: torch.Tensor, max_new_tokens: int, sampling: Sampling = Sampling(), *,
           generator: torch.Generator | None = None, vocab_size: int | None = None,
           use_cache: bool = True) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (logits (B, V) float32, next tokens (B,)) for up to max_new_tokens steps.

    prompt (B, T) token ids, every row the same length (the attention functions take no padding
    mask). vocab_size masks the head's rows past the tokenizer's (padding, never trained).
    Prompt plus new tokens must fit model.max_seq_len, refused here before any work.
    """
    batch, prompt_len = prompt.shape
    limit = model.config.max_seq_len
    if prompt_len < 1:
        raise ValueError("the prompt is empty: give at least one token")
    if prompt_len > limit:
        raise ValueError(f"the prompt has {prompt_len} tokens, more than the model's context "
                         f"(model.max_seq_len={limit})")
    max_new_tokens = min(max_new_tokens, limit - prompt_len)
    cache = KVCache(model.config.n_layer, batch, prompt_len + max_new_tokens) if use_cache else None
    tokens, step_input = prompt, prompt
    for _ in range(max_new_tokens):
        logits = model(step_input if use_cache else tokens, cache=cache, logits_to_keep=1)[:, -1].float()
        if vocab_size is not None and vocab_size < logits.shape[-1]:
            logits[:, vocab_size:] = float("-inf")
        chosen = next_tokens(logits, sampling, generator)
        yield logits, chosen
        step_input = chosen[:, None]
        if not use_cache:
            tokens = torch.cat([tokens, step_input], dim=1)
