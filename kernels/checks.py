"""Argument checks shared by every entry of the kernels: flash_attention, its backward, decoding.

They run before anything is launched and raise ValueError naming the offending argument, instead
of a Triton compile trace or a wrong answer. What one kernel family cannot take (the Gluon
kernels' head dims, TMA's strides) is that family's refusal in kernels/plan.py, not an input
error: another family can run it.
"""
from __future__ import annotations

import functools
import math
import os

import torch

MAX_HEAD_DIM = 256
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Set before triton is imported (tests/conftest.py on a CPU): the Triton kernels then run in
# Triton's interpreter on CPU tensors.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_inputs(q, k, v) -> None:
    """Raise ValueError naming the argument if no kernel can take q (B, Nq, H, D), k, v (B, Nk, Hkv, D)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; flash_attention supports float16, bfloat16, float32")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}")
    if q.device.type != "cuda" and not INTERPRET:
        raise ValueError(f"q is on {q.device}; the Triton kernels need CUDA tensors "
                         "(or TRITON_INTERPRET=1 set before triton is imported, for CPU testing, at about "
                         "a minute per training step of a small model)")
    if INTERPRET and q.dtype == torch.bfloat16:
        raise ValueError("q is bfloat16, which Triton's CPU interpreter computes wrongly in tl.dot; "
                         "use float16/float32 under TRITON_INTERPRET=1")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k={tuple(k.shape)}, v={tuple(v.shape)}")
    B, n_q, H, D = q.shape
    if k.shape[0] != B:
        raise ValueError(f"k has batch {k.shape[0]} but q has batch {B}")
    if k.shape[3] != D:
        raise ValueError(f"k has head_dim {k.shape[3]} but q has head_dim {D}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"q has head_dim {D}; supported head dims are 1..{MAX_HEAD_DIM}")
    if k.shape[2] == 0 or H % k.shape[2]:
        raise ValueError(f"q has {H} heads, which is not a multiple of k's {k.shape[2]} heads")
    if n_q == 0 or k.shape[1] == 0:
        raise ValueError(f"empty sequence: q has {n_q} queries, k has {k.shape[1]} keys")
    if B == 0 or H == 0:
        raise ValueError(f"q has an empty dimension: shape {tuple(q.shape)}")


def check_like_q(q, **tensors) -> None:
    """Each named tensor (the backward's dout, out) must have q's shape, dtype and device."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must be a {q.dtype} tensor of q's shape {tuple(q.shape)} on {q.device}, "
                             f"got {getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")


def check_lse(q, lse) -> None:
    """lse must be the (B, H, Nq) float32 log-sum-exp of q's rows."""
    want = (q.shape[0], q.shape[2], q.shape[1])
    if not isinstance(lse, torch.Tensor) or lse.shape != want or lse.dtype != torch.float32 or lse.device != q.device:
        raise ValueError(f"lse must be a float32 tensor of shape (batch, heads, seqlen) = {want} on {q.device}, "
                         f"got {getattr(lse, 'dtype', type(lse).__name__)} {tuple(getattr(lse, 'shape', ()))}")


DROPOUT_STEPS = 256   # the kernels draw 8 random bits a score (kernels/scores.py)


def drawn_dropout_p(dropout_p: float) -> float:
    """The dropout probability the kernels draw for `dropout_p`: the nearest multiple of 1/256, as
    they compare 8 random bits a score with a threshold (kernels/scores.py). Kept scores are scaled
    by 1 / (1 - this), so the expected output stays exactly the undropped one."""
    return math.floor(dropout_p * DROPOUT_STEPS + 0.5) / DROPOUT_STEPS


DRAWN_RANGE = f"[1/{2 * DROPOUT_STEPS}, 1 - 1/{2 * DROPOUT_STEPS})"   # the p that round to neither 0 nor 1


def drawable_dropout(dropout_p: float) -> bool:
    """Whether the kernels can draw `dropout_p`: 0, or a p in DRAWN_RANGE, which the 8-bit draw
    rounds to neither 0 nor 1."""
    return dropout_p == 0 or drawn_dropout_p(dropout_p) not in (0.0, 1.0)


def check_scores(q, dropout_p, softcap, sinks) -> tuple[float, float]:
    """(dropout_p, softcap) as the kernels take them (dropout_p `drawn_dropout_p`'s, softcap 0.0:
    none), after checking the three score options of q (B, Nq, H, D): dropout_p in [0, 1) and not
    rounded to 0 or 1 by the 8-bit draw, softcap None or a positive finite number, sinks None or a
    floating (H,) tensor on q's device."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if not drawable_dropout(dropout_p):
        raise ValueError(f"dropout_p={dropout_p!r} rounds to {drawn_dropout_p(dropout_p):g}: the kernels draw it in "
                         f"steps of 1/{DROPOUT_STEPS}, so it must lie in {DRAWN_RANGE} (or be 0)")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not math.isfinite(softcap) or softcap <= 0):
        raise ValueError(f"softcap must be None or a positive finite number, got {softcap!r}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point or tuple(sinks.shape) != (q.shape[2],):
            raise ValueError(f"sinks must be a floating tensor of shape (heads,) = ({q.shape[2]},), got "
                             f"{getattr(sinks, 'dtype', type(sinks).__name__)} {tuple(getattr(sinks, 'shape', ()))}")
        if sinks.device != q.device:
            raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}")
    return drawn_dropout_p(float(dropout_p)), float(softcap or 0.0)


def check_flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def softmax_scale_for(softmax_scale, head_dim: int) -> float:
    """The scale of the scores: 1 / sqrt(head_dim) by default, else a positive finite number."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not (isinstance(softmax_scale, (int, float))
                                               and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    return float(softmax_scale)


@functools.lru_cache(maxsize=None)
def device_arch(device: torch.device) -> str | None:
    """"sm_XY" of a CUDA device, None for any other device."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"
