"""`flash_attention`: the kernels as a differentiable torch.library op, dispatched on a kernel plan.

Which kernels run a call is its plan (kernels/plan.py): a family and variant for the forward, and
for the backward. The families are the rows of FAMILIES: "triton" (kernels/flash_fwd.py and
flash_bwd.py) and "gluon" (kernels/gluon/, Hopper only). Both forwards write the same log-sum-exp,
so either backward follows either forward. Adding a family is a row here and its rule in the plan.

Eager calls run the launches under a plain `autograd.Function`: a call's checks and plan are
computed once per call signature (shapes, strides, dtype, device and the options) and looked up
afterwards, since a training step repeats a handful of signatures thousands of times and the
host time of a small call (gpt2-small's heads at T = 1K) is otherwise longer than its GPU time.

Where q, k and v are the slices of one fused QKV projection that the model's split leaves
(`_projection`), the eager call is differentiated with respect to that projection itself: the
backward writes dq, dk and dv into one tensor, so autograd skips the split's backward, a copy of
the whole gradient and four graph nodes on the engine's thread.

Under torch.compile the forward and backward are registered ops: the Triton family through
`torch.library.triton_op`, so `torch.compile(fullgraph=True)` sees one opaque op per direction and
Inductor still schedules the Triton launches; the Gluon family through `torch.library.custom_op`
with a fake implementation (triton_op cannot trace a Gluon launch). The forward op carries the
plan's backward (family and determinism), which its autograd formula runs.

The Triton kernels' tiles are autotuned per length band where the plan says so (Triton keeps the
results on disk; the first tuning of a band is logged), and launched with the pinned tile
otherwise, without going through the autotuner at all.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from kernels import plan as plans
from kernels import exp2, scores
from kernels.checks import check_flag, check_inputs, check_like_q, check_lse, check_scores, device_arch, softmax_scale_for
from kernels.flash_bwd import flash_bwd_delta_kernel, flash_bwd_kv_dq_kernel, flash_bwd_kv_kernel, flash_bwd_q_kernel
from kernels.flash_fwd import flash_fwd_kernel
from kernels.gluon.backward import launch_backward as gluon_backward
from kernels.gluon.forward import gluon_attention_forward
from kernels.launch import cdiv, launch, next_power_of_2
from kernels.masks import bounds_buffer, check_masks
from kernels.scores import dropout_seed, sink_grad_eager, sink_grad_from_delta
from kernels.tiles import LOG2E
from kernels.tuning import pinned, seq_bucket, tunes

log = logging.getLogger("kernels")


# ---- the Triton family -------------------------------------------------------------------------

def _no_wrap(kernel):
    """Eager launches call the kernel itself (wrap_triton would trace it into a graph op)."""
    return kernel


@functools.lru_cache(maxsize=None)
def _constexprs(head_dim: int, causal: bool, docs: bool, window: bool, dtype: torch.dtype, softcap: float = 0.0,
                dropout_p: float = 0.0) -> dict:
    """The Triton kernels' shared constexprs. float32 inputs get true fp32 products (no tf32).
    softcap and dropout_p: 0.0 for none (kernels/scores.py)."""
    return dict(HEAD_DIM=head_dim, BLOCK_D=max(16, next_power_of_2(head_dim)), CAUSAL=causal, DOCS=docs,
                WINDOW=window, PRECISION="ieee" if dtype == torch.float32 else "tf32", SOFTCAP=float(softcap),
                DROPOUT_P=float(dropout_p))


@functools.lru_cache(maxsize=None)
def _wgmma_scores(device: torch.device) -> bool:
    """Whether tl.dot's scores are a wgmma accumulator on `device` (sm_90), whose lanes the forward's
    shared dropout draw relies on."""
    return device_arch(device) == "sm_90"


_TUNED: dict = {}   # (kernel, length band, constexprs, dtype, device) -> the tuned tile's launch keywords


def _launch(kernel, table: str, grid, args, consts: dict, length: int, dtype, device, wrap, cache, key) -> None:
    """kernel[grid](*args, **consts) with the tile the plan gives: pinned (`tuning.pinned`), or
    tuned per length band. Traced (torch.compile), through `wrap` and the autotuner, which Inductor
    runs at compile time. Eager, through kernels/launch.py: the compiled kernel of a call signature
    (`cache`, `key`) is launched directly after its first launch.

    Tuned, the autotuner runs on the first call of a band (logged; Triton keeps the result on
    disk) and its pick (`best_config`) is remembered: later calls launch the jitted function with
    it, skipping the autotuner's per-call work. The one place that reaches past triton.autotune's
    decorator: its public interface has no "launch with this config" call, so the pick is read
    from `best_config` and launches go to `kernel.fn`, the jitted function it wraps. Pinned, the
    autotuner is never called: it would time even a single candidate (seconds per launch at a
    million tokens)."""
    if wrap is not _no_wrap:
        wrap(kernel)[grid](*args, **consts)
        return
    key = (table, *key)
    direct = cache.get(key) if cache is not None else None
    if direct is not None:   # the call signature's kernel, launched before
        direct(args)
        return
    if not tunes(length):
        launch(kernel.fn, grid, args, {**consts, **pinned(table, consts["HEAD_DIM"], consts["CAUSAL"])}, cache, key)
        return
    band = (kernel, seq_bucket(length), *consts.values(), dtype, device)
    tuned = _TUNED.get(band)
    if tuned is None:
        began = time.perf_counter()
        kernel[grid](*args, **consts)
        if getattr(kernel, "configs_timings", None):   # timed now, not read from Triton's cache
            log.info("tuned %s for head dim %d, %s, lengths up to %d: %s in %.1f s (kept in Triton's cache)",
                     table, consts["HEAD_DIM"], "causal" if consts["CAUSAL"] else "non-causal", seq_bucket(length),
                     kernel.best_config, time.perf_counter() - began)
            kernel.configs_timings = None
        _TUNED[band] = kernel.best_config.all_kwargs()
    else:
        launch(kernel.fn, grid, args, {**consts, **tuned}, cache, key)


def _triton_forward(q, k, v, causal: bool, softmax_scale: float, doc_bounds=None, window: int = 0, wrap=_no_wrap,
                    cache=None, key=(), *, softcap: float = 0.0, dropout_p: float = 0.0, rng=None, sinks=None):
    """rng: the call's dropout seed and offset (kernels/scores.py), with dropout_p > 0; sinks: (H,)
    float32 or None. A None rng or sinks is a constexpr of the kernels: their code is left out."""
    B, n_q, H, D = q.shape
    n_k, h_kv = k.shape[1], k.shape[2]
    out = torch.empty((B, n_q, H, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, n_q), dtype=torch.float32, device=q.device)
    consts = _constexprs(D, causal, doc_bounds is not None, window > 0, q.dtype, softcap, dropout_p)
    # the lanes split the dropout draw where S is a wgmma accumulator (flash_fwd_kernel's SHARE_DRAW), and the
    # mask may zero packed pairs there (PACKED_MASK); passed either way: Inductor's analysis of what a kernel
    # writes needs every constexpr bound
    share = int(dropout_p > 0 and _wgmma_scores(q.device))
    consts = {**consts, "SHARE_DRAW": share, "PACKED_MASK": scores.packed_mask(dropout_p, q.dtype, share),
              "SHIFT": scores.softcap_shift(softcap, q.dtype, sinks)}
    consts["EXP2_ON_FMA"] = exp2.on_fma("triton", D, softcap, dropout_p, q.dtype, consts["SHIFT"])
    length = max(n_q, n_k)

    def grid(meta):
        return (cdiv(n_q, meta["BLOCK_M"]), B * H)

    docs = lse if doc_bounds is None else doc_bounds   # DOCS=False never reads Docs: lse fills the slot
    _launch(flash_fwd_kernel, "fwd", grid, (
        q, k, v, out, lse, docs, rng, sinks, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        H, H // h_kv, n_q, n_k, softmax_scale * LOG2E.value, seq_bucket(length), window),
        consts, length, q.dtype, q.device, wrap, cache, key)
    return out, lse


def _triton_backward(dout, q, k, v, out, lse, causal: bool, softmax_scale: float, doc_bounds=None, window: int = 0,
                     deterministic: bool = True, wrap=_no_wrap, cache=None, key=(), *, softcap: float = 0.0,
                     dropout_p: float = 0.0, rng=None, grads=None):
    """grads: dq, dk, dv to write into (views of one packed gradient, `_EagerPackedAttention`), or None."""
    B, n_q, H, D = q.shape
    n_k, h_kv = k.shape[1], k.shape[2]
    consts = _constexprs(D, causal, doc_bounds is not None, window > 0, q.dtype, softcap, dropout_p)
    length = max(n_q, n_k)
    bucket = seq_bucket(length)
    delta = torch.empty((B, H, n_q), dtype=torch.float32, device=q.device)
    docs = delta if doc_bounds is None else doc_bounds   # DOCS=False never reads Docs: delta fills the slot
    if grads is None:
        dk = torch.empty((B, n_k, h_kv, D), dtype=k.dtype, device=k.device)
        dv = torch.empty((B, n_k, h_kv, D), dtype=v.dtype, device=v.device)
    else:
        dk, dv = grads[1:]
    inputs = (q, k, v, dout, lse, delta, docs, rng, dk, dv)
    qkv_strides = (*q.stride(), *k.stride(), *v.stride())
    strides = (*qkv_strides, *dout.stride(), *dk.stride(), *dv.stride())
    sizes = (H, h_kv, H // h_kv, n_q, n_k, softmax_scale * LOG2E.value, softmax_scale, bucket, window)
    run = functools.partial(_launch, consts=consts, length=length, dtype=q.dtype, device=q.device, wrap=wrap,
                            cache=cache, key=key)

    def kv_grid(meta):
        return (cdiv(n_k, meta["BLOCK_N"]), B * h_kv)

    if deterministic:
        # dQ first: it also stores Delta, which the dK/dV kernel then reads (stream order)
        dq = torch.empty((B, n_q, H, D), dtype=q.dtype, device=q.device) if grads is None else grads[0]

        def q_grid(meta):
            return (cdiv(n_q, meta["BLOCK_M"]), B * H)

        run(flash_bwd_q_kernel, "bwd_q", q_grid, (
            q, k, v, out, dout, lse, delta, docs, rng, dq, *qkv_strides, *out.stride(), *dout.stride(), *dq.stride(),
            H, H // h_kv, n_q, n_k, softmax_scale * LOG2E.value, softmax_scale, bucket, window))
        run(flash_bwd_kv_kernel, "bwd_kv", kv_grid, inputs + strides + sizes)
        return dq, dk, dv, delta

    delta_rows = 64
    delta_args = (out, dout, delta, *out.stride(), *dout.stride(), H, n_q)
    delta_consts = dict(HEAD_DIM=D, BLOCK_D=consts["BLOCK_D"], BLOCK_M=delta_rows)
    if wrap is _no_wrap:
        launch(flash_bwd_delta_kernel, (cdiv(n_q, delta_rows), B * H), delta_args, delta_consts, cache,
               ("delta", *key))
    else:
        wrap(flash_bwd_delta_kernel)[(cdiv(n_q, delta_rows), B * H)](*delta_args, **delta_consts)
    # float32 dQ for the atomic adds (float32 inputs: it is dQ itself)
    dq = torch.zeros((B, n_q, H, D), dtype=torch.float32, device=q.device)
    run(flash_bwd_kv_dq_kernel, "bwd_kv_dq", kv_grid, inputs + (dq,) + strides + (*dq.stride(),) + sizes)
    return (dq.to(q.dtype) if grads is None else grads[0].copy_(dq)), dk, dv, delta


@torch.library.triton_op("flashtrain::flash_attn_fwd", mutates_args=())
def flash_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   softmax_scale: float, doc_bounds: Optional[torch.Tensor] = None,
                   window: int = 0, deterministic: bool = True,
                   backward: str = "triton", softcap: float = 0.0, dropout_p: float = 0.0,
                   rng: Optional[torch.Tensor] = None,
                   sinks: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns out (B, Nq, H, D) and lse (B, H, Nq) float32. doc_bounds: the per-query key
    intervals (B, 2 Nq + 2 Nk + 1) int32 of kernels.masks.bounds_buffer, or None; window: keys each
    query sees, 0 for no window; deterministic and backward: the backward the autograd formula
    runs (its variant and family; the forward is the same). softcap (0.0: none), dropout_p with rng
    (the call's seed and offset, kernels/scores.dropout_seed) and sinks ((H,) float32 or None): what
    kernels/scores.py does to the scores."""
    return _triton_forward(q, k, v, causal, softmax_scale, doc_bounds, window, torch.library.wrap_triton,
                           softcap=softcap, dropout_p=dropout_p, rng=rng, sinks=sinks)


