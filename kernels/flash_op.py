"""`flash_attention`: the Triton kernels as a differentiable torch.library op.

Forward and backward are registered with `torch.library.triton_op`, so that
`torch.compile(fullgraph=True)` sees one opaque op per direction (no graph break)
and Inductor can still schedule the Triton launches; `register_autograd` ties them.
Outside torch.compile the same launches run under a plain `autograd.Function`: the
custom-op dispatch costs host time that a small call (gpt2-small's heads at T = 1K)
cannot hide behind the GPU, and so does the autotuner's per-call key computation: after
its first call per shape band, an eager launch goes straight to the tuned config
(`_launch`). Input checks run in the Python wrapper, before anything is launched, and
raise ValueError naming the offending argument instead of a Triton compile trace.

The backward is deterministic by default (two kernels, bit-identical gradients run to
run); `deterministic=False` runs one kernel that accumulates dQ with float32 atomics
(kernels/flash_bwd.py).

The Gluon Hopper kernels (kernels/gluon_fwd.py, kernels/gluon_bwd.py) can run instead: `kernel=`,
chosen by kernels/kernel_choice.py. Triton's `triton_op` cannot trace a Gluon launch, so each
Gluon direction is its own opaque `torch.library.custom_op` with a fake implementation (shapes
only). Both forwards write the same LSE, so either backward follows either forward.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton

from kernels.flash_bwd import flash_bwd_delta_kernel, flash_bwd_kv_dq_kernel, flash_bwd_kv_kernel, flash_bwd_q_kernel
from kernels.flash_fwd import flash_fwd_kernel
from kernels.gluon_bwd import gluon_attention_backward
from kernels.gluon_fwd import gluon_attention_forward
from kernels.kernel_choice import choose_kernel
from kernels.masks import bounds_buffer, check_masks
from kernels.tiles import LOG2E
from kernels.tuning import INTERPRET, seq_bucket

MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _precision(dtype: torch.dtype) -> str:
    # float32 inputs get true fp32 products: no silent tf32 rounding.
    return "ieee" if dtype == torch.float32 else "tf32"


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError naming the argument if the kernels cannot take these inputs."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; flash_attention supports float16, bfloat16, float32")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}")
    if q.device.type != "cuda" and not INTERPRET:
        raise ValueError(f"q is on {q.device}; the Triton kernels need CUDA tensors "
                         "(or TRITON_INTERPRET=1 set before triton is imported, for CPU testing)")
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


def _no_wrap(kernel):
    """Eager launches call the kernel itself (wrap_triton would trace it into a graph op)."""
    return kernel


_TUNED: dict = {}   # (kernel, dtype, device, length band, constexprs) -> the tuned config's launch kwargs


def _launch(kernel, grid, args, consts: dict, wrap, key: tuple) -> None:
    """kernel[grid](*args, **consts). Traced (torch.compile), through `wrap`.
    Eager, the autotuner runs on the first call with a key, and its pick (`best_config`) is
    remembered: later calls launch the jitted function with it directly, skipping the
    autotuner's per-call work (a dict of ~45 arguments and a key with every tensor's dtype,
    ~20-40 us of host time per launch, see kernels/NOTES.md). The key holds everything the
    autotuner's key holds: the constexprs, the length band and the dtype of every tensor
    argument (q's dtype fixes them all; DOCS says whether Docs is int32).

    The one place that reaches past triton.autotune's decorator: its public interface has no
    "launch with this config" call, so the pick is read from `best_config` (set by the first run)
    and later launches go to `kernel.fn`, the jitted function it wraps."""
    if wrap is not _no_wrap:
        wrap(kernel)[grid](*args, **consts)
        return
    tuned = _TUNED.get((kernel,) + key)
    if tuned is None:
        kernel[grid](*args, **consts)
        _TUNED[(kernel,) + key] = kernel.best_config.all_kwargs()
    else:
        kernel.fn[grid](*args, **consts, **tuned)


def _constexprs(q, k, causal: bool, doc_bounds, window: int) -> tuple[dict, int, tuple]:
    """The kernels' shared constexprs, the autotuning length band, and the `_launch` key."""
    D = q.shape[3]
    consts = dict(HEAD_DIM=D, BLOCK_D=_block_d(D), CAUSAL=causal, DOCS=doc_bounds is not None, WINDOW=window > 0,
                  PRECISION=_precision(q.dtype))
    bucket = seq_bucket(max(q.shape[1], k.shape[1]))
    return consts, bucket, (q.dtype, q.device, bucket, *consts.values())


def _launch_forward(q, k, v, causal: bool, softmax_scale: float, wrap=_no_wrap, doc_bounds=None, window: int = 0):
    B, n_q, H, D = q.shape
    n_k, h_kv = k.shape[1], k.shape[2]
    out = torch.empty((B, n_q, H, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, n_q), dtype=torch.float32, device=q.device)
    consts, bucket, key = _constexprs(q, k, causal, doc_bounds, window)

    def grid(meta):
        return (triton.cdiv(n_q, meta["BLOCK_M"]), B * H)

    docs = lse if doc_bounds is None else doc_bounds   # DOCS=False never reads Docs: lse fills the slot
    _launch(flash_fwd_kernel, grid, (
        q, k, v, out, lse, docs,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        H, H // h_kv, n_q, n_k, softmax_scale * LOG2E.value, bucket, window), consts, wrap, key)
    return out, lse


@torch.library.triton_op("flashtrain::flash_attn_fwd", mutates_args=())
def flash_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   softmax_scale: float, doc_bounds: Optional[torch.Tensor] = None,
                   window: int = 0, deterministic: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns out (B, Nq, H, D) and lse (B, H, Nq) float32. doc_bounds: the per-query key
    intervals (B, 2 Nq + 2 Nk + 1) int32 of kernels.masks.bounds_buffer, or None; window: keys each query sees, 0 for no window;
    deterministic: which backward the autograd formula runs (the forward is the same)."""
    return _launch_forward(q, k, v, causal, softmax_scale, torch.library.wrap_triton, doc_bounds, window)


def _launch_backward(dout, q, k, v, out, lse, causal: bool, softmax_scale: float, wrap=_no_wrap,
                     doc_bounds=None, window: int = 0, deterministic: bool = True):
    B, n_q, H, D = q.shape
    n_k, h_kv = k.shape[1], k.shape[2]
    consts, bucket, key = _constexprs(q, k, causal, doc_bounds, window)
    delta = torch.empty((B, H, n_q), dtype=torch.float32, device=q.device)
    docs = delta if doc_bounds is None else doc_bounds   # DOCS=False never reads Docs: delta fills the slot
    dk = torch.empty((B, n_k, h_kv, D), dtype=k.dtype, device=k.device)
    dv = torch.empty((B, n_k, h_kv, D), dtype=v.dtype, device=v.device)
    inputs = (q, k, v, dout, lse, delta, docs, dk, dv)
    qkv_strides = (*q.stride(), *k.stride(), *v.stride())
    strides = (*qkv_strides, *dout.stride(), *dk.stride(), *dv.stride())
    sizes = (H, h_kv, H // h_kv, n_q, n_k, softmax_scale * LOG2E.value, softmax_scale, bucket, window)

    def kv_grid(meta):
        return (triton.cdiv(n_k, meta["BLOCK_N"]), B * h_kv)

    if deterministic:
        # dQ first: it also stores Delta, which the dK/dV kernel then reads (stream order)
        dq = torch.empty((B, n_q, H, D), dtype=q.dtype, device=q.device)

        def q_grid(meta):
            return (triton.cdiv(n_q, meta["BLOCK_M"]), B * H)

        _launch(flash_bwd_q_kernel, q_grid, (
            q, k, v, out, dout, lse, delta, docs, dq,
            *qkv_strides, *out.stride(), *dout.stride(), *dq.stride(),
            H, H // h_kv, n_q, n_k, softmax_scale * LOG2E.value, softmax_scale, bucket, window), consts, wrap, key)
        _launch(flash_bwd_kv_kernel, kv_grid, inputs + strides + sizes, consts, wrap, key)
        return dq, dk, dv

    delta_rows = 64
    wrap(flash_bwd_delta_kernel)[(triton.cdiv(n_q, delta_rows), B * H)](
        out, dout, delta, *out.stride(), *dout.stride(), H, n_q,
        HEAD_DIM=D, BLOCK_D=consts["BLOCK_D"], BLOCK_M=delta_rows)
    # float32 dQ for the atomic adds (float32 inputs: it is dQ itself)
    dq = torch.zeros((B, n_q, H, D), dtype=torch.float32, device=q.device)
    _launch(flash_bwd_kv_dq_kernel, kv_grid, inputs + (dq,) + strides + (*dq.stride(),) + sizes, consts, wrap, key)
    return dq.to(q.dtype), dk, dv


@torch.library.triton_op("flashtrain::flash_attn_bwd", mutates_args=())
def flash_attn_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool,
                   softmax_scale: float, doc_bounds: Optional[torch.Tensor] = None,
                   window: int = 0, deterministic: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns dq, dk, dv; dk and dv are summed over each GQA group. deterministic=False
    accumulates dq with atomics (its last bits vary run to run)."""
    return _launch_backward(dout, q, k, v, out, lse, causal, softmax_scale, torch.library.wrap_triton,
                            doc_bounds, window, deterministic)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, doc_bounds, window, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, doc_bounds)
    ctx.causal = causal
    ctx.softmax_scale = softmax_scale
    ctx.window = window
    ctx.deterministic = deterministic
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse, launch=flash_attn_bwd, gluon_launch=None):
    """The registered ops' formula launches through ops (traceable); the eager Function passes the
    plain launches. (AOTAutograd traces a backward with torch.compiler.is_compiling() False, so
    that flag cannot choose between them.)"""
    q, k, v, out, lse, doc_bounds = ctx.saved_tensors
    if getattr(ctx, "gluon_backward", False):
        gluon = gluon_launch or torch.ops.flashtrain.gluon_attn_bwd
        dq, dk, dv = gluon(dout, q, k, v, out, lse, ctx.causal, ctx.softmax_scale, ctx.deterministic)
    else:
        dq, dk, dv = launch(dout, q, k, v, out, lse, ctx.causal, ctx.softmax_scale,
                            doc_bounds=doc_bounds, window=ctx.window, deterministic=ctx.deterministic)
    return dq, dk, dv, None, None, None, None, None


flash_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("flashtrain::gluon_attn_fwd", mutates_args=())
def gluon_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
                   deterministic: bool = True, gluon_backward: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gluon forward as one opaque op: out (B, Nq, H, D), lse (B, H, Nq) float32.
    deterministic and gluon_backward: which backward its autograd formula runs."""
    return gluon_attention_forward(q, k, v, causal, softmax_scale)


@gluon_attn_fwd.register_fake
def _gluon_attn_fwd_fake(q, k, v, causal, softmax_scale, deterministic=True, gluon_backward=False):
    B, n_q, H, D = q.shape
    return q.new_empty((B, n_q, H, D)), q.new_empty((B, H, n_q), dtype=torch.float32)


@torch.library.custom_op("flashtrain::gluon_attn_bwd", mutates_args=())
def gluon_attn_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, softmax_scale: float,
                   deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Gluon backward as one opaque op: dq, dk, dv (contiguous; dk, dv summed over each GQA group)."""
    return gluon_attention_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic)


