"""Document masks and sliding windows in the Triton FlashAttention, against a float64 reference.

Same error contract as test_flash_attention.py (at most 2x the same-dtype formula's error,
NaN never passes, poisoned uninitialised memory). On a CPU the kernels run in Triton's
interpreter with 32 x 32 tiles, so the documents below are chosen around that size:
shorter than a tile, exactly one tile, crossing tile edges, length 1. On CUDA the same
cases run in bfloat16/float16 at larger sizes.
"""
import functools
import math
import random

import pytest
import torch

from conftest import HAS_CUDA, ON_HOPPER, requires_cuda
from kernels import attention_reference, flash_attention, flash_attention_backward
from kernels.masks import bounds_buffer, document_bounds, visible_mask
from model.attention import ATTENTION
from test_flash_attention import (DEVICE, DTYPES, NAMES, assert_as_exact_as_plain, assert_compiled_matches_eager,  # noqa: F401
                                  check_against_reference, forward_backward, make_inputs, poison_uninitialised_memory)

SCALE = 8 if HAS_CUDA else 1   # GPU cases are the CPU ones with every length x8


def ids_from_lengths(*rows):
    """(B, N) int32 document ids of batch rows given as lists of document lengths."""
    ids = [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows]
    return torch.stack(ids).to(DEVICE, torch.int32)


def lengths(*docs):
    return [d * SCALE for d in docs]


# (name, B, H, Hkv, D, document lengths per batch row or None, window, causal)
CASES = [
    ("short_long_len1", 1, 4, 2, 16, [lengths(5, 40, 1, 24)], None, True),
    ("two_rows_noncausal", 2, 2, 2, 32, [lengths(33, 3, 34), lengths(1, 1, 68)], None, False),
    ("whole_window", 1, 2, 1, 16, [lengths(70)], None, True),
    ("all_length1", 1, 2, 2, 16, [[1] * (40 * SCALE)], None, True),
    ("window", 1, 4, 1, 32, None, 20 * SCALE, True),
    ("window_1", 1, 2, 2, 16, None, 1, True),
    ("window_and_docs", 2, 2, 1, 16, [lengths(10, 50, 10), lengths(70)], 24 * SCALE, True),
]


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_masks_match_float64_reference(case, deterministic):
    _, B, H, Hkv, D, docs, window, causal = case
    ids = None if docs is None else ids_from_lengths(*docs)
    n = ids.shape[1] if ids is not None else 70 * SCALE
    check_against_reference(*make_inputs(B, n, n, H, Hkv, D, DTYPES[0]), causal, deterministic,
                            document_ids=ids, window=window)


@pytest.mark.parametrize("dtype", DTYPES[1:], ids=str)
def test_window_and_docs_other_dtype(dtype):
    ids = ids_from_lengths(lengths(7, 30, 33))
    check_against_reference(*make_inputs(1, ids.shape[1], ids.shape[1], 2, 2, 32, dtype), True,
                            document_ids=ids, window=17 * SCALE)


def test_window_with_fewer_queries_than_keys():
    """Bottom-right alignment: the queries are the last Nq positions of the keys."""
    check_against_reference(*make_inputs(1, 40 * SCALE, 72 * SCALE, 2, 1, 16, DTYPES[0]), True, window=16 * SCALE)


def test_strided_fused_qkv_with_documents():
    B, N, H, D = 2, 37 * SCALE, 4, 32
    qkv = torch.randn(B, N, 3, H, D, device=DEVICE).to(DTYPES[0])
    q, k, v = qkv.unbind(2)
    do = torch.randn(B, N, H, D, device=DEVICE).to(DTYPES[0])
    ids = ids_from_lengths(lengths(12, 25), lengths(30, 1, 6))
    check_against_reference(q, k, v, do, True, document_ids=ids, window=9 * SCALE)


