"""Soft-capping, sinks and attention dropout in the Triton kernels (kernels/scores.py), forward and
backward, against the float64 reference.

The error contract is test_flash_attention.py's: at most 2x as far from the float64 answer as the
plain formula in the same dtype, NaN never passes, uninitialised memory is poisoned. Dropout is
compared given the kernels' own mask: the test takes the seed the call drew (by replaying torch's
generator) and regenerates the mask for every (batch, head, query, key) with kernels.scores.
dropout_mask, which the reference then applies. The mask's statistics are checked on their own:
the kept fraction within a few standard deviations of 1 - p, per key position in a Philox word too,
and the same seed gives the same mask, another seed another one. The mask is also checked bit for
bit against a NumPy Philox, which pins the GPU's inline-PTX products to the interpreter's. On a
CPU the kernels run in Triton's interpreter at tiny shapes; on CUDA the same cases run in
bfloat16/float16, larger.
"""
import contextlib
import itertools
import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from conftest import HAS_CUDA, requires_cuda
from kernels import attention_reference, flash_attention
from kernels.decode import decode_reference, flash_decode
from kernels.checks import drawn_dropout_p
from kernels.scores import dropout_draw_at, dropout_mask, dropout_seed
from test_document_mask import ids_from_lengths, lengths
from test_flash_attention import (DEVICE, DTYPES, assert_as_exact_as_plain, make_inputs,  # noqa: F401
                                  poison_uninitialised_memory, strided_leaf)

SCALE = 8 if HAS_CUDA else 1   # GPU cases are the CPU ones with every length x8
DETERMINISTIC = pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])


@contextlib.contextmanager
def replayed_generator():
    """Runs the body with torch's generator of DEVICE as it is now, then puts it back: the next draw
    repeats the body's first (the dropout seed of the call inside it)."""
    cuda = DEVICE == "cuda"
    state = torch.cuda.get_rng_state() if cuda else torch.get_rng_state()
    yield
    (torch.cuda.set_rng_state if cuda else torch.set_rng_state)(state)


def run(fn, q, k, v, do, causal, sinks=None, **kw):
    """out, lse and the gradients of q, k, v (and of the sinks, when given) of fn."""
    q, k, v = (strided_leaf(t.detach()) for t in (q, k, v))
    leaves = (q, k, v)
    if sinks is not None:
        sinks = sinks.detach().clone().requires_grad_()
        leaves += (sinks,)
        kw["sinks"] = sinks
    out, lse = fn(q, k, v, causal=causal, return_lse=True, **kw)
    return (out, lse, *torch.autograd.grad(out, leaves, do))


def check(q, k, v, do, causal, sinks=None, dropout_p=0.0, **kw):
    """Ours against the float64 reference, as exact as the plain formula in q's dtype; with dropout,
    given the mask our call drew."""
    if dropout_p:
        with replayed_generator():
            ours = run(flash_attention, q, k, v, do, causal, sinks, dropout_p=dropout_p, **kw)
        mask = dropout_mask(dropout_seed(q.device), dropout_p, q.shape[0], q.shape[2], q.shape[1], k.shape[1])
        kw = dict(kw, dropout_p=drawn_dropout_p(dropout_p), dropout_mask=mask)   # p as the kernels draw it
    else:
        ours = run(flash_attention, q, k, v, do, causal, sinks, **kw)
    kw = {name: value for name, value in kw.items() if name not in ("deterministic", "kernel")}   # ours only
    plain = run(attention_reference, q, k, v, do, causal, sinks, **kw)
    exact = run(attention_reference, *(t.double() for t in (q, k, v, do)), causal,
                None if sinks is None else sinks.double(), **kw)
    names = ("out", "lse", "dq", "dk", "dv")
    for name, mine, p, ref in zip(names, ours, plain, exact):
        assert_as_exact_as_plain(name, mine, p, ref, do, v)
    if sinks is not None:
        check_sink_grad(ours, plain, exact, do, sinks)
    return ours