@gluon_attn_bwd.register_fake
def _gluon_attn_bwd_fake(dout, q, k, v, out, lse, causal, softmax_scale, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _gluon_setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, deterministic, gluon_backward = inputs
    _setup_context(ctx, (q, k, v, causal, softmax_scale, None, 0, deterministic), output)
    ctx.gluon_backward = gluon_backward


def _gluon_backward(ctx, dout, _dlse):
    return _backward(ctx, dout, _dlse)[:5] + (None, None)


gluon_attn_fwd.register_autograd(_gluon_backward, setup_context=_gluon_setup_context)


class _EagerFlashAttention(torch.autograd.Function):
    """The same kernels and the same saved tensors as the ops above, without their dispatch."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, doc_bounds, window, deterministic, forward, gluon_backward):
        if forward == "gluon":
            out, lse = gluon_attention_forward(q, k, v, causal, softmax_scale)
        else:
            out, lse = _launch_forward(q, k, v, causal, softmax_scale, doc_bounds=doc_bounds, window=window)
        _setup_context(ctx, (q, k, v, causal, softmax_scale, doc_bounds, window, deterministic), (out, lse))
        ctx.gluon_backward = gluon_backward
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        return _backward(ctx, dout, _dlse, launch=_launch_backward, gluon_launch=gluon_attention_backward) + (None, None)


def flash_attention(q, k, v, causal=False, softmax_scale=None, return_lse=False, *,
                    document_ids=None, window=None, key_bounds=None, deterministic=True, kernel="auto"):
    """Exact softmax(scale * Q K^T) V by tiling; same contract as kernels.reference.

    q (B, Nq, H, D); k, v (B, Nk, Hkv, D) with H % Hkv == 0; any strides.
    causal with Nq != Nk is aligned bottom-right. Returns out (B, Nq, H, D) in q's
    dtype, and with return_lse=True also lse (B, H, Nq) float32 (natural log; -inf
    for a query that sees no key).

    document_ids (B, N) integers, Nq == Nk: a packed window's per-token document ids
    (as data/sampler.py's `return_doc_ids` emits them); each run of equal ids is one
    document and a query sees only keys of its own (combined with causal). Per-token ids
    rather than cu_seqlens offsets: the shape is static (one tensor per batch, whatever
    the number of documents, so torch.compile does not re-specialise), every batch row
    packs its own documents, and the sampler already produces them; a small pre-pass
    turns them into per-token document ends that the kernels read to skip tiles.
    window=W (with causal=True): each query sees only the last W keys (itself included).
    Tiles outside the mask are skipped, not masked: the cost follows the sum of squared
    document lengths, and is linear in N for a window.
    key_bounds (B, 2, Nq) integers, any Nq and Nk: query i sees only keys
    [key_bounds[:, 0, i], key_bounds[:, 1, i]) (combined with causal and window; instead of
    document_ids). The way to give a block of a longer sequence its share of a mask (the
    context-parallel ring's chunk pairs, model/ring_attention.py). Tiles are skipped as for
    documents when both bounds are nondecreasing in i, as those of every causal, window and
    document mask are; other bounds are honoured too, with every tile visited and masked.
    deterministic=True (default): the backward gives bit-identical gradients run to run.
    False: one backward kernel that adds dq with float32 atomics (fewer matmuls; dq's
    last bits vary from run to run, within the same error bound).
    kernel: which kernels run (kernels/kernel_choice.py): "triton" (kernels/flash_*.py, both
    directions), "gluon" (the Hopper forward and backward, kernels/gluon_*.py; a ValueError says why
    where they cannot run) or "auto" (the Gluon forward where it was measured faster, and the Triton
    backward, which was measured faster than the Gluon one everywhere).
    """
    check_inputs(q, k, v)
    check_masks(q, k, causal, document_ids, window, key_bounds)
    gluon_backward = kernel == "gluon"
    kernel = choose_kernel(kernel, q, k, v, bool(causal),
                           masked=document_ids is not None or window is not None or key_bounds is not None)
    doc_bounds = bounds_buffer(document_ids, key_bounds, k.shape[1])
    window = _window(window, k.shape[1])
    args = (q, k, v, bool(causal), _softmax_scale(softmax_scale, q.shape[-1]), doc_bounds, window,
            _flag(deterministic, "deterministic"))
    if not torch.compiler.is_compiling():
        out, lse = _EagerFlashAttention.apply(*args, kernel, gluon_backward)
    elif kernel == "gluon":
        out, lse = gluon_attn_fwd(*args[:5], args[7], gluon_backward)
    else:
        out, lse = flash_attn_fwd(*args)
    return (out, lse) if return_lse else out


def _window(window, n_k: int) -> int:
    """The kernels' window argument: 0 for none, and for a window of every key (plain causal)."""
    return 0 if window is None or window >= n_k else int(window)


def _flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def _softmax_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    return float(softmax_scale)


def flash_attention_backward(dout, q, k, v, out, lse, causal=False, softmax_scale=None, deterministic=True, *,
                             document_ids=None, window=None, key_bounds=None):
    """dq, dk, dv of flash_attention from a given output `out` and log-sum-exp `lse`.

    The backward kernels only need P = exp(S - lse) and rowsum(dO * O), so `out` and
    `lse` may come from attention over a longer key set than `k`, `v` (a ring's merged
    result): the gradients are then this key block's exact share, to be summed over
    blocks. Same layouts as flash_attention; lse (B, H, Nq) float32; dk, dv are summed
    over each GQA group and shaped like k, v. deterministic and the masks (document_ids,
    window, key_bounds) as in flash_attention: the block's own mask.
    """
    check_inputs(q, k, v)
    check_masks(q, k, causal, document_ids, window, key_bounds)
    for name, t in (("dout", dout), ("out", out)):
        if not isinstance(t, torch.Tensor) or t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must be a {q.dtype} tensor of q's shape {tuple(q.shape)} on {q.device}, "
                             f"got {getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    want = (q.shape[0], q.shape[2], q.shape[1])
    if not isinstance(lse, torch.Tensor) or lse.shape != want or lse.dtype != torch.float32 or lse.device != q.device:
        raise ValueError(f"lse must be a float32 tensor of shape (batch, heads, seqlen) = {want} on {q.device}, "
                         f"got {getattr(lse, 'dtype', type(lse).__name__)} {tuple(getattr(lse, 'shape', ()))}")
    launch = flash_attn_bwd if torch.compiler.is_compiling() else _launch_backward
    window = _window(window, k.shape[1])
    return launch(dout, q, k, v, out, lse.contiguous(), bool(causal), _softmax_scale(softmax_scale, q.shape[-1]),
                  doc_bounds=bounds_buffer(document_ids, key_bounds, k.shape[1]), window=window,
                  deterministic=_flag(deterministic, "deterministic"))