@torch.library.triton_op("flashtrain::flash_attn_bwd", mutates_args=())
def flash_attn_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool,
                   softmax_scale: float, doc_bounds: Optional[torch.Tensor] = None,
                   window: int = 0, deterministic: bool = True, softcap: float = 0.0, dropout_p: float = 0.0,
                   rng: Optional[torch.Tensor] = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns dq, dk, dv and Delta = rowsum(dO * O) (B, H, Nq) float32; dk and dv are summed over
    each GQA group. deterministic=False accumulates dq with atomics (its last bits vary run to run).
    softcap, dropout_p and rng as the forward's (the sinks' gradient is the autograd formula's, from
    Delta and lse)."""
    return _triton_backward(dout, q, k, v, out, lse, causal, softmax_scale, doc_bounds, window, deterministic,
                            torch.library.wrap_triton, softcap=softcap, dropout_p=dropout_p, rng=rng)


# ---- the Gluon family --------------------------------------------------------------------------

@torch.library.custom_op("flashtrain::gluon_attn_fwd", mutates_args=())
def gluon_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
                   doc_bounds: Optional[torch.Tensor] = None, window: int = 0, deterministic: bool = True,
                   backward: str = "triton", softcap: float = 0.0, dropout_p: float = 0.0,
                   rng: Optional[torch.Tensor] = None,
                   sinks: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gluon forward as one opaque op: out (B, Nq, H, D), lse (B, H, Nq) float32. Same
    arguments as flash_attn_fwd; the plan gives it no mask (doc_bounds None, window 0)."""
    return _gluon_forward(q, k, v, causal, softmax_scale, softcap=softcap, dropout_p=dropout_p, rng=rng, sinks=sinks)