def check_sink_grad(ours, plain, exact, do, sinks):
    """The sinks' gradient comes from Delta = rowsum(dO * O) of the stored output, the identity every
    FlashAttention backward uses (kernels/scores.py): -sum over rows of exp(sink - L) Delta. That is a
    second standard formula beside the plain one (autograd through the softmax), with errors of its
    own: the sum over rows cancels (Delta takes both signs), so evaluated in float32 it can be ~10x
    the plain formula's error. The bound is 2x the larger of the two formulas' errors in the kernel's
    float32 arithmetic, plus what the rounding of our own outputs O and L (each held to 2x by its
    check) costs the identity, evaluated in float64: large in 16-bit dtypes, and in float32 too where
    the rows cancel most. L's share was once left out, and a rare draw of the float32 case failed by
    it (CI, 2026-12-07: 1.73e-6 against a bound of 1.65e-6; of 300 draws since, the worst reached
    0.90 of that bound and 0.68 of this one)."""
    mine, base = rel(ours[5], exact[5]), rel(plain[5], exact[5])
    out, lse = ours[0].double(), ours[1].double()

    def identity(out, lse, dtype):
        delta = (do.to(dtype) * out.to(dtype)).sum(-1).transpose(1, 2)
        return -(torch.exp(sinks.to(dtype)[None, :, None] - lse.to(dtype)) * delta).sum((0, 2))
    exact_identity = identity(out, lse, torch.float64)
    in_float32 = rel(identity(ours[0], ours[1], torch.float32), identity(ours[0], ours[1], torch.float64))
    rounding = rel(exact_identity, exact[5])
    assert mine <= 2 * max(base, in_float32) + rounding + 1e-6, \
        f"dsinks: rel err {mine:.3g} > 2 x max(plain {base:.3g}, identity in float32 {in_float32:.3g}) + rounding {rounding:.3g}"


def rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def heads(H, dtype=torch.float32):
    """A sink logit per head, around the scores' own size."""
    g = torch.Generator().manual_seed(H)
    return torch.randn(H, generator=g).to(DEVICE, torch.float32)


# (B, n_q, n_k, H, H_kv, D): Nq == Nk with GQA, Nq < Nk, Nq > Nk (causal rows that see no key)
SHAPES = [(2, 40 * SCALE, 40 * SCALE, 4, 2, 32), (1, 24 * SCALE, 56 * SCALE, 2, 1, 16),
          (1, 56 * SCALE, 24 * SCALE, 2, 2, 16)]
IDS = lambda s: "B{}_q{}_k{}_H{}_kv{}_D{}".format(*s)  # noqa: E731


# ---- soft-capping and sinks -----------------------------------------------------------------

def cases(shapes):
    """(dtype, shape, causal, deterministic): every shape, causal or not, in the first dtype with the
    deterministic backward; the first shape, causal, with the atomic backward (it shares the tile
    code) and in the second dtype (CI time: the interpreter runs these)."""
    first, second = DTYPES
    det = [(first, shape, causal, True) for shape in shapes for causal in (False, True)]
    return det + [(first, shapes[0], True, False), (second, shapes[0], True, True)]


CASE_IDS = lambda c: f"{c[0]}-{IDS(c[1])}-{'causal' if c[2] else 'full'}-{'det' if c[3] else 'atomic'}"  # noqa: E731


@pytest.mark.parametrize("case", cases(SHAPES[:2]), ids=CASE_IDS)
def test_softcap_matches_float64_reference(case):
    """Scores of about +-4 against a cap of 2: most of them are bent well away from s."""
    dtype, shape, causal, deterministic = case
    q, k, v, do = make_inputs(*shape, dtype, scale=1.5)
    check(q, k, v, do, causal, softcap=2.0, deterministic=deterministic)


