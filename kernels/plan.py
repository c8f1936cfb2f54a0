"""The kernel plan: which kernels compute a flash_attention call, decided in one place.

A plan names the forward and the backward separately, each as a kernel family (a row of
kernels/flash_op.py's FAMILIES) with its variant and, where it is fixed, its tile shape:

    forward=gluon-ws-pingpong-s4 (128x128), backward=triton-deterministic (autotuned)

- family "triton": kernels/flash_fwd.py and flash_bwd.py. Every GPU Triton runs on (and its CPU
  interpreter), every head dim, dtype, mask and window. Backward variants: "deterministic" (a dQ
  kernel and a dK/dV kernel, bit-identical gradients) and "atomic" (one kernel adding dQ with
  float32 atomics). Tiles autotuned per length band up to tuning.TUNE_MAX_TOKENS (kept on disk by
  Triton's cache), pinned past it or under FLASHTRAIN_AUTOTUNE=0.
- family "gluon": kernels/gluon/, the Hopper kernels; fixed tiles per head dim.

What decides it is a `Setting`: the GPU architecture, dtype, head dim, causal, the kind of mask,
the length, whether TMA can read q, k and v, determinism, what the call does to its scores besides
masking them (attention dropout, soft-capping, sinks: kernels/scores.py; both families compute all
three, and draw the same dropout mask, so a Gluon forward pairs with a Triton backward and the
other way round), and the user's word for each direction:
"triton" or "gluon" (run that family, or refuse in one line why it cannot), "auto" (the Gluon
kernel where it runs and was measured faster on the H200, from the lengths in GLUON_FROM; the
Triton kernel elsewhere). `plan_kernels(setting)` is cached: a training run asks it once per
shape. `call_setting` makes the Setting of one call, `Setting(...)` directly that of a config
before any tensor exists (training/builders.py), so a run logs and records the plan its calls use.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels import gluon, tuning
from kernels.checks import device_arch
from kernels.choices import CHOICES
DIRECTIONS = ("forward", "backward")
MASKS = ("none", "documents", "window", "key_bounds")

# (direction, head_dim, causal) -> the shortest length from which the Gluon kernel was measured
# faster than the Triton one on the H200 (`auto` runs it from there; cells not listed stay on
# Triton). Forward: benchmarks/gluon/gluon_fwd_h200_rounds.md (head dim 128 causal from 1K), and at
# head dim 64 below 16K it lost in the training setting (fused-QKV views with the backward:
# benchmarks/attention/attention_h200_training_auto.md, benchmarks/training/train_h200_kernels.md).
# Backward: benchmarks/gluon/gluon_bwd_fa3_h200_rounds.md (head dim 64 from 4K, where 1K stayed
# faster on Triton; head dim 128 from 1K causal, non-causal measured at 16K).
GLUON_FROM = {
    ("forward", 128, True): 1024, ("forward", 128, False): 16384,
    ("forward", 64, True): 16384, ("forward", 64, False): 16384,
    ("backward", 128, True): 1024, ("backward", 128, False): 16384,
    ("backward", 64, True): 4096, ("backward", 64, False): 4096,
}
# Dropout and soft-capping cost the two families differently, so where they move the crossover it
# is measured again: GLUON_FROM_SCORES[option][cell] is the length from which the Gluon kernel was
# faster with that option on; a cell not listed keeps GLUON_FROM's length. With several options on,
# the Gluon kernel runs where it was faster with each: the longest of their lengths. Sinks (one
# load per program; the backward reads them through the LSE) move nothing.
# - dropout, backward: the Triton backward draws the mask twice (dQ, then dK/dV) and the Gluon one
#   once, beside its matrix products: head dim 64 causal, Gluon's was faster from 1K
#   (benchmarks/attention/attention_scores_h200_B16_T1024.md, _B8_T2048.md; at 256 tokens Triton's,
#   _B64_T256.md). Forward, head dim 64 causal: since the mask zeroes P's packed pairs
#   (kernels/scores.py, PACKED_DROPOUT) the Gluon forward is faster from 4K on an H100 (0.373 ms
#   against 0.384 at 4K, 0.679 against 0.721 at 8K; 0.219 against 0.212 at 2K, 0.147 against 0.128
#   at 1K: benchmarks/attention/dropout_ring_h100/scores_call3_*.md); before it, 2% at 4K
#   (attention_scores_h200_gluon_fwd.md), and the plan kept Triton's below 16K.
# - softcap, forward: the Gluon forward was slower at 4K and at 16K, head dim 64 (the same file): a
#   second MUFU op a score, which ping-pong cannot hide where exp2 alone already keeps MUFU as busy
#   as the tensor cores.
GLUON_FROM_SCORES = {"dropout": {("backward", 64, True): 1024, ("forward", 64, True): 4096},
                     "softcap": {("forward", 64, True): float("inf")}}


@dataclass(frozen=True)
class Setting:
    """What decides a plan. arch: "sm_XY" of the CUDA device, None elsewhere; mask: one of MASKS;
    length: the longer of the query and key lengths; tma: TMA can read q, k and v; forward and
    backward: the user's word (CHOICES) for each direction; dropout, softcap, sinks: whether the
    call drops attention probabilities, soft-caps its scores, has attention sinks."""
    arch: str | None
    dtype: torch.dtype
    head_dim: int
    causal: bool
    mask: str
    length: int
    tma: bool
    deterministic: bool
    forward: str = "auto"
    backward: str = "auto"
    dropout: bool = False
    softcap: bool = False
    sinks: bool = False


@dataclass(frozen=True)
class Direction:
    """One direction of a plan: the family that runs it, its variant, and its tiles where fixed."""
    family: str
    variant: str = ""
    tiles: str | None = None          # None: autotuned per length band

    @property
    def name(self) -> str:
        return f"{self.family}-{self.variant}" if self.variant else self.family

    def __str__(self) -> str:
        return f"{self.name} ({self.tiles or 'autotuned'})"


@dataclass(frozen=True)
class KernelPlan:
    forward: Direction
    backward: Direction

    @property
    def deterministic(self) -> bool:
        return self.backward.variant.endswith("deterministic")

    def __str__(self) -> str:
        return f"forward={self.forward}, backward={self.backward}"


def check_choice(kernel) -> tuple[str, str]:
    """The user's kernel words as (forward, backward): one word for both directions, or a pair."""
    words = (kernel, kernel) if isinstance(kernel, str) else kernel
    if not (isinstance(words, tuple) and len(words) == 2 and all(w in CHOICES for w in words)):
        raise ValueError(f"kernel must be one of {', '.join(CHOICES)}, or a (forward, backward) pair of them, "
                         f"got {kernel!r}")
    return words


