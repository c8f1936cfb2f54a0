"""Full checkpointing's block inputs in host memory between the forward and the backward.

With activation_checkpointing=full a block keeps only its input x (B, T, d_model), but one per
layer adds up: twelve float32 residual streams are half of gpt2-small's million-token step.
With model.offload_activations the tensors a block saves that carry the sequence (its input, as
torch.utils.checkpoint saves it) go to pinned host memory through saved-tensor hooks, copied on
a side CUDA stream. In backward, fetching block i's input for its recomputation also starts the
copy back of block i-1's on that stream, so the copy overlaps block i's backward and at most two
block inputs are on the device at once. The last block's input is the first one backward needs,
so it stays on the device; fetching it (from itself) starts the copy back of the one before.

On the CPU there is no separate device memory: the "host copy" is a plain copy and the fetch
another, so the same bookkeeping runs in tests.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


class _Stored:
    """One saved tensor in host memory, and its copy back to the device once started."""

    __slots__ = ("host", "device", "previous", "back", "ready", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, previous: "_Stored | None"):
        self.host, self.device, self.previous = host, device, previous
        self.back: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None


class BlockInputOffload:
    """Saved-tensor hooks that keep one forward's block inputs in host memory (see module doc)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = _side_stream(device) if device.type == "cuda" else None
        # The block before, weakly: autograd alone decides how long a stored input lives.
        self._last = lambda: None
        self.offloaded_bytes = 0

    def around(self, x: torch.Tensor, keep: bool = False):
        """Context for one block call: what it saves with x's leading (B, T) goes to the host
        (with `keep`, it stays on the device but still starts the prefetch chain in backward);
        weights and other tensors without the sequence stay where they are."""
        lead = x.shape[:2]

        def pack(t: torch.Tensor):
            if t.dim() < 2 or t.shape[:2] != lead or t.device != self.device:
                return t
            if keep:
                stored = _Stored(None, t.device, self._last())
                stored.back = t
            else:
                stored = _Stored(self._to_host(t), t.device, self._last())
                self.offloaded_bytes += t.numel() * t.element_size()
            self._last = weakref.ref(stored)
            return stored

        return torch.autograd.graph.saved_tensors_hooks(pack, self._unpack)

    @torch.no_grad()
    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if self.stream is None:
            return t.detach().clone()
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(t.device))   # t is computed
        with torch.cuda.stream(self.stream):
            host.copy_(t.detach(), non_blocking=True)
        t.record_stream(self.stream)   # its memory is not reused before the copy has read it
        return host

    @torch.no_grad()
    def _fetch(self, stored: _Stored) -> None:
        """Start copying `stored` back to the device (on the side stream under CUDA)."""
        if self.stream is None:
            stored.back = stored.host.clone()
            return
        back = torch.empty(stored.host.shape, dtype=stored.host.dtype, device=stored.device)
        # `back` comes from the compute stream's pool: memory it may still be using
        self.stream.wait_stream(torch.cuda.current_stream(stored.device))
        with torch.cuda.stream(self.stream):
            back.copy_(stored.host, non_blocking=True)
            stored.ready = torch.cuda.Event()
            stored.ready.record(self.stream)
        stored.back = back

    def _unpack(self, stored):
        if not isinstance(stored, _Stored):
            return stored
        if stored.back is None:
            self._fetch(stored)
        if stored.ready is not None:
            torch.cuda.current_stream(stored.device).wait_event(stored.ready)
        back, stored.ready = stored.back, None
        if stored.host is not None:   # a kept tensor stays with its holder, a fetched one goes
            stored.back = None
        if stored.previous is not None and stored.previous.back is None:
            self._fetch(stored.previous)   # overlaps this block's backward
        return back


def block_offload(enabled: bool, x: torch.Tensor, n_blocks: int):
    """`context(i, x)` for block i of one forward: BlockInputOffload's hooks when `enabled`
    and a backward can follow (the last block's input kept on the device); otherwise none."""
    if not (enabled and torch.is_grad_enabled()):
        return lambda i, x: contextlib.nullcontext()
    offload = BlockInputOffload(x.device)
    return lambda i, x: offload.around(x, keep=i == n_blocks - 1)