@pytest.mark.parametrize("case", cases(SHAPES[::2]), ids=CASE_IDS)
def test_sinks_match_float64_reference(case):
    """out, lse and every gradient, the sinks' included; rows that see no key get O = 0, L = sink."""
    dtype, shape, causal, deterministic = case
    q, k, v, do = make_inputs(*shape, dtype)
    out, lse, *_ = check(q, k, v, do, causal, sinks=heads(shape[3]), deterministic=deterministic)
    if causal and shape[1] > shape[2]:
        blind = shape[1] - shape[2]   # the first rows see no key
        assert torch.equal(out[:, :blind], torch.zeros_like(out[:, :blind]))
        torch.testing.assert_close(lse[:, :, :blind], heads(shape[3])[None, :, None].expand_as(lse[:, :, :blind]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softcap_and_sinks_with_documents_and_a_window(dtype):
    ids = ids_from_lengths(lengths(5, 40, 1, 24), lengths(70))
    q, k, v, do = make_inputs(2, ids.shape[1], ids.shape[1], 4, 2, 16, dtype, scale=1.5)
    check(q, k, v, do, True, sinks=heads(4), softcap=3.0, document_ids=ids, window=20 * SCALE)


def test_a_large_cap_is_plain_attention_and_a_small_one_flattens_the_softmax():
    q, k, v, _ = make_inputs(1, 40, 40, 2, 2, 32, DTYPES[0])
    torch.testing.assert_close(flash_attention(q, k, v, causal=True, softcap=1e4), flash_attention(q, k, v, causal=True),
                               atol=2e-3, rtol=0)
    _, lse = flash_attention(q, k, v, causal=True, softcap=0.01, return_lse=True)   # every |score| < 0.01
    want = torch.log(torch.arange(1, 41, device=DEVICE, dtype=torch.float32)).expand_as(lse)   # L ~ log(i + 1)
    torch.testing.assert_close(lse, want, atol=0.011, rtol=0)


@pytest.mark.parametrize("fixed", [True, False], ids=["shift", "running-max"])
@pytest.mark.parametrize("ends", ["top", "bottom", "both"])
def test_gemmas_cap_at_both_ends_of_its_range(monkeypatch, fixed, ends):
    """Cap 50 (Gemma 2's) with every score driven to +c, to -c, or alternately to both (P spanning
    e^-100): on a GPU in bfloat16, the Triton forward's constant shift (kernels.scores.softcap_shift:
    P = e^(t - 30) in [e^-80, e^20]) is as exact as the running max, where neither end may overflow or
    flush. The interpreter's float32 and float16 keep the running max (the next test runs the shift
    there)."""
    from kernels import flash_op, scores

    monkeypatch.setattr(scores, "SOFTCAP_FIXED_SHIFT", fixed)
    monkeypatch.setattr(flash_op, "_CALLS", {})   # a call signature keeps the kernels of its first call
    dtype = DTYPES[0]
    assert (scores.softcap_shift(50.0, dtype, None) == 30.0) == (fixed and dtype == torch.bfloat16)
    check(*capped_at(ends, dtype), True, softcap=50.0)


def capped_at(ends, dtype):
    """q, k, v, dO whose scores (D = 32) reach +-200 before a cap of 50: all of a row's at +c ("top"),
    at -c ("bottom"), or every other key at each ("both")."""
    q, k, v, do = make_inputs(1, 40 * SCALE, 40 * SCALE, 2, 2, 32, dtype)
    q = q + 6 * (-1.0 if ends == "bottom" else 1.0)
    k = k + 6
    if ends == "both":
        k[:, 1::2] -= 12
    return q, k, v, do


def forced_shift(softcap, dtype, sinks):
    """kernels.scores.softcap_shift's constant whatever the dtype: the shift forced on inputs where the
    running max runs (monkeypatched in its place)."""
    from kernels import scores

    return max(0.0, softcap - scores.SHIFT_HEADROOM)


@pytest.mark.parametrize("ends", ["top", "bottom", "both"])
def test_the_constant_shift_computes_the_running_maxs_function(monkeypatch, ends):
    """The shift forced on float32 inputs (where the running max runs: softcap_shift) gives the running
    max's outputs and gradients to the shift's own rounding (its docstring: ~7e-6 of P at c = 50):
    the path the bfloat16 GPU runs take, run here in the interpreter too."""
    from kernels import flash_op, scores

    q, k, v, do = capped_at(ends, torch.float32)
    both = []
    for shift in (forced_shift, lambda c, dtype, sinks: -1.0):
        monkeypatch.setattr(scores, "softcap_shift", shift)
        monkeypatch.setattr(flash_op, "_CALLS", {})
        both.append(run(flash_attention, q, k, v, do, True, softcap=50.0))
    for name, shifted, running in zip(("out", "lse", "dq", "dk", "dv"), *both):
        assert torch.isfinite(shifted).all() and rel(shifted, running.double()) < 2e-5, name


# ---- dropout --------------------------------------------------------------------------------

@pytest.mark.parametrize("case", cases(SHAPES[:1]), ids=CASE_IDS)
def test_dropout_matches_float64_reference_given_the_kernels_mask(case):
    dtype, shape, causal, deterministic = case
    check(*make_inputs(*shape, dtype), causal, dropout_p=0.3, deterministic=deterministic)


@DETERMINISTIC
def test_dropout_with_documents_a_window_softcap_and_sinks(deterministic):
    """Tile skipping keeps the mask of every score it computes: documents, a window and GQA, with the
    other two options on."""
    ids = ids_from_lengths(lengths(33, 3, 34), lengths(1, 1, 68))
    q, k, v, do = make_inputs(2, ids.shape[1], ids.shape[1], 4, 2, 16, DTYPES[0], scale=1.5)
    check(q, k, v, do, True, sinks=heads(4), dropout_p=0.2, softcap=3.0, document_ids=ids, window=24 * SCALE,
          deterministic=deterministic)


def test_dropout_keeps_one_minus_p_of_the_scores():
    """Kept fractions within 5 standard deviations of 1 - p, p as drawn (the nearest 1/256 to the
    caller's): overall, for each of the 16 scores of a Philox call (row and key bits 0 and 3), per
    head, and for scores kept together (independence): neighbouring keys and rows, and the pairs 8
    apart that share a call. The seed is fixed: a statistical bound fails at its own rate on fresh
    seeds, and CI must not."""
    for p in (0.1, 0.5, 0.3):
        assert abs(drawn_dropout_p(p) - p) <= 1 / 512
        torch.manual_seed(int(p * 10))
        mask = dropout_mask(dropout_seed(DEVICE), p, 1, 4, 64, 256).double()
        keep = 1 - drawn_dropout_p(p)

        def near(fraction, n, want=keep):
            return abs(fraction - want) <= 5 * math.sqrt(want * (1 - want) / n)

        assert near(mask.mean().item(), mask.numel())
        rows, cols = torch.arange(64, device=DEVICE), torch.arange(256, device=DEVICE)
        for a, e, c, d in itertools.product((0, 1), repeat=4):
            picked = mask[..., ((rows >> 3) & 1 == a) & (rows & 1 == e), :][..., ((cols >> 3) & 1 == c) & (cols & 1 == d)]
            assert near(picked.mean().item(), picked.numel()), (p, a, e, c, d)
        for h in range(4):
            assert near(mask[:, h].mean().item(), mask[:, h].numel()), (p, h)
        for step in (1, 8):
            # Disjoint pairs (i, i + step) with (i // step) even: each score in one pair at most, so
            # the pairs are independent and the binomial bound holds (overlapping pairs are not).
            first = (cols // step) % 2 == 0   # 256 keys and 64 rows are whole pairs of steps
            pairs = mask[..., first] * mask[..., first.nonzero().squeeze(1) + step]
            assert near(pairs.mean().item(), pairs.numel(), keep * keep), (p, "keys", step)
            first = (rows // step) % 2 == 0
            pairs = mask[..., first, :] * mask[..., first.nonzero().squeeze(1) + step, :]
            assert near(pairs.mean().item(), pairs.numel(), keep * keep), (p, "rows", step)


def philox_words(key: int, counters: list[np.ndarray], rounds: int = 7) -> list[np.ndarray]:
    """Philox4x32 (Salmon et al. 2011) in NumPy: the round multiplies counter words 0 and 2 by
    0xD2511F53 and 0xCD9E8D57, keeps both halves of each 64-bit product, and mixes the high halves
    with the other words and the key, which grows by the golden-ratio constants every round."""
    mask = np.uint64(0xFFFFFFFF)
    x0, x1, x2, x3 = (c.astype(np.uint64) for c in counters)
    k0, k1 = np.uint64(key & 0xFFFFFFFF), np.uint64(key >> 32)
    for _ in range(rounds):
        p0, p1 = x0 * np.uint64(0xD2511F53), x2 * np.uint64(0xCD9E8D57)
        x0, x1, x2, x3 = (p1 >> np.uint64(32)) ^ x1 ^ k0, p1 & mask, (p0 >> np.uint64(32)) ^ x3 ^ k1, p0 & mask
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
    return [x0, x1, x2, x3]


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_the_mask_is_philox_of_each_scores_coordinates(p):
    """dropout_mask bit for bit against a NumPy Philox of the layout kernels/scores.py documents
    (counter = key and query with bits 0 and 3 cleared, head, offset; word from bits 3, byte from
    bits 0): on a GPU this pins the kernels' inline mul.wide.u32 to the interpreter's bits, which
    a mask compared only with itself (the exactness tests) could not."""
    torch.manual_seed(3)
    rng = dropout_seed(DEVICE)
    B, H, n_q, n_k = 2, 3, 48, 40
    ours = dropout_mask(rng, p, B, H, n_q, n_k).cpu().numpy()
    seed, offset = (int(x) for x in rng.cpu())
    bh, i, j = np.meshgrid(np.arange(B * H), np.arange(n_q), np.arange(n_k), indexing="ij")
    words = philox_words(seed & 0xFFFFFFFFFFFFFFFF, [j & ~9, i & ~9, bh, np.full_like(bh, offset & 0xFFFFFFFF)])
    pick = 2 * ((i >> 3) & 1) + ((j >> 3) & 1)
    word = np.choose(pick, words)
    byte = (word >> (8 * (2 * (i & 1) + (j & 1))).astype(np.uint64)) & np.uint64(0xFF)
    want = byte < round((1 - drawn_dropout_p(p)) * 256)
    assert np.array_equal(ours.reshape(B * H, n_q, n_k), want)


@triton.jit
def _draws_kernel(Rng, Out, bh, start_q, start_k, SHARE: tl.constexpr, TRANSPOSED: tl.constexpr,
                  ROWS: tl.constexpr, COLS: tl.constexpr):
    """Out (ROWS, COLS): dropout_draw_at over a tile at (start_q, start_k) of head bh, S or, if
    TRANSPOSED, S^T (rows are keys)."""
    seed = tl.load(Rng)
    offset = tl.load(Rng + 1).to(tl.uint32)
    r = tl.arange(0, ROWS)[:, None]
    c = tl.arange(0, COLS)[None, :]
    zero = (r * 0 + c * 0).to(tl.uint32)
    if TRANSPOSED:
        draw = dropout_draw_at(seed, offset, bh, start_q, c, start_k, r, zero, SHARE)
    else:
        draw = dropout_draw_at(seed, offset, bh, start_q, r, start_k, c, zero, SHARE)
    tl.store(Out + r * COLS + c, draw.to(tl.int32, bitcast=True))


@pytest.mark.skipif(HAS_CUDA, reason="SHARE's shuffle needs a wgmma accumulator: the Gluon tests check it on the GPU")
@pytest.mark.parametrize("share", [1, 2])
@pytest.mark.parametrize("start", [(0, 0), (48, 16), (16, 80)])
def test_lanes_that_split_the_philox_calls_draw_the_same_bits(share, start):
    """SHARE's pairing (each lane makes the call whose bit 4 is its lane bit and takes the word it
    lacks from its partner): the same draw for every score as each lane making every call, for
    tiles that start on 16 but not 32. The interpreter has no lanes and makes the partner's call
    again; on the GPU the Gluon kernels' dropout tests compare the shuffled masks with these."""
    torch.manual_seed(7)
    rng = dropout_seed("cpu")
    shape = (32, 128) if share == 1 else (128, 32)   # S^T: keys down, queries across
    draws = {}
    for mode in (0, share):
        out = torch.empty(shape, dtype=torch.int32)
        _draws_kernel[(1,)](rng, out, 5, *start, SHARE=mode, TRANSPOSED=share == 2, ROWS=shape[0], COLS=shape[1])
        draws[mode] = out
    assert torch.equal(draws[0], draws[share])


SHARED_DRAW_LAYOUTS = r"""
import json, re, sys
sys.path.insert(0, "scripts/kernel_dev")
from kernel_report import compile_for_hopper, kernel_table, launch_values, score_args
from kernels import tuning
kernel, table, names = kernel_table("fwd")
seen, rows = set(), []
for dim, candidates in sorted(table.items()):
    for block_m, block_n, warps, stages in candidates:
        if (dim, block_m, block_n, warps) in seen:
            continue
        seen.add((dim, block_m, block_n, warps))
        for packed in (0, 1):   # PACKED_MASK: the mask's asm on P's packed pairs (kernels/scores.py's drop_scores)
            consts = dict(HEAD_DIM=dim, BLOCK_D=dim, CAUSAL=True, DOCS=False, WINDOW=False, PRECISION="tf32",
                          BLOCK_M=block_m, BLOCK_N=block_n, **{**score_args(kernel, ("dropout",)), "PACKED_MASK": packed})
            ttgir = compile_for_hopper(kernel, consts, warps, stages, launch_values(4, 4096, 12, 12, dim)).asm["ttgir"]
            layouts = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<[^\n]*)", ttgir, re.M))
            found = {name: re.findall(r'elementwise_inline_asm "' + start + r'[^"]*"[^\n]*?: tensor<[^>]*?(#\w+)>', ttgir)
                     for name, start in (("shuffled", "shfl"), ("pairs", r"\{ \.reg \.b32 z, d;"))}
            rows.append(dict(dim=dim, tile=[block_m, block_n, warps], share=consts.get("SHARE_DRAW"), packed=packed,
                             **{name: [layouts.get(alias, alias) for alias in aliases] for name, aliases in found.items()}))
print(json.dumps(rows))
"""


@pytest.mark.slow
def test_the_forwards_shared_draw_shuffles_a_wgmma_accumulator():
    """SHARE_DRAW (set on sm_90) shuffles each draw word with the lane 4 away, which holds the next row
    of S only in a wgmma accumulator; Triton picks the draw's layout itself, so this reads it off the
    kernel compiled for sm_90a, for every tile the tuner may pick: a layout of its own would be a
    wrong mask, not an error. So does PACKED_MASK's asm, whose two scores a call must be keys 2j and
    2j + 1 of one query, as they are in that layout."""
    import json
    import os
    import subprocess
    import sys

    from tests.trainrun import REPO

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", SHARED_DRAW_LAYOUTS], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {row["dim"] for row in rows} == {64, 128, 256}
    for row in rows:
        assert row["share"] == 1 and row["shuffled"] and bool(row["pairs"]) == bool(row["packed"]), row
        assert all(layout.startswith("#ttg.nvidia_mma<{versionMajor = 3") for layout in row["shuffled"] + row["pairs"]), row


@pytest.mark.parametrize("p", [0.1, 0.2, 0.5, 0.8])
def test_the_packed_mask_ptx_keeps_what_the_byte_compare_keeps(p):
    """drop_scores' packed step (its PTX run by tests/ptx_emulator.py) zeroes exactly the 16-bit halves
    whose draw byte the unpacked compare drops, keeps the others' bits, for every draw byte in either
    half of the pair and either query parity (which bytes of the word are the pair's)."""
    from kernels.scores import _keep_below, _kept_pair_ptx
    from ptx_emulator import run_ptx

    drawn = drawn_dropout_p(p)
    asm, below = _kept_pair_ptx(drawn), _keep_below(drawn) >> 24
    g = torch.Generator().manual_seed(int(p * 1000))
    for parity in (0, 1):
        select = 0x4140 + 0x0202 * parity
        for draw in range(256):
            for half in (0, 1):
                other, rest, low, high = torch.randint(1, 2**16, (4,), generator=g).tolist()
                draws = [draw, other & 0xFF] if half == 0 else [other & 0xFF, draw]
                word = (draws[0] | draws[1] << 8) << (16 * parity) | rest << (16 * (1 - parity))
                pair = low | high << 16   # two nonzero 16-bit probabilities
                (out,) = run_ptx(asm, [0, word, word, select, select, pair], 1)
                for i in (0, 1):
                    value = (pair >> (16 * i)) & 0xFFFF
                    expect = value if draws[i] < below else 0
                    assert (out >> (16 * i)) & 0xFFFF == expect, (parity, draws, i, hex(word), hex(pair), hex(out))


@pytest.mark.parametrize("p", [1e-3, 1 - 1e-3])
def test_a_dropout_p_the_8_bit_draw_rounds_away_is_refused(p):
    q, k, v, _ = make_inputs(1, 16, 16, 2, 2, 16, DTYPES[0])
    with pytest.raises(ValueError, match=r"dropout_p=.* rounds to .* steps of 1/256"):
        flash_attention(q, k, v, causal=True, dropout_p=p)


def test_same_seed_same_mask_another_seed_another_mask():
    q, k, v, _ = make_inputs(1, 40, 40, 2, 2, 32, DTYPES[0])
    torch.manual_seed(1)
    first = flash_attention(q, k, v, causal=True, dropout_p=0.2)
    second = flash_attention(q, k, v, causal=True, dropout_p=0.2)   # the next call draws a new seed
    torch.manual_seed(1)
    assert torch.equal(flash_attention(q, k, v, causal=True, dropout_p=0.2), first)
    torch.manual_seed(2)
    other = flash_attention(q, k, v, causal=True, dropout_p=0.2)
    assert not torch.equal(first, second) and not torch.equal(first, other)
    rng = dropout_seed(DEVICE)
    assert torch.equal(dropout_mask(rng, 0.2, 1, 2, 40, 40), dropout_mask(rng.clone(), 0.2, 1, 2, 40, 40))
    assert not torch.equal(dropout_mask(rng, 0.2, 1, 2, 40, 40), dropout_mask(rng + 1, 0.2, 1, 2, 40, 40))


# ---- decoding, bad input --------------------------------------------------------------------

@pytest.mark.parametrize("softcap, with_sinks, window", [(2.0, False, None), (None, True, None), (2.0, True, 40)])
def test_flash_decode_caps_and_sinks_as_the_reference(softcap, with_sinks, window):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, h, 32, generator=g).to(DEVICE) * 1.5 for n, h in ((2, 4), (300, 2), (300, 2)))
    valid = torch.tensor([290], device=DEVICE)
    options = dict(softcap=softcap, sinks=heads(4) if with_sinks else None, window=window)
    ours = flash_decode(q, k, v, valid, **options)
    exact = decode_reference(q.double(), k.double(), v.double(), valid, **options)
    plain = decode_reference(q, k, v, valid, **options)
    assert (ours.double() - exact).abs().max() <= 2 * (plain.double() - exact).abs().max() + 1e-6


@pytest.mark.parametrize("options, match", [
    (dict(dropout_p=1.0), r"dropout_p must be a number in \[0, 1\), got 1.0"),
    (dict(dropout_p=True), "dropout_p must be a number"),
    (dict(softcap=0.0), "softcap must be None or a positive finite number, got 0.0"),
    (dict(softcap=float("inf")), "softcap must be None or a positive finite number"),
    (dict(sinks=torch.zeros(3)), r"sinks must be a floating tensor of shape \(heads,\) = \(2,\), got torch.float32 \(3,\)"),
    (dict(sinks=torch.zeros(2, dtype=torch.int32)), "sinks must be a floating tensor"),
])
def test_bad_score_options_are_refused(options, match):
    q, k, v, _ = make_inputs(1, 8, 8, 2, 2, 32, DTYPES[0])
    options = {name: (value.to(DEVICE) if isinstance(value, torch.Tensor) else value) for name, value in options.items()}
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, v, **options)


# ---- GPU only: the Gluon backward, compile ---------------------------------------------------

@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sinks_through_the_gluon_backward(head_dim):
    """The plan keeps the Gluon backward for sinks (it needs only the LSE, which includes them)."""
    q, k, v, do = make_inputs(2, 1024, 1024, 8, 2, head_dim, torch.bfloat16)
    check(q, k, v, do, True, sinks=heads(8), kernel=("triton", "gluon"))


def gluon_backward_grid(test):
    """The Gluon backward's GPU grid (Hopper only): both dtypes, GQA split and not (8/2 heads),
    ragged tiles with Nq > Nk and Nq < Nk, causal or not, deterministic or not."""
    marks = [pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability() != (9, 0),
                                reason="needs an sm_90 (Hopper) GPU"),
             DETERMINISTIC,
             pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"]),
             pytest.mark.parametrize("shape", [(2, 1024, 1024, 8, 2, 64), (1, 300, 517, 4, 4, 128),
                                               (1, 517, 300, 4, 1, 64)], ids=IDS),
             pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)]
    for mark in reversed(marks):
        test = mark(test)
    return test


