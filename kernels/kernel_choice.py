"""Which kernels compute flash_attention: `kernel="auto" | "triton" | "gluon"`.

- "triton": kernels/flash_fwd.py and flash_bwd.py, which run everywhere Triton does (and in its
  CPU interpreter) and cover every head dim, dtype, mask and window.
- "gluon": kernels/gluon_fwd.py and gluon_bwd.py, the Hopper kernels, forward and backward. Where
  they cannot run (no CUDA, not sm_90, float32, a head dim other than 64/128, document masks or
  windows, a view TMA cannot read) this is a one-line ValueError naming why, never a silent switch
  to the other kernel.
- "auto": the Gluon forward where it is implemented and was measured faster than Triton's on the
  H200 (`_measured_faster`, from the rounds in benchmarks/gluon/gluon_fwd_h200_rounds.md), Triton's
  elsewhere; and always the Triton backward, which was measured faster than the Gluon one at every
  shape (benchmarks/gluon/gluon_bwd_h200_rounds.md: the Gluon backward is 0.58-0.75x cuDNN's, the
  Triton one faster still).

Both forwards write the same log-sum-exp, so either backward follows either forward.
"""
from __future__ import annotations

import torch

from kernels import gluon_fwd

KERNELS = ("auto", "triton", "gluon")

# (head_dim, causal) -> the shortest sequence from which the Gluon forward was measured faster than the
# Triton one on the H200. D = 128: 1.2x from T = 1K (benchmarks/gluon/gluon_fwd_h200_rounds.md,
# rounds 2-3). D = 64 causal: from 16K only; at 4K the forward alone was 1.02-1.11x there, but in the
# training setting (fused-QKV views, with the backward) it lost: forward 0.36-0.46 ms against
# Triton's 0.28, forward + backward 1.01x slower, and gpt2-small's bare training step 363K against
# 370K tokens/s (benchmarks/attention/attention_h200_training_auto.md,
# benchmarks/training/train_h200_kernels.md). Non-causal was measured at 16K only (1.03x). Shorter
# sequences and cells never measured stay on Triton.
GLUON_FROM_LENGTH = {(128, True): 1024, (128, False): 16384, (64, True): 16384, (64, False): 16384}


def _measured_faster(head_dim: int, causal: bool, length: int) -> bool:
    return length >= GLUON_FROM_LENGTH.get((head_dim, causal), float("inf"))


def check_kernel(kernel) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    return kernel


def resolve_kernel(kernel: str, device, dtype: torch.dtype, head_dim: int, causal: bool, masked: bool,
                   length: int) -> str:
    """'triton' or 'gluon' for a setting known before any tensor exists (a model's config, `length`
    its sequence length): the rules of `choose_kernel` without the per-tensor stride check."""
    refusal = gluon_fwd.setting_refusal(device, dtype, head_dim, masked)
    return _decide(check_kernel(kernel), refusal, head_dim, causal, length, "this setting")


def choose_kernel(kernel: str, q, k, v, causal: bool, masked: bool) -> str:
    """'triton' or 'gluon' for one call; raises ValueError if kernel='gluon' cannot take it."""
    if check_kernel(kernel) == "triton":
        return kernel
    return _decide(kernel, gluon_fwd.unsupported(q, k, v, masked), q.shape[-1], causal, max(q.shape[1], k.shape[1]))


def _decide(kernel: str, refusal: str | None, head_dim: int, causal: bool, length: int, what: str = "this call") -> str:
    if kernel == "gluon" and refusal is not None:
        raise ValueError(f"kernel='gluon' cannot run {what}: {refusal} (kernel='triton' can)")
    if kernel == "auto":
        return "gluon" if refusal is None and _measured_faster(head_dim, causal, length) else "triton"
    return kernel
