"""Autoregressive decoding: prefill the prompt into a KV cache, then one token per model call.

`decode` yields each step's logits and chosen tokens and leaves stopping to the caller (a stop
string is a property of the decoded text, not of one token). How a step runs (`mode`):

- "eager": a KVCache whose views grow with the sequence, every kernel launched from Python;
- "static": a StaticKVCache, so a one-token step has fixed shapes (its attention is the
  implementation's decode entry over the whole buffer, the valid length on the device);
- "graph" (CUDA): the static step captured once as a CUDA graph and replayed: one launch
  instead of a few hundred, which is what bounds a small model's decoding on a GPU.

"static" and "graph" run the same kernels, so they give the same logits to the bit; against
"eager" they differ only by the attention's summation order. With `use_cache=False` every step
reruns the whole sequence instead: the slow reference the caches are tested against.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch

from model.kv_cache import KVCache, StaticKVCache

MODES = ("eager", "static", "graph")


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy (argmax); top_k 0 and top_p 1.0 keep every token."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature={self.temperature} must be a finite number >= 0 (0: greedy)")
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


class CudaGraphStep:
    """One-token decode steps of `model` over a StaticKVCache, captured once as a CUDA graph.

    Before capture the step runs twice on a side stream (cuBLAS workspaces, Triton compilation),
    each time writing a scratch key at the cache's next slot, which the first real step
    overwrites; the position is put back after each. Calling the step copies the tokens into
    the graph's input, replays it (which advances the cache's device position) and moves the
    host mirror on; the logits it returns are the graph's own buffer, rewritten by the next call.
    """

    def __init__(self, model, cache: StaticKVCache, tokens: torch.Tensor):
        self.model, self.cache = model, cache
        self.tokens = tokens.clone()
        position, length = cache.position.clone(), cache.length
        side = torch.cuda.Stream(tokens.device)
        side.wait_stream(torch.cuda.current_stream(tokens.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                model(self.tokens, cache=cache, logits_to_keep=1)
                cache.position.copy_(position)
                cache.length = length
        torch.cuda.current_stream(tokens.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = model(self.tokens, cache=cache, logits_to_keep=1)
        cache.length = length   # capture ran no kernel: only the host mirror moved

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.cache.length >= self.cache.max_len:
            raise ValueError(f"{self.cache.length + 1} tokens do not fit the KV cache of {self.cache.max_len}")
        self.tokens.copy_(tokens)
        self.graph.replay()
        self.cache.length += 1
        return self.logits


@torch.no_grad()
def decode(model, prompt: torch.Tensor, max_new_tokens: int, sampling: Sampling = Sampling(), *,
           generator: torch.Generator | None = None, vocab_size: int | None = None,
           use_cache: bool = True, mode: str = "eager") -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (logits (B, V) float32, next tokens (B,)) for up to max_new_tokens steps.

    prompt (B, T) token ids, every row the same length (the attention functions take no padding
    mask). vocab_size masks the head's rows past the tokenizer's (padding, never trained).
    Prompt plus new tokens must fit model.max_seq_len, refused here before any work. `mode`:
    eager | static | graph (see the module's docstring; graph needs CUDA).
    """
    batch, prompt_len = prompt.shape
    limit = model.config.max_seq_len
    if prompt_len < 1:
        raise ValueError("the prompt is empty: give at least one token")
    if prompt_len > limit:
        raise ValueError(f"the prompt has {prompt_len} tokens, more than the model's context "
                         f"(model.max_seq_len={limit})")
    if mode not in MODES:
        raise ValueError(f"decode mode {mode!r}: expected one of {', '.join(MODES)}")
    if mode == "graph" and prompt.device.type != "cuda":
        raise ValueError(f"decode mode 'graph' needs a CUDA device (the prompt is on {prompt.device}); "
                         "use 'static' or 'eager'")
    max_new_tokens = min(max_new_tokens, limit - prompt_len)
    cache = None
    if use_cache:
        size = (model.config.n_layer, batch, prompt_len + max_new_tokens)
        cache = KVCache(*size) if mode == "eager" else StaticKVCache(*size, device=prompt.device)
    tokens, step_input, graph_step = prompt, prompt, None
    for i in range(max_new_tokens):
        if graph_step is not None:
            out = graph_step(step_input)
        elif mode == "graph" and i > 0:   # the first one-token step: capture it
            graph_step = CudaGraphStep(model, cache, step_input)
            out = graph_step(step_input)
        else:
            out = model(step_input if use_cache else tokens, cache=cache, logits_to_keep=1)
        logits = out[:, -1].to(torch.float32, copy=True)   # a graph's output buffer is rewritten next step
        if vocab_size is not None and vocab_size < logits.shape[-1]:
            logits[:, vocab_size:] = float("-inf")
        chosen = next_tokens(logits, sampling, generator)
        yield logits, chosen
        step_input = chosen[:, None]
        if not use_cache:
            tokens = torch.cat([tokens, step_input], dim=1)
