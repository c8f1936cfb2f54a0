"""Keys and values of the tokens seen so far, so generation runs each new token through the model once.

One buffer pair per layer, (B, max_len, Hkv, D), allocated on the first write in the dtype and
on the device the keys come in (the autocast dtype on a GPU), and filled left to right. The
attention functions take the filled part as a strided view (no copy) with the new queries as
the last rows of a causal mask aligned bottom-right, the contract every registered attention
keeps, so the prompt is prefilled in one call and later tokens are appended one at a time.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layer: int, batch_size: int, max_len: int):
        if max_len < 1 or batch_size < 1:
            raise ValueError(f"a KV cache needs a positive batch size and length, got {batch_size} x {max_len}")
        self.batch_size, self.max_len = batch_size, max_len
        self.length = 0   # tokens already in the cache; the next token's position
        self._keys: list[torch.Tensor | None] = [None] * n_layer
        self._values: list[torch.Tensor | None] = [None] * n_layer

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's k, v (B, T, Hkv, D) after the cached ones; return views of all of them.

        `length` moves on only in `advance`, once every layer has written the step."""
        batch, new = k.shape[0], k.shape[1]
        if batch != self.batch_size:
            raise ValueError(f"batch of {batch} sequences, the KV cache holds {self.batch_size}")
        end = self.length + new
        if end > self.max_len:
            raise ValueError(f"{end} tokens do not fit the KV cache of {self.max_len}")
        if self._keys[layer] is None:
            shape = (self.batch_size, self.max_len, *k.shape[2:])
            self._keys[layer] = torch.empty(shape, dtype=k.dtype, device=k.device)
            self._values[layer] = torch.empty(shape, dtype=v.dtype, device=v.device)
        keys, values = self._keys[layer], self._values[layer]
        keys[:, self.length:end] = k
        values[:, self.length:end] = v
        return keys[:, :end], values[:, :end]

    def advance(self, new_tokens: int) -> None:
        self.length += new_tokens

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._keys, *self._values) if t is not None)
