"""Throughput and model FLOPs utilisation (MFU).

MFU = achieved model FLOP/s / the accelerator's peak dense bf16 FLOP/s, with the model's
FLOPs per token from `model.flops_per_token(seq_len)` (attention included, causal halved).
"""
from __future__ import annotations

import time

import torch

# Dense (no sparsity) bf16 tensor-core peaks, FLOP/s, from the vendors' data sheets.
# Matched by substring, first match wins (specific names first); of torch.cuda.get_device_name(); override with trainer.peak_flops.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "RTX 4090": 165e12,
}


def peak_flops(device: torch.device, override: float | None) -> float | None:
    """Peak FLOP/s for MFU, or None where it is not known (CPU, an unlisted GPU, no override)."""
    if override:
        return float(override)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in name:
            return flops
    return None


def mfu(tokens_per_s: float, flops_per_token: float, peak: float, devices: int = 1) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak FLOP/s of `devices` accelerators
    (`peak` each, e.g. 989e12 for dense bf16 on an H100/H200)."""
    return tokens_per_s * flops_per_token / (peak * devices)


class Throughput:
    """Tokens per second over the interval since the last call (the caller syncs the device)."""

    def __init__(self) -> None:
        self._time = time.perf_counter()
        self._tokens = 0

    def add(self, tokens: int) -> None:
        self._tokens += tokens

    def restart(self) -> None:
        self._time, self._tokens = time.perf_counter(), 0

    def rate(self) -> float:
        now = time.perf_counter()
        rate = self._tokens / max(now - self._time, 1e-9)
        self._time, self._tokens = now, 0
        return rate