@gluon_backward_grid
def test_softcap_through_the_gluon_backward(shape, causal, dtype, deterministic):
    """The Gluon backward caps the scores it recomputes: GQA split and not, ragged tiles, Nq != Nk,
    a cap of 5 that most scores reach (scaled-up inputs), with sinks on one case."""
    q, k, v, do = make_inputs(*shape, dtype)
    q = (q.float() * 4).to(dtype)
    sinks = heads(shape[3]) if shape[3] == 8 else None
    check(q, k, v, do, causal, sinks=sinks, softcap=5.0, deterministic=deterministic, kernel=("triton", "gluon"))


@gluon_backward_grid
def test_dropout_through_the_gluon_backward(shape, causal, dtype, deterministic):
    """The Gluon backward regenerates the Triton forward's mask bit for bit (the reference applies
    the mask dropout_mask draws, so one score kept differently fails): GQA split and not, ragged
    tiles, Nq != Nk; soft-capping and sinks with it on the first shape."""
    q, k, v, do = make_inputs(*shape, dtype)
    more = dict(softcap=5.0, sinks=heads(shape[3])) if shape[3] == 8 else {}
    check(q, k, v, do, causal, dropout_p=0.2, deterministic=deterministic, kernel=("triton", "gluon"), **more)


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("shape, causal, dtype, options, backward", [
    (shape, causal, torch.bfloat16, options, backward)
    for shape in [(2, 1024, 1024, 8, 2, 64), (1, 300, 517, 4, 4, 128), (1, 517, 300, 4, 1, 64)]
    for causal in (False, True) for options in ("dropout", "softcap", "sinks", "all") for backward in ("triton", "gluon")
] + [((2, 1024, 1024, 8, 2, 64), True, torch.float16, "all", backward) for backward in ("triton", "gluon")],
    ids=lambda x: IDS(x) if isinstance(x, tuple) else str(x))
