"""Keys and values of the tokens seen so far, so generation runs each new token through the model once.

One buffer pair per layer, (B, max_len, Hkv, D), allocated on the first write in the dtype and
on the device the keys come in (the autocast dtype on a GPU), and filled left to right.

`KVCache` hands attention the filled part as a strided view (no copy), with the new queries as
the last rows of a causal mask aligned bottom-right, the contract every registered attention
keeps, so the prompt is prefilled in one call and later tokens are appended one at a time.
Each step's shapes grow with the cache.

`StaticKVCache` keeps a decode step's shapes and addresses fixed, so the step can be captured
once as a CUDA graph and replayed (model/generation.py): the prompt is prefilled as above, but
a one-token step writes its keys at a position held on the device and attends over the whole
buffer through the attention's decode entry (model/attention.py: DECODE), which reads how many
keys are valid on the device too. The buffers start as zeros: unwritten slots are masked out,
and zeros keep a masked product from ever meeting a NaN.
"""
from __future__ import annotations

import torch


class KVCache:
    static = False

    def __init__(self, n_layer: int, batch_size: int, max_len: int):
        if max_len < 1 or batch_size < 1:
            raise ValueError(f"a KV cache needs a positive batch size and length, got {batch_size} x {max_len}")
        self.batch_size, self.max_len = batch_size, max_len
        self.length = 0   # tokens already in the cache; the next token's position
        self._keys: list[torch.Tensor | None] = [None] * n_layer
        self._values: list[torch.Tensor | None] = [None] * n_layer

    def _buffers(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, new = k.shape[0], k.shape[1]
        if batch != self.batch_size:
            raise ValueError(f"batch of {batch} sequences, the KV cache holds {self.batch_size}")
        if self.length + new > self.max_len:
            raise ValueError(f"{self.length + new} tokens do not fit the KV cache of {self.max_len}")
        if self._keys[layer] is None:
            shape = (self.batch_size, self.max_len, *k.shape[2:])
            self._keys[layer] = torch.zeros(shape, dtype=k.dtype, device=k.device)
            self._values[layer] = torch.zeros(shape, dtype=v.dtype, device=v.device)
        return self._keys[layer], self._values[layer]

    def next_positions(self, new_tokens: int) -> int | torch.Tensor:
        """The position of the first of `new_tokens` (what GPT.forward feeds RoPE)."""
        return self.length

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write this step's k, v (B, T, Hkv, D) after the cached ones; return views of all of
        them and None (no device-side length: attend to the views as they are).

        `length` moves on only in `advance`, once every layer has written the step."""
        keys, values = self._buffers(layer, k, v)
        end = self.length + k.shape[1]
        keys[:, self.length:end] = k
        values[:, self.length:end] = v
        return keys[:, :end], values[:, :end], None

    def advance(self, new_tokens: int) -> None:
        self.length += new_tokens


class StaticKVCache(KVCache):
    """A KVCache whose one-token steps have fixed shapes: `position` (a device tensor) says where
    the next token goes; `length` mirrors it on the host for bounds checks and the prefill."""

    static = True

    def __init__(self, n_layer: int, batch_size: int, max_len: int, device: torch.device | str):
        super().__init__(n_layer, batch_size, max_len)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self._valid: torch.Tensor | None = None   # position + 1 during a decode step, for every layer

    def next_positions(self, new_tokens: int) -> int | torch.Tensor:
        if new_tokens > 1:
            return self.length   # the prefill: eager, host-indexed like KVCache
        return self.position

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Prefill (several tokens): as KVCache. A one-token step: k, v written at `position`;
        returns the whole buffers and the number of valid keys (a device tensor)."""
        if k.shape[1] > 1:
            return super().append(layer, k, v)
        keys, values = self._buffers(layer, k, v)
        keys.index_copy_(1, self.position, k)
        values.index_copy_(1, self.position, v)
        if layer == 0:
            self._valid = self.position + 1
        return keys, values, self._valid

    def advance(self, new_tokens: int) -> None:
        super().advance(new_tokens)
        self.position += new_tokens