@gluon_attn_fwd.register_fake
def _gluon_attn_fwd_fake(q, k, v, causal, softmax_scale, doc_bounds=None, window=0, deterministic=True,
                         backward="triton", softcap=0.0, dropout_p=0.0, rng=None, sinks=None):
    B, n_q, H, D = q.shape
    return q.new_empty((B, n_q, H, D)), q.new_empty((B, H, n_q), dtype=torch.float32)


@torch.library.custom_op("flashtrain::gluon_attn_bwd", mutates_args=())
def gluon_attn_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, softmax_scale: float, doc_bounds: Optional[torch.Tensor] = None,
                   window: int = 0, deterministic: bool = True, softcap: float = 0.0, dropout_p: float = 0.0,
                   rng: Optional[torch.Tensor] = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Gluon backward as one opaque op: dq, dk, dv (dk, dv summed over each GQA group) and Delta."""
    dq, dk, dv, delta = _gluon_backward(dout, q, k, v, out, lse, causal, softmax_scale, doc_bounds, window,
                                        deterministic, softcap=softcap, dropout_p=dropout_p, rng=rng)
    return dq, dk, dv, delta.contiguous()   # the fake's layout (Delta is a view of a padded buffer)


@gluon_attn_bwd.register_fake
def _gluon_attn_bwd_fake(dout, q, k, v, out, lse, causal, softmax_scale, doc_bounds=None, window=0,
                         deterministic=True, softcap=0.0, dropout_p=0.0, rng=None):
    B, n_q, H, _ = q.shape
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty((B, H, n_q), dtype=torch.float32))


def _gluon_forward(q, k, v, causal, softmax_scale, doc_bounds=None, window=0, cache=None, key=(), *, softcap=0.0,
                   dropout_p=0.0, rng=None, sinks=None):
    return gluon_attention_forward(q, k, v, causal, softmax_scale, cache=cache, softcap=softcap, dropout_p=dropout_p,
                                   rng=rng, sinks=sinks)


def _gluon_backward(dout, q, k, v, out, lse, causal, softmax_scale, doc_bounds=None, window=0, deterministic=True,
                    cache=None, key=(), *, softcap=0.0, dropout_p=0.0, rng=None, grads=None):
    # sinks need nothing here: lse includes them (kernels/scores.py)
    return gluon_backward(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, cache=cache, key=key,
                          softcap=softcap, dropout_p=dropout_p, rng=rng, grads=grads, doc_bounds=doc_bounds)


# ---- the families, the autograd formula and the entry point ------------------------------------

@dataclass(frozen=True)
class Family:
    """One kernel family's launches: eager (plain functions) and traced (registered ops).
    forward(q, k, v, causal, scale, doc_bounds, window[, cache, key], *, softcap, dropout_p, rng, sinks) -> out, lse;
    backward(dout, q, k, v, out, lse, causal, scale, doc_bounds, window, deterministic[, cache, key], *, softcap,
    dropout_p, rng[, grads]) -> dq, dk, dv, Delta (B, H, Nq) float32, the rowsum(dO * O) the backward computes
    anyway (the sinks' gradient reads it); eager, `cache` (the call signature's compiled kernels,
    kernels/launch.py) and `key` (what else fixes the launches' specialisation) may be given, and `grads`, the
    dq, dk, dv to write into. The ops take the same arguments positionally, without cache, key and grads."""
    forward: Callable
    backward: Callable
    forward_op: Callable
    backward_op: Callable


FAMILIES = {
    "triton": Family(_triton_forward, _triton_backward, flash_attn_fwd, flash_attn_bwd),
    "gluon": Family(_gluon_forward, _gluon_backward, gluon_attn_fwd, gluon_attn_bwd),
}


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, doc_bounds, window, deterministic, backward, softcap, dropout_p, rng, sinks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, doc_bounds, rng, sinks)
    ctx.causal, ctx.softmax_scale, ctx.window = causal, softmax_scale, window
    ctx.deterministic, ctx.backward, ctx.softcap, ctx.dropout_p = deterministic, backward, softcap, dropout_p
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    """The registered forward ops' autograd formula: the plan's backward, as its family's op, and
    the sinks' gradient (kernels/scores.py)."""
    q, k, v, out, lse, doc_bounds, rng, sinks = ctx.saved_tensors
    dq, dk, dv, delta = FAMILIES[ctx.backward].backward_op(dout, q, k, v, out, lse, ctx.causal, ctx.softmax_scale,
                                                           doc_bounds, ctx.window, ctx.deterministic, ctx.softcap,
                                                           ctx.dropout_p, rng)
    dsinks = sink_grad_from_delta(delta, lse, sinks) if sinks is not None else None
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, dsinks


for _family in FAMILIES.values():
    _family.forward_op.register_autograd(_backward, setup_context=_setup_context)


def _eager_forward(ctx, q, k, v, call, doc_bounds, rng, sinks):
    out, lse = FAMILIES[call.plan.forward.family].forward(q, k, v, call.causal, call.scale, doc_bounds, call.window,
                                                          cache=call.launches, softcap=call.softcap,
                                                          dropout_p=call.dropout_p, rng=rng, sinks=sinks)
    ctx.save_for_backward(q, k, v, out, lse, doc_bounds, rng, sinks)
    ctx.call = call
    ctx.mark_non_differentiable(lse)
    # lse has no gradient: without this, autograd would allocate and zero-fill one for every
    # backward (an allocation and a launch of host time on the engine's thread)
    ctx.set_materialize_grads(False)
    return out, lse


def _eager_backward(ctx, dout, packed=None):
    """The plan's backward launches and the sinks' gradient; `packed`, the shape of the projection q,
    k and v are slices of (`_projection`): the gradients are written into one tensor of that shape."""
    q, k, v, out, lse, doc_bounds, rng, sinks = ctx.saved_tensors
    call = ctx.call
    grads = None
    if packed is not None:   # q, k, v laid out as `_projection` found them (saved tensors may be copies)
        dqkv = torch.empty(packed, dtype=q.dtype, device=q.device)
        rows, offsets = _slices(q.shape, k.shape)
        grads = tuple(dqkv.as_strided(t.shape, rows, offset) for t, offset in zip((q, k, v), offsets))
    # autograd's dout: its layout joins the call signature in fixing the launches' specialisation
    key = (dout.stride(), dout.data_ptr() % 16 == 0, grads is not None)
    dq, dk, dv, delta = FAMILIES[call.plan.backward.family].backward(
        dout, q, k, v, out, lse, call.causal, call.scale, doc_bounds, call.window, call.plan.deterministic,
        cache=call.launches, key=key, softcap=call.softcap, dropout_p=call.dropout_p, rng=rng, grads=grads)
    dsinks = sink_grad_eager(delta, lse, sinks) if sinks is not None and ctx.needs_input_grad[-1] else None
    return (dq, dk, dv) if packed is None else (dqkv,), dsinks


class _EagerFlashAttention(torch.autograd.Function):
    """The plan's launches and the same saved tensors as the ops above, without their dispatch."""

    @staticmethod
    def forward(ctx, q, k, v, call, doc_bounds, rng, sinks):
        return _eager_forward(ctx, q, k, v, call, doc_bounds, rng, sinks)

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:   # reached through lse alone, which has no gradient
            return None, None, None, None, None, None, None
        (dq, dk, dv), dsinks = _eager_backward(ctx, dout)
        return dq, dk, dv, None, None, None, dsinks


class _EagerPackedAttention(torch.autograd.Function):
    """The same call on q, k, v that are slices of one projection `qkv` (`_projection`), differentiated
    with respect to `qkv` itself: the backward writes dq, dk and dv into one tensor shaped like it.
    Autograd then never reaches the views' own nodes, so the concatenation of dq, dk and dv that the
    split's backward would run (a copy of the whole gradient) and its four graph nodes are not run."""

    @staticmethod
    def forward(ctx, qkv, views, call, doc_bounds, rng, sinks):
        ctx.packed = qkv.shape
        return _eager_forward(ctx, *views, call, doc_bounds, rng, sinks)

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            return None, None, None, None, None, None
        (dqkv,), dsinks = _eager_backward(ctx, dout, ctx.packed)
        return dqkv, None, None, None, None, dsinks


@functools.lru_cache(maxsize=256)
def _slices(q_shape, k_shape) -> tuple[tuple[int, ...], tuple[int, int, int]]:
    """The strides of q, k and v (B, N, heads, D) as slices of one (B, N, (H + 2 Hkv) D) projection,
    and their offsets in it: q's heads, then k's, then v's."""
    _, n, heads, head_dim = q_shape
    kv_heads = k_shape[2]
    width = (heads + 2 * kv_heads) * head_dim
    return (n * width, width, head_dim, 1), (0, heads * head_dim, (heads + kv_heads) * head_dim)


def _projection(q, k, v):
    """The tensor q, k and v are adjacent slices of, as the split and unflatten of a fused QKV
    projection leaves them (model/layers.py; with rotary positions, of kernels/rotary.py's output),
    or None: one contiguous (..., (H + 2 Hkv) D) tensor, q, k and v in that order, each
    (B, N, heads, D) of its rows.
    None too where the split's backward might do more than concatenate the three gradients (a view
    whose gradient is retained or hooked; a projection written in place through a slice, whose
    history then holds a CopySlices node), or where there is no gradient to take."""
    base = q._base
    if (base is None or k._base is not base or v._base is not base or not torch.is_grad_enabled()
            or not base.requires_grad or base.dtype != q.dtype or not base.is_contiguous()):
        return None
    rows, (q_at, k_at, v_at) = _slices(q.shape, k.shape)
    start = base.storage_offset()
    if (k.shape[1] != q.shape[1] or base.numel() != q.shape[0] * rows[0] or q.stride() != rows
            or k.stride() != rows or v.stride() != rows or q.storage_offset() != start + q_at
            or k.storage_offset() != start + k_at or v.storage_offset() != start + v_at):
        return None
    if (any(t.retains_grad or t._backward_hooks for t in (q, k, v))
            or type(base.grad_fn).__name__ == "CopySlices"):
        return None
    return base


@dataclass(frozen=True)
class _Call:
    """What a call signature decides once: its plan, the arguments the launches take, and the
    kernels its launches compiled (kernels/launch.py)."""
    plan: plans.KernelPlan
    causal: bool
    scale: float
    window: int
    dropout_p: float = 0.0
    softcap: float = 0.0     # 0.0: none
    launches: dict = field(default_factory=dict, compare=False, hash=False)


_CALLS: dict = {}   # call signature -> _Call
MAX_CALLS = 4096    # signatures kept (a run sees a handful; varying lengths, e.g. prompts, start it afresh)


def forget_calls() -> None:
    """Drop every call signature's plan and kernels, so that the next calls plan and compile afresh:
    after a code-path switch of kernels/scores.py or kernels/exp2.py, which a signature reads once."""
    _CALLS.clear()


def _mask_kind(document_ids, window, key_bounds) -> str:
    if document_ids is not None:
        return "documents"
    if key_bounds is not None:
        return "key_bounds"
    return "window" if window is not None else "none"


def _signature(q, k, v, causal, softmax_scale, mask, window, deterministic, kernel, dropout_p, softcap, sinks):
    """What a call's checks and plan depend on, or None where it cannot be formed cheaply (inputs
    that are not tensors, traced calls: both take the full path)."""
    if torch.compiler.is_compiling() or not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
                                             and isinstance(v, torch.Tensor)
                                             and (sinks is None or isinstance(sinks, torch.Tensor))):
        return None
    aligned = (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 == 0   # TMA reads only 16-byte aligned bases
    sink = None if sinks is None else (sinks.shape, sinks.dtype, sinks.device, sinks.data_ptr() % 16 == 0)
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype, q.device,
            k.device, v.device, aligned, causal, softmax_scale, mask, window, deterministic, kernel, dropout_p,
            softcap, sink)