def make_plan(setting: Setting) -> KernelPlan:
    """The plan for `setting`; raises ValueError where a direction asked for "gluon" cannot run it."""
    return KernelPlan(_direction(setting, "forward"), _direction(setting, "backward"))


# Eager calls and configs ask this cached form; a traced call (torch.compile) the plain one, since
# Dynamo traces through functools' cache rather than consulting it.
plan_kernels = functools.lru_cache(maxsize=None)(make_plan)


def _direction(s: Setting, direction: str) -> Direction:
    choice = s.forward if direction == "forward" else s.backward
    refused = gluon.refusal(s.arch, s.dtype, s.head_dim, s.mask, s.tma, direction, s.causal)
    if choice == "gluon" and refused:
        raise ValueError(f"kernel='gluon' cannot run the {direction} of this call: {refused} (kernel='triton' can)")
    measured = s.length >= _gluon_from(s, direction)
    if choice == "gluon" or (choice == "auto" and refused is None and measured):
        return _gluon(s, direction)
    return _triton(s, direction)


def _gluon_from(s: Setting, direction: str) -> float:
    """The length from which `auto` runs the Gluon kernel in `direction` (GLUON_FROM, GLUON_FROM_SCORES)."""
    cell = (direction, s.head_dim, s.causal)
    default = GLUON_FROM.get(cell, float("inf"))
    return max([GLUON_FROM_SCORES[option].get(cell, default) for option in GLUON_FROM_SCORES if getattr(s, option)],
               default=default)


def _triton(s: Setting, direction: str) -> Direction:
    if direction == "forward":
        kernels, variant = ("fwd",), ""
    elif s.deterministic:
        kernels, variant = ("bwd_q", "bwd_kv"), "deterministic"
    else:
        kernels, variant = ("bwd_kv_dq",), "atomic"
    if tuning.tunes(s.length):
        return Direction("triton", variant)
    tiles = " + ".join(_tile_name(tuning.pinned(k, s.head_dim, s.causal)) for k in kernels)
    return Direction("triton", variant, tiles)


def _tile_name(cfg: dict) -> str:
    return f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}"


def _gluon(s: Setting, direction: str) -> Direction:
    from kernels.gluon import backward, forward   # triton.experimental.gluon: only where it is chosen

    if direction == "forward":
        variant = forward.DEFAULT_VARIANTS[s.head_dim]
        return Direction("gluon", variant, forward.tiles(variant, s.head_dim))
    return Direction("gluon", "deterministic" if s.deterministic else "atomic",
                     backward.tiles(s.head_dim, s.dropout, s.deterministic, s.softcap))


def call_setting(q, k, v, causal: bool, mask: str, deterministic: bool, choice: tuple[str, str],
                 dropout: bool = False, softcap: bool = False, sinks: bool = False) -> Setting:
    """The Setting of one call on checked inputs (kernels.checks.check_inputs)."""
    arch = arch_of(q.device)
    tma = arch == gluon.ARCH and not any(gluon.tma_refusal(n, t) for n, t in (("q", q), ("k", k), ("v", v)))
    return Setting(arch, q.dtype, q.shape[-1], causal, mask, max(q.shape[1], k.shape[1]), tma, deterministic,
                   *choice, dropout, softcap, sinks)


@torch.compiler.assume_constant_result
def _traced_arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


def arch_of(device: torch.device) -> str | None:
    """"sm_XY" of a CUDA device (under torch.compile too), None for any other device."""
    if torch.compiler.is_compiling() and device.type == "cuda":
        return _traced_arch(device.index if device.index is not None else torch.cuda.current_device())
    return device_arch(device)