def test_single_token_documents_see_only_themselves():
    """Every token its own document: out = v and lse = the token's own score, exactly."""
    ids = torch.arange(40, device=DEVICE, dtype=torch.int32)[None]
    q, k, v, do = make_inputs(1, 40, 40, 2, 2, 16, DTYPES[0])
    out, lse = flash_attention(q, k, v, causal=True, document_ids=ids, return_lse=True)
    assert torch.equal(out, v)
    own = (q.double() * k.double()).sum(-1).transpose(1, 2) / math.sqrt(16)
    torch.testing.assert_close(lse.double(), own, atol=1e-2 if DTYPES[0] != torch.float32 else 1e-5, rtol=0)


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
def test_tiles_outside_the_mask_are_never_read(deterministic):
    """Keys of other documents (and past the window) are NaN. A kernel that visited their
    tiles, even masked, would turn them into NaN through 0 * NaN in P V, dP, dS; a
    skipping kernel gives the other document exactly what it gets alone. Documents are
    whole tiles here (64 = 2 x 32 on the CPU), so the skipped tiles hold nothing else."""
    n = 64 * SCALE
    ids = ids_from_lengths([n, n])
    q, k, v, do = make_inputs(1, 2 * n, 2 * n, 2, 1, 32, DTYPES[0])
    for t in (q, k, v, do):
        t[:, :n] = float("nan")
    for causal in (False, True):
        out, lse, dq, dk, dv = forward_backward(flash_attention, q, k, v, do, causal, document_ids=ids,
                                                deterministic=deterministic)
        alone = forward_backward(flash_attention, *(t[:, n:] for t in (q, k, v, do)), causal,
                                 deterministic=deterministic)
        for name, masked, single in zip(NAMES, (out[:, n:], lse[..., n:], dq[:, n:], dk[:, n:], dv[:, n:]), alone):
            assert not torch.isnan(masked).any(), f"{name} of the second document read a skipped tile"
            # the same tiles in the same order: identical in the interpreter; on a GPU the
            # masked kernel may be tuned to another tile shape, so only close
            tol = 0 if not HAS_CUDA else 2e-2
            torch.testing.assert_close(masked, single, atol=tol, rtol=tol, msg=f"{name}, causal={causal}")
        assert torch.isnan(out[:, :n]).all(), "the poisoned document should itself be NaN"
    # window: queries of the last half never reach keys before n - window
    w = 32 * SCALE
    q, k, v, do = make_inputs(1, 2 * n, 2 * n, 2, 2, 32, DTYPES[0])
    ref = attention_reference(q.double(), k.double(), v.double(), causal=True, window=w)
    k[:, : n - w] = float("nan")
    v[:, : n - w] = float("nan")
    out = flash_attention(q, k, v, causal=True, window=w)
    assert not torch.isnan(out[:, n:]).any(), "a tile outside the window was read"
    assert ((out[:, n:].double() - ref[:, n:]).abs().max() < 2e-2)


def test_document_bounds_are_runs_of_equal_ids():
    ids = torch.tensor([[3, 3, 1, 1, 1, 3, 7], [0, 1, 2, 3, 4, 5, 6]], device=DEVICE)
    bounds = document_bounds(ids).cpu()
    assert bounds.dtype == torch.int32 and bounds.shape == (2, 2, 7)
    assert bounds[0, 0].tolist() == [0, 0, 2, 2, 2, 5, 6]
    assert bounds[0, 1].tolist() == [2, 2, 5, 5, 5, 6, 7]
    assert bounds[1, 0].tolist() == list(range(7)) and bounds[1, 1].tolist() == list(range(1, 8))
    # the dense oracle's mask agrees: the same runs, whatever the ids' values
    mask = visible_mask(7, 7, False, ids, None, ids.device)[0].cpu()
    cols = torch.arange(7)
    assert torch.equal(mask, (cols[None] >= bounds[0, 0][:, None]) & (cols[None] < bounds[0, 1][:, None]))


def _bounds_by_walking(ids):
    """The definition, one row at a time: a run of equal ids from where it opens to where it closes."""
    rows = []
    for row in ids.tolist():
        start, end, n = [0] * len(row), [0] * len(row), len(row)
        for i in range(n):
            start[i] = start[i - 1] if i and row[i] == row[i - 1] else i
        for i in reversed(range(n)):
            end[i] = end[i + 1] if i + 1 < n and row[i] == row[i + 1] else i + 1
        rows.append([start, end])
    return torch.tensor(rows, dtype=torch.int32)


@pytest.mark.parametrize("seed", range(4))
def test_document_bounds_match_a_walk_along_each_row(seed):
    """Runs never join across rows, even where one row ends with the id the next begins with."""
    gen = torch.Generator().manual_seed(seed)
    b, n = 5, 97
    ids = torch.randint(0, 3, (b, n), generator=gen).cumsum(1) % 4   # runs of random lengths, ids reused
    ids[1, 0] = ids[0, -1]                                             # a run that would join across rows
    ids[3] = 7                                                         # one document filling its row
    bounds = document_bounds(ids.to(DEVICE)).cpu()
    assert bounds.shape == (b, 2, n) and bounds.dtype == torch.int32
    assert torch.equal(bounds, _bounds_by_walking(ids))