def _plan_call(q, k, v, causal, softmax_scale, mask, window, deterministic, kernel, dropout_p=0.0, softcap=None,
               sinks=None) -> _Call:
    """Check the inputs and make the call's plan (the masks are checked by the caller)."""
    check_inputs(q, k, v)
    dropout_p, softcap = check_scores(q, dropout_p, softcap, sinks)
    setting = plans.call_setting(q, k, v, bool(causal), mask, check_flag(deterministic, "deterministic"),
                                 plans.check_choice(kernel), dropout_p > 0, softcap > 0, sinks is not None)
    plan = (plans.make_plan if torch.compiler.is_compiling() else plans.plan_kernels)(setting)
    return _Call(plan, bool(causal), softmax_scale_for(softmax_scale, q.shape[-1]),
                 _window(window, k.shape[1]), dropout_p, softcap)


def flash_attention(q, k, v, causal=False, softmax_scale=None, return_lse=False, *,
                    document_ids=None, window=None, key_bounds=None, deterministic=True, kernel="auto",
                    dropout_p=0.0, softcap=None, sinks=None):
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
    False: dQ is summed in arrival order (its last bits vary from run to run, within the same
    error bound).
    kernel: which kernels run, "auto" | "triton" | "gluon" for both directions or a
    (forward, backward) pair of those words; the call's kernel plan (kernels/plan.py) says what
    each word means here, and "gluon" where it cannot run is a ValueError saying why.
    What the call does to its scores besides masking them (kernels/scores.py), forward and backward:
    dropout_p: drop each attention probability with this probability, scaling the kept ones by
    1 / (1 - dropout_p); the mask is drawn from a seed taken from torch's generator on q's device,
    once per call (pass it in training only). lse stays the undropped softmax's.
    softcap=c: every score s becomes c * tanh(s / c) before the softmax.
    sinks: (H,) logits, one per query head, each joining its rows' softmax denominator without a
    value (differentiable; lse includes it; a row that sees no key gets zeros and lse = its sink).
    """
    mask = _mask_kind(document_ids, window, key_bounds)
    key = _signature(q, k, v, causal, softmax_scale, mask, window, deterministic, kernel, dropout_p, softcap, sinks)
    try:
        call = _CALLS.get(key) if key is not None else None
    except TypeError:   # an unhashable option (a list for kernel, say): the full path says what is wrong
        key = call = None
    if call is None:
        call = _plan_call(q, k, v, causal, softmax_scale, mask, window, deterministic, kernel, dropout_p, softcap,
                          sinks)
        if key is not None:
            if len(_CALLS) >= MAX_CALLS:
                _CALLS.clear()
            _CALLS[key] = call
    if mask != "none":
        check_masks(q, k, causal, document_ids, window, key_bounds)
    doc_bounds = bounds_buffer(document_ids, key_bounds, k.shape[1]) if mask in ("documents", "key_bounds") else None
    rng = dropout_seed(q.device) if call.dropout_p else None
    sinks = None if sinks is None else sinks.float()   # the kernels read float32 (an fp32 parameter: itself)
    if not torch.compiler.is_compiling():
        packed = _projection(q, k, v) if key is not None else None
        if packed is not None:
            out, lse = _EagerPackedAttention.apply(packed, (q, k, v), call, doc_bounds, rng, sinks)
        else:
            out, lse = _EagerFlashAttention.apply(q, k, v, call, doc_bounds, rng, sinks)
    else:
        plan = call.plan
        out, lse = FAMILIES[plan.forward.family].forward_op(q, k, v, call.causal, call.scale, doc_bounds,
                                                           call.window, plan.deterministic, plan.backward.family,
                                                           call.softcap, call.dropout_p, rng, sinks)
    return (out, lse) if return_lse else out


def kernel_plan(q, k, v, causal=False, *, document_ids=None, window=None, key_bounds=None, deterministic=True,
                kernel="auto", dropout_p=0.0, softcap=None, sinks=None) -> plans.KernelPlan:
    """The kernel plan flash_attention follows for these arguments (kernels/plan.py), without running it."""
    return _plan_call(q, k, v, causal, None, _mask_kind(document_ids, window, key_bounds), window, deterministic,
                      kernel, dropout_p, softcap, sinks).plan


def _window(window, n_k: int) -> int:
    """The kernels' window argument: 0 for none, and for a window of every key (plain causal)."""
    return 0 if window is None or window >= n_k else int(window)