def test_score_options_through_the_gluon_forward(shape, causal, dtype, options, backward):
    """The Gluon forward caps the scores, starts each row at its sink and drops the Triton kernels'
    mask bit for bit (the reference applies the mask dropout_mask draws), before either backward:
    GQA, ragged tiles, Nq != Nk (rows that see no key: O = 0, L = the sink), a cap of 5 that most
    scores reach, each option alone and all three; float16 too."""
    q, k, v, do = make_inputs(*shape, dtype)
    q = (q.float() * 4).to(dtype)
    chosen = dict(dropout=dict(dropout_p=0.2), softcap=dict(softcap=5.0), sinks=dict(sinks=heads(shape[3])))
    kw = {name: value for option, more in chosen.items() if options in (option, "all") for name, value in more.items()}
    check(q, k, v, do, causal, kernel=("gluon", backward), **kw)


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("forward", ["triton", "gluon"])
@pytest.mark.parametrize("shape, causal, dtype", [((2, 1024, 1024, 8, 2, 64), True, torch.bfloat16),
                                                  ((1, 300, 517, 4, 4, 128), False, torch.float16),
                                                  ((1, 517, 300, 4, 1, 64), True, torch.bfloat16)],
                         ids=lambda x: IDS(x) if isinstance(x, tuple) else str(x))