def test_bounds_buffer_is_built_once_for_the_same_unchanged_ids():
    """The layers of a forward pass one ids tensor: the buffer is reused for that very tensor and
    rebuilt for another one, for a changed key count, after an in-place change, and under
    inference mode (no version counter), always with the values a fresh build gives."""
    ids = ids_from_lengths([5, 19])
    first = bounds_buffer(ids)
    assert bounds_buffer(ids) is first
    assert bounds_buffer(ids.clone()) is not first
    assert bounds_buffer(ids) is not first and torch.equal(bounds_buffer(ids), first)   # the clone came between
    ids[0, 20:] = 2                                                     # a third document, in place
    changed = bounds_buffer(ids)
    assert not torch.equal(changed, first) and torch.equal(changed, bounds_buffer(ids.clone()))
    keys = monotone_bounds(1, 40, 70, 3)
    assert bounds_buffer(key_bounds=keys, n_k=70) is bounds_buffer(key_bounds=keys, n_k=70)
    assert not torch.equal(bounds_buffer(key_bounds=keys, n_k=50), bounds_buffer(key_bounds=keys, n_k=70))
    with torch.inference_mode():
        frozen = ids_from_lengths([5, 19])
        assert torch.equal(bounds_buffer(frozen), first) and bounds_buffer(frozen) is not bounds_buffer(frozen)


@pytest.mark.parametrize("kw, match", [
    (dict(causal=False, window=4), "window needs causal"),
    (dict(causal=True, window=0), "window must be a positive int"),
    (dict(causal=True, document_ids=torch.zeros(1, 5, dtype=torch.int32)), "document_ids has shape"),
    (dict(causal=True, document_ids=torch.zeros(1, 8)), "integer"),
])
def test_bad_masks_are_refused(kw, match):
    q, k, v, _ = make_inputs(1, 8, 8, 2, 2, 16, DTYPES[0])
    if isinstance(kw.get("document_ids"), torch.Tensor):
        kw["document_ids"] = kw["document_ids"].to(DEVICE)
    for fn in (flash_attention, attention_reference):
        with pytest.raises(ValueError, match=match):
            fn(q, k, v, **kw)