def flash_attention_backward(dout, q, k, v, out, lse, causal=False, softmax_scale=None, deterministic=True, *,
                             document_ids=None, window=None, key_bounds=None, kernel="auto", softcap=None):
    """dq, dk, dv of flash_attention from a given output `out` and log-sum-exp `lse`.

    The backward kernels only need P = exp(S - lse) and rowsum(dO * O), so `out` and
    `lse` may come from attention over a longer key set than `k`, `v` (a ring's merged
    result): the gradients are then this key block's exact share, to be summed over
    blocks. Same layouts as flash_attention; lse (B, H, Nq) float32; dk, dv are summed
    over each GQA group and shaped like k, v. deterministic, kernel, softcap and the masks
    (document_ids, window, key_bounds) as in flash_attention: the block's own mask; the plan's
    backward runs. Sinks need no argument (their share is in lse; their gradient is
    kernels.scores.sink_grad of the merged out and lse); dropout has none (its mask is the forward's).
    """
    mask = _mask_kind(document_ids, window, key_bounds)
    call = _plan_call(q, k, v, causal, softmax_scale, mask, window, deterministic, kernel, softcap=softcap)
    check_masks(q, k, causal, document_ids, window, key_bounds)
    check_like_q(q, dout=dout, out=out)
    check_lse(q, lse)
    family = FAMILIES[call.plan.backward.family]
    launch = family.backward_op if torch.compiler.is_compiling() else family.backward
    dq, dk, dv, _delta = launch(dout, q, k, v, out, lse.contiguous(), call.causal, call.scale,
                                bounds_buffer(document_ids, key_bounds, k.shape[1]), call.window,
                                call.plan.deterministic, softcap=call.softcap)
    return dq, dk, dv
