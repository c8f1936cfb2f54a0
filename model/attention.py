"""Attention implementations by name: the one switch between naive, SDPA and our kernel.

Every entry has the signature of `kernels.flash_attention`:
``fn(q, k, v, causal=False, softmax_scale=None, *, document_ids=None, window=None, dropout_p=0.0) -> out``
with q (B, Nq, H, D) and k, v (B, Nk, Hkv, D), H % Hkv == 0 (grouped-query attention),
any strides, causal masks aligned bottom-right when Nq != Nk, the same document
mask and sliding window (kernels/masks.py), and dropout on the attention probabilities. Soft-capping
and sinks (`softcap=`, `sinks=`, kernels/scores.py) are the keywords of the entries SCORE_OPTIONS
lists. The model calls them through this registry only, so comparing implementations is a one-word
config change.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kernels import flash_attention
from kernels.checks import DRAWN_RANGE, DROPOUT_STEPS, INTERPRET, drawable_dropout
from kernels.decode import decode_mask, decode_reference, flash_decode
from kernels.masks import check_masks, visible_mask
from kernels.plan import check_choice
from kernels.reference import attention_reference

AttentionFn = Callable[..., torch.Tensor]


def sdpa_attention(q, k, v, causal=False, softmax_scale=None, *, document_ids=None, window=None, dropout_p=0.0):
    """torch's scaled_dot_product_attention on (B, N, H, D) tensors; `dropout_p` drops attention
    probabilities (the model passes it in training only: `model.attention_dropout`).

    SDPA wants (B, H, N, D): transposed views are enough (no copies), and `enable_gqa`
    lets it read the shared K/V heads without materialising them H / Hkv times. It is
    only passed when heads are shared: some CUDA backends (memory-efficient, cuDNN in
    some versions) refuse `enable_gqa=True` and SDPA would fall back to a slower one.
    SDPA's own `is_causal` is aligned top-left, so Nq != Nk uses the bottom-right bias.
    Documents and windows go in as an explicit boolean mask (B, 1, Nq, Nk), which keeps
    SDPA off its flash backends: it is the comparison point, not the fast path.
    """
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"q has {q.shape[2]} heads, not a multiple of k's {k.shape[2]}")
    check_masks(q, k, causal, document_ids, window)
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    n_q, n_k = q.shape[1], k.shape[1]
    if document_ids is not None or window is not None:
        mask, causal = visible_mask(n_q, n_k, causal, document_ids, window, q.device)[:, None], False
    else:
        mask = causal_lower_right(n_q, n_k) if causal and n_q != n_k else None
    out = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, is_causal=causal and mask is None,
        dropout_p=dropout_p, scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


# To register another implementation, add one line here (and its decode step to DECODE below).
ATTENTION: dict[str, AttentionFn] = {
    "naive": attention_reference,   # materialises the N x N scores: the baseline
    "sdpa": sdpa_attention,
    "flash": flash_attention,       # our Triton kernel (kernels/)
}


# What each entry computes besides masked attention and dropout: soft-capped scores (`softcap`) and
# attention sinks (`sinks`), ours and the reference; SDPA has neither.
SCORE_OPTIONS: dict[str, tuple[str, ...]] = {"naive": ("softcap", "sinks"), "sdpa": (), "flash": ("softcap", "sinks")}


def check_score_options(name: str, softcap: float | None, sinks: bool, dropout: float = 0.0) -> None:
    """Refuse, in one line, a model whose soft-capping or sinks attention `name` does not compute, or
    whose attention dropout ours would round to 0 or 1 (it draws p in steps of 1/256: kernels/scores.py)."""
    able = " or ".join(n for n, options in SCORE_OPTIONS.items() if options)
    for key, option, value, what in (("model.attention_softcap", "softcap", softcap, "logit soft-capping"),
                                     ("model.attention_sinks", "sinks", "true" if sinks else None, "attention sinks")):
        if value is not None and option not in SCORE_OPTIONS[_check_name(name)]:
            raise ValueError(f"{key}={value} needs attention={able} (attention={name} has no {what})")
    if name == "flash" and not drawable_dropout(dropout):
        raise ValueError(f"model.attention_dropout={dropout}: attention=flash draws it in steps of 1/{DROPOUT_STEPS}, "
                         f"so it must lie in {DRAWN_RANGE} or be 0 (attention=sdpa and naive take any p)")


def sdpa_decode(q, k, v, cache_len, softmax_scale=None, *, window=None):
    """SDPA over a static KV cache's whole buffers, the keys past `cache_len` (a device tensor)
    masked by an explicit boolean mask: the decode entry of `sdpa` (see DECODE)."""
    check_masks(q, k, True, None, window)
    mask = decode_mask(q.shape[1], k.shape[1], cache_len, window)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


# Each implementation's decode step over a static KV cache (model/kv_cache.py: StaticKVCache):
# fn(q, k_buffer, v_buffer, cache_len, softmax_scale=None, *, window=None) (and the SCORE_OPTIONS
# keywords of the entries that have them), the new queries being
# the last of the `cache_len` valid keys (a one-element device tensor), so a step's shapes never
# change and it can be replayed from a CUDA graph. Ours is split over the keys (kernels/decode.py).
DECODE: dict[str, AttentionFn] = {
    "naive": decode_reference,
    "sdpa": sdpa_decode,
    "flash": flash_decode,
}


def _check_name(name: str) -> str:
    if name not in ATTENTION:
        raise ValueError(f"attention {name!r} is not registered; valid: {', '.join(ATTENTION)}")
    return name


def get_attention(name: str, deterministic: bool = True, kernel="auto") -> AttentionFn:
    """The attention function registered as `name` (an already resolved name, not 'auto').
    deterministic (config `attention.deterministic`) picks our kernel's backward: False sums dQ in
    arrival order. naive's backward is deterministic anyway; sdpa's is whatever PyTorch's backend
    does, so the flag changes nothing for them. kernel: our kernel's words, auto | triton | gluon for
    both directions or a (forward, backward) pair (`attention.kernel`, `attention.forward_kernel`,
    `attention.backward_kernel`; kernels/plan.py says what runs); the other implementations have no
    such choice and take only 'auto'."""
    if not isinstance(deterministic, bool):
        raise ValueError(f"attention.deterministic must be true or false, got {deterministic!r}")
    fn = ATTENTION[_check_name(name)]
    words = check_choice(kernel)
    if fn is not flash_attention:
        if words != ("auto", "auto"):
            raise ValueError(f"attention.kernel={kernel} chooses attention=flash's kernels; attention={name} takes "
                             "only attention.kernel=auto")
        return fn
    kwargs = {} if deterministic else {"deterministic": False}
    if words != ("auto", "auto"):
        kwargs["kernel"] = words[0] if words[0] == words[1] else words
    return partial(fn, **kwargs) if kwargs else fn


def get_decode_attention(name: str) -> AttentionFn:
    """The decode entry (see DECODE) of attention `name`."""
    return DECODE[_check_name(name)]


def resolve_attention(name: str, device, score_options: bool = False) -> str:
    """Turn the config's attention name into a registered one: 'auto' means our flash
    kernel on CUDA and SDPA elsewhere, or naive elsewhere when the model soft-caps its scores or
    has sinks (`score_options`: SDPA has neither); any other name must be registered as given."""
    on_cuda = torch.device(device).type == "cuda"
    if name == "auto":
        name = "flash" if on_cuda else "naive" if score_options else "sdpa"
    if name == "flash" and not on_cuda and not INTERPRET:
        raise ValueError(f"attention=flash needs a CUDA device (got device={device}); use attention=sdpa "
                         "or naive on CPU, or set TRITON_INTERPRET=1 to run the kernel in Triton's interpreter, "
                         "which is for testing it: about a minute per step of the default tiny run, where sdpa "
                         "takes a fraction of a second")
    return _check_name(name)