def test_the_packed_dropout_mask_is_the_unpacked_one(monkeypatch, forward, shape, causal, dtype):
    """kernels.scores.PACKED_DROPOUT (the forwards zero dropped halves of P's packed pairs) gives the
    unpacked mask's output and LSE bit for bit, and is as exact as the plain formula given the mask:
    Triton picks which scores share an asm call, so a pair that were not keys 2j, 2j + 1 of one query
    would drop other scores than the mask says."""
    from kernels import flash_op, scores

    q, k, v, do = make_inputs(*shape, dtype)
    kw = dict(causal=causal, dropout_p=0.2, kernel=(forward, "triton"), return_lse=True)
    monkeypatch.setattr(scores, "PACKED_DROPOUT", False)
    monkeypatch.setattr(flash_op, "_CALLS", {})   # a call signature keeps the kernels of its first call
    with replayed_generator():
        unpacked = flash_attention(q, k, v, **kw)
    monkeypatch.setattr(scores, "PACKED_DROPOUT", True)
    monkeypatch.setattr(flash_op, "_CALLS", {})
    with replayed_generator():
        packed = flash_attention(q, k, v, **kw)
    assert torch.equal(packed[0], unpacked[0]) and torch.equal(packed[1], unpacked[1])
    check(q, k, v, do, causal, dropout_p=0.2, kernel=(forward, "triton"))


@requires_cuda
def test_torch_compile_fullgraph_traces_every_option():
    """torch.compile(fullgraph=True) traces soft-capping, sinks and the dropout seed's draw; with
    Inductor drawing the seed through eager's generator (fallback_random), compiled and eager give
    the same bits, forward and backward, the sinks' gradient included."""
    import torch._inductor.config as inductor_config

    from test_flash_attention import pinned_tile_shapes

    q, k, v, do = make_inputs(2, 512, 512, 8, 2, 64, torch.bfloat16)
    sinks = heads(8)

    def f(q, k, v, sinks):
        return flash_attention(q, k, v, causal=True, softcap=30.0, sinks=sinks, dropout_p=0.1)

    with pinned_tile_shapes(), inductor_config.patch(fallback_random=True):
        compiled = torch.compile(f, fullgraph=True)
        results = []
        for fn in (f, compiled):
            leaves = [strided_leaf(t) for t in (q, k, v)] + [sinks.clone().requires_grad_()]
            torch.manual_seed(0)
            out = fn(*leaves)
            results.append((out, *torch.autograd.grad(out, leaves, do)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