def test_documents_need_as_many_queries_as_keys():
    q, k, v, _ = make_inputs(1, 8, 16, 2, 2, 16, DTYPES[0])
    with pytest.raises(ValueError, match="as many queries as keys"):
        flash_attention(q, k, v, causal=True, document_ids=torch.zeros(1, 16, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_registry_entries_agree_with_masks(dtype):
    """naive, sdpa and flash compute the same masked attention (flash in float32: its widest dtype)."""
    ids = ids_from_lengths([3, 30, 1, 16], [50]).cpu()
    q, k, v = (torch.randn(2, 50, 4, 16, dtype=dtype) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]
    ref = attention_reference(q.double(), k.double(), v.double(), causal=True, document_ids=ids, window=12)
    for name in ("naive", "sdpa"):
        out = ATTENTION[name](q, k, v, causal=True, document_ids=ids, window=12)
        torch.testing.assert_close(out.double(), ref, atol=1e-5 if dtype == torch.float32 else 1e-12, rtol=0)
    if not HAS_CUDA:
        flash = ATTENTION["flash"](q.float(), k.float(), v.float(), causal=True, document_ids=ids, window=12)
        torch.testing.assert_close(flash.double(), ref, atol=1e-5, rtol=0)


def test_eager_path_and_registered_op_agree_with_masks():
    q, k, v, do = make_inputs(1, 40, 40, 4, 2, 32, DTYPES[0])
    ids = ids_from_lengths([9, 31])
    bounds = bounds_buffer(ids)

    def through_op(q, k, v, causal, return_lse, **_):
        return torch.ops.flashtrain.flash_attn_fwd(q, k, v, causal, 1 / math.sqrt(32), bounds, 7)

    eager = forward_backward(flash_attention, q, k, v, do, causal=True, document_ids=ids, window=7)
    op = forward_backward(through_op, q, k, v, do, causal=True)
    for a, b in zip(eager, op):
        assert torch.equal(a, b)


def test_registered_op_with_masks_passes_opcheck():
    q, k, v, _ = make_inputs(1, 24, 24, 2, 1, 32, DTYPES[-1] if not HAS_CUDA else torch.float16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    bounds = bounds_buffer(ids_from_lengths([5, 19]))
    checks = ("test_schema", "test_autograd_registration") + (("test_faketensor",) if HAS_CUDA else ())
    torch.library.opcheck(torch.ops.flashtrain.flash_attn_fwd.default, (q, k, v, True, 0.2, bounds, 6),
                          test_utils=checks)


@requires_cuda
def test_torch_compile_fullgraph_with_masks_matches_eager():
    """The custom op carries the document bounds and the window through torch.compile: the same
    bits as eager on the same tile shapes, and as exact as plain attention against float64."""
    ids = ids_from_lengths(lengths(10, 50, 10), lengths(70))
    window = ids.shape[1] // 5   # shorter than the window of tokens, so it masks
    q, k, v, do = make_inputs(2, ids.shape[1], ids.shape[1], 8, 2, 64, torch.bfloat16)
    assert_compiled_matches_eager(
        lambda q, k, v: flash_attention(q, k, v, causal=True, document_ids=ids, window=window) * 2, q, k, v, do)
    compiled = torch.compile(flash_attention, fullgraph=True)
    ours = forward_backward(compiled, q, k, v, do, True, document_ids=ids, window=window)
    same_dtype = forward_backward(attention_reference, q, k, v, do, True, document_ids=ids, window=window)
    exact = forward_backward(attention_reference, *(t.double() for t in (q, k, v, do)), True,
                             document_ids=ids, window=window)
    for name, mine, plain, ref in zip(NAMES, ours, same_dtype, exact):
        assert_as_exact_as_plain(name, mine, plain, ref, do, v)


# ----------------------------------------------------------------------------- key_bounds

def monotone_bounds(B, n_q, n_k, seed):
    """Per-query key intervals, both ends nondecreasing (as a ring's chunk pairs have them),
    past both ends of the keys and with empty rows (lo >= hi) among them."""
    g = torch.Generator().manual_seed(seed)
    lo = torch.sort(torch.randint(-3, n_k + 3, (B, n_q), generator=g), 1).values
    hi = torch.sort(torch.randint(0, n_k + 5, (B, n_q), generator=g), 1).values
    return torch.stack([lo, hi], 1).to(DEVICE)


@pytest.mark.parametrize("monotone, deterministic", [(True, True), (True, False), (False, True)],
                         ids=["nondecreasing-det", "nondecreasing-atomic", "any-det"])
def test_key_bounds_match_float64_reference(monotone, deterministic):
    """A block with Nq != Nk told each query's keys: forward, lse and gradients as the dense mask
    gives them; bounds that are not nondecreasing are honoured too (every tile visited, masked)."""
    B, n_q, n_k = 2, 40 * SCALE, 70 * SCALE
    bounds = monotone_bounds(B, n_q, n_k, 0)
    if not monotone:
        g = torch.Generator().manual_seed(1)
        lo = torch.randint(0, n_k, (B, n_q), generator=g)
        bounds = torch.stack([lo, lo + torch.randint(-5, 30 * SCALE, (B, n_q), generator=g)], 1).to(DEVICE)
        assert not bounds_buffer(key_bounds=bounds, n_k=n_k)[:, -1].any()
    assert (bounds[:, 1] <= bounds[:, 0]).any(), "the case should hold rows that see no key"
    check_against_reference(*make_inputs(B, n_q, n_k, 2, 1, 16, DTYPES[0]), False, deterministic, key_bounds=bounds)


def test_key_bounds_with_causal_and_window():
    n = 70 * SCALE
    check_against_reference(*make_inputs(1, n, n, 2, 1, 16, DTYPES[0]), True, key_bounds=monotone_bounds(1, n, n, 2),
                            window=9 * SCALE)


def test_key_bounds_skip_the_tiles_outside_them_and_the_explicit_backward_agrees():
    """Keys before every query's interval (a whole tile of them) are NaN: a kernel that read their
    tile, even masked, would spread NaN through 0 * NaN. They get no gradient, the others are
    exact; flash_attention_backward with the same key_bounds gives autograd's gradients."""
    n_q, n_k, unseen = 40 * SCALE, 96 * SCALE, 32 * SCALE
    q, k, v, do = make_inputs(1, n_q, n_k, 2, 1, 32, DTYPES[0])
    lo = torch.linspace(unseen, 64 * SCALE, n_q).long()
    bounds = torch.stack([lo, lo + 32 * SCALE], 0)[None].to(DEVICE)
    exact = forward_backward(attention_reference, *(t.double() for t in (q, k, v, do)), False, key_bounds=bounds)
    k[:, :unseen] = v[:, :unseen] = float("nan")
    got = forward_backward(flash_attention, q, k, v, do, False, key_bounds=bounds)
    for name, mine, ref in zip(NAMES, got, exact):
        assert not torch.isnan(mine).any(), f"{name}: a tile outside every interval was read"
        torch.testing.assert_close(mine.double(), ref, atol=3e-2 if HAS_CUDA else 1e-4, rtol=0, msg=name)
    assert not got[3][:, :unseen].any() and not got[4][:, :unseen].any()
    out, lse = flash_attention(q, k, v, return_lse=True, key_bounds=bounds)
    for name, a, b in zip(("dq", "dk", "dv"), flash_attention_backward(do, q, k, v, out, lse, key_bounds=bounds),
                          got[2:]):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("kw, match", [
    (dict(key_bounds=torch.zeros(1, 2, 7, dtype=torch.int32)), "key_bounds must be an integer tensor of shape"),
    (dict(key_bounds=torch.zeros(1, 2, 8)), "key_bounds must be an integer tensor"),
    (dict(key_bounds=torch.zeros(1, 2, 8, dtype=torch.int32), document_ids=torch.zeros(1, 8, dtype=torch.int32)),
     "pass document_ids or key_bounds, not both"),
])
def test_bad_key_bounds_are_refused(kw, match):
    q, k, v, _ = make_inputs(1, 8, 8, 2, 2, 16, DTYPES[0])
    kw = {name: t.to(DEVICE) for name, t in kw.items()}
    for fn in (flash_attention, attention_reference):
        with pytest.raises(ValueError, match=match):
            fn(q, k, v, causal=True, **kw)


# A training window's documents at the length the long-context recipe trains (32,768 tokens):
# shorter than a tile, off the tile grid, and one of 16K whose first keys are seen by ~16K
# queries. The GPU cases above stop at ~600 tokens; this is the length where a key's gradient
# sums the most query tiles, and where retrieval from far back depends on it.
LONG_DOCS = [64, 700, 16384, 9000, 6620]
FAR_KEYS = 1024   # checked apart in documents of at least 4x as many tokens
LONG_SEED = random.SystemRandom().randrange(2**31)   # fresh inputs each session, shared by the cases


@functools.cache
def _long_window_reference(heads, kv_heads):
    """Inputs and, per document, the float64 and same-dtype formulas' out, lse, dq, dk, dv: the
    documents do not see one another, so each is a causal call of its own (a 32K dense float64
    reference would need ~9 GB a score matrix and head)."""
    total = sum(LONG_DOCS)
    q, k, v, do = make_inputs(1, total, total, heads, kv_heads, 64, torch.bfloat16, gen_seed=LONG_SEED)
    per_doc, start = [], 0
    for n in LONG_DOCS:
        part = [t[:, start:start + n] for t in (q, k, v, do)]
        exact = forward_backward(attention_reference, *(t.double() for t in part), True)
        plain = forward_backward(attention_reference, *part, True)
        per_doc.append((start, n, plain, exact))
        start += n
    return (q, k, v, do), per_doc


@requires_cuda
@pytest.mark.parametrize("backward", ["triton", "gluon"])
@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (2, 1)], ids=["mha", "gqa"])
def test_long_training_window_matches_float64_reference_per_document(backward, heads, kv_heads):
    """Every document of a 32K window, and apart the far keys of the longest (its first FAR_KEYS,
    seen by every later query of it, whose share of the whole tensor's norm is too small for a
    wrong or skipped tile there to show), within 2x the same-dtype formula's error."""
    if backward == "gluon" and not ON_HOPPER:
        pytest.skip("the Gluon backward needs an sm_90 (Hopper) GPU")
    (q, k, v, do), per_doc = _long_window_reference(heads, kv_heads)
    ids = ids_from_lengths(LONG_DOCS)
    ours = forward_backward(flash_attention, q, k, v, do, True, document_ids=ids, kernel=("triton", backward))
    for start, n, plain, exact in per_doc:
        mine = [t[..., start:start + n] if name == "lse" else t[:, start:start + n] for name, t in zip(NAMES, ours)]
        where = f"the {n}-token document at {start} (inputs' seed {LONG_SEED})"
        for name, m, p, e in zip(NAMES, mine, plain, exact):
            _as_exact_as_plain_in(where, name, m, p, e, do, v)
        if n >= 4 * FAR_KEYS:
            for i in (3, 4):
                _as_exact_as_plain_in(f"its first {FAR_KEYS} keys, {where}", NAMES[i], mine[i][:, :FAR_KEYS],
                                      plain[i][:, :FAR_KEYS], exact[i][:, :FAR_KEYS], do, v)


def _as_exact_as_plain_in(where, name, *tensors):
    """assert_as_exact_as_plain, its message saying which part of the window failed."""
    try:
        assert_as_exact_as_plain(name, *tensors)
    except AssertionError as e:
        raise AssertionError(f"{where}: {e}") from None
