"""The Triton FlashAttention against a float64 reference.

On a CPU these run in Triton's interpreter (float32/float16, small sizes); on CUDA the
same cases run in bfloat16/float16 at real sizes. The error bound is relative: ours
may be at most 2x as far from the float64 answer as the plain formula evaluated in the
same dtype on the same inputs (plus a hair for float32, where both are ~1e-7).
Every run starts from poisoned memory (uninitialised tensors filled with NaN), so an
element the kernel forgets to write fails the test.
"""
import contextlib
import math

import pytest
import torch

from conftest import HAS_CUDA, requires_cuda
from kernels import attention_reference, flash_attention
from kernels import flash_op

DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if HAS_CUDA else [torch.float32, torch.float16]
SLACK = {torch.float32: 1e-6, torch.float16: 0.0, torch.bfloat16: 0.0}


@pytest.fixture(autouse=True)
def poison_uninitialised_memory():
    """torch.empty returns NaN-filled memory while deterministic mode is on."""
    import torch.utils.deterministic as det
    old_mode, old_fill = torch.are_deterministic_algorithms_enabled(), det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(old_mode)
    det.fill_uninitialized_memory = old_fill


def rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def make_inputs(B, n_q, n_k, H, H_kv, D, dtype, scale=1.0, gen_seed=None):
    g = torch.Generator(device="cpu")
    g.manual_seed(gen_seed if gen_seed is not None else torch.seed() % 2**31)
    q = (torch.randn(B, n_q, H, D, generator=g) * scale).to(DEVICE, dtype)
    k = (torch.randn(B, n_k, H_kv, D, generator=g) * scale).to(DEVICE, dtype)
    v = torch.randn(B, n_k, H_kv, D, generator=g).to(DEVICE, dtype)
    do = torch.randn(B, n_q, H, D, generator=g).to(DEVICE, dtype)
    return q, k, v, do


def strided_leaf(t):
    """A leaf copy of `t` with the same strides (clone() would compact a gapped view)."""
    leaf = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return leaf.copy_(t).requires_grad_()


def forward_backward(fn, q, k, v, do, causal, **kw):
    q, k, v = (strided_leaf(t.detach()) for t in (q, k, v))
    out, lse = fn(q, k, v, causal=causal, return_lse=True, **kw)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    return out, lse, dq, dk, dv


def check_against_reference(q, k, v, do, causal, deterministic=True, **kw):
    """deterministic=False: the backward that adds dq with atomics, held to the same bound."""
    ours = forward_backward(flash_attention, q, k, v, do, causal, deterministic=deterministic, **kw)
    same_dtype = forward_backward(attention_reference, q, k, v, do, causal, **kw)
    exact = forward_backward(attention_reference, *(t.double() for t in (q, k, v, do)), causal, **kw)
    for name, mine, plain, ref in zip(NAMES, ours, same_dtype, exact):
        assert_as_exact_as_plain(name, mine, plain, ref, do, v)


NAMES = ("out", "lse", "dq", "dk", "dv")


def assert_as_exact_as_plain(name, mine, plain, ref, do, v):
    """`mine` may be at most 2x as far from the float64 `ref` as the same-dtype formula `plain`."""
    assert mine.shape == ref.shape and mine.dtype == plain.dtype, name
    assert not torch.isnan(mine).any(), f"{name} has NaN"
    if name == "lse":
        # rows that see no key are -inf in both; compare the rest in absolute terms
        # (lse is float32 in every path, so 2x the same-dtype error would be ~0)
        assert torch.equal(torch.isinf(mine), torch.isinf(ref)), "lse: -inf rows differ"
        finite = torch.isfinite(ref)
        err = (mine.double() - ref)[finite].abs().max().item() if finite.any() else 0.0
        tol = 1e-4 * (1 + ref[finite].abs().max().item()) if finite.any() else 0.0
        assert err <= tol, f"lse abs error {err:.3g} > {tol:.3g}"
        return
    assert torch.isfinite(mine).all(), f"{name} has inf"
    if ref.norm() == 0:  # e.g. dq when every query sees a single key: P = 1, dS = 0
        atol = 10 * torch.finfo(mine.dtype).eps * do.abs().max().item() * v.abs().max().item()
        assert mine.abs().max().item() <= atol, f"{name} should be ~0, got {mine.abs().max():.3g}"
        return
    err, base = rel_err(mine, ref), rel_err(plain, ref)
    bound = 2 * base + SLACK[mine.dtype]
    assert err <= bound, f"{name}: rel err {err:.3g} > 2 x plain formula's {base:.3g}"


# (B, n_q, n_k, H, H_kv, D): odd lengths, Nq != Nk, GQA ratios 1/2/4/8, head dims.
CPU_SHAPES = [
    (1, 1, 1, 1, 1, 32),
    (2, 17, 17, 2, 2, 32),
    (1, 100, 100, 4, 2, 64),
    (1, 257, 257, 1, 1, 16),
    (1, 40, 72, 4, 1, 32),     # Nq < Nk, MQA
    (1, 72, 40, 8, 1, 16),     # Nq > Nk: causal rows that see no key; GQA 8
    (1, 33, 33, 8, 2, 96),     # padded head dim, GQA 4
    (1, 20, 20, 2, 2, 128),
    (1, 20, 36, 2, 2, 256),
    (1, 23, 23, 2, 2, 40),     # a non-power-of-two dim that is padded inside the op
]
GPU_SHAPES = [
    (1, 1, 1, 1, 1, 64),
    (2, 17, 17, 4, 4, 64),
    (2, 100, 100, 8, 4, 64),
    (1, 257, 257, 4, 1, 128),
    (2, 1000, 1000, 8, 2, 128),
    (1, 1000, 1000, 8, 8, 32),
    (1, 1000, 1000, 8, 1, 96),
    (1, 1000, 1000, 4, 4, 256),
    (1, 500, 1500, 8, 1, 64),
    (1, 1500, 500, 8, 8, 128),
    (2, 4096, 4096, 16, 2, 128),
    (1, 2048, 2048, 8, 8, 80),
]
SHAPES = GPU_SHAPES if HAS_CUDA else CPU_SHAPES


DETERMINISTIC = pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])


@DETERMINISTIC
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_q{}_k{}_H{}_kv{}_D{}".format(*s))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_reference(shape, causal, dtype, deterministic):
    check_against_reference(*make_inputs(*shape, dtype), causal, deterministic)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_custom_softmax_scale(dtype):
    check_against_reference(*make_inputs(1, 50, 50, 2, 2, 32, dtype), True, softmax_scale=0.3)


@DETERMINISTIC
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_large_logits_stay_finite(causal, deterministic):
    """Scores around 1e4 overflow a naive exp; the online softmax must not."""
    dtype = DTYPES[-1]  # float16 on both: the narrowest exponent range we support
    q, k, v, do = make_inputs(1, 64, 64, 2, 2, 32, dtype)
    q = (q / q.norm(dim=-1, keepdim=True) * 200).to(dtype)
    k = (k / k.norm(dim=-1, keepdim=True) * 200 * math.sqrt(32) / 4).to(dtype)
    out, lse, dq, dk, dv = forward_backward(flash_attention, q, k, v, do, causal, deterministic=deterministic)
    for name, t in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv)):
        assert torch.isfinite(t).all(), f"{name} not finite with large logits"
    assert lse.abs().max() > 1e3, "the test did not produce large logits"
    ref = attention_reference(q.double(), k.double(), v.double(), causal=causal)
    assert rel_err(out, ref) < 1e-2


@DETERMINISTIC
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_very_negative_scores_with_a_ragged_key_tile(dtype, deterministic):
    """Every score ~ -160, so L ~ -160 and exp(0 - L) overflows: the zero-filled keys past n_k of a
    ragged key tile must never reach dQ (the atomic kernel would add 0 * inf = NaN).

    Nothing is NaN or inf in any dtype. Accuracy (2x the plain formula's error) is held in the
    16-bit dtypes only. In float32, at |S| ~ 160, any backward that recomputes the scores
    carries a rounding of ~u|S| (u = 2^-24: ~1e-5) in every exponent that the forward's P did not
    have, and its size is set by the order in which the matmul unit sums the 32 products (BLAS's
    in the interpreter), which no formula in the same dtype reproduces. The plain formula's
    backward reuses its forward's P. These inputs magnify the difference: every key shares the
    component -30u (against 0.5 of spread) and each row of dS sums to zero, so dQ is the
    small remainder of a cancellation. Measured in the interpreter (CPU, 40-150 draws each): in
    float32 the atomic dQ is ~1e-4 from the float64 answer against the plain formula's ~1e-5,
    and dK/dV up to ~3x the plain formula's. In float16 the inputs' own rounding dominates: dQ
    0.1-0.4x, dK/dV <= 0.2x the plain formula's error.
    """
    q, k, v, do = make_inputs(1, 40, 40, 2, 2, 32, dtype)
    u = q[:, :1].float() / q[:, :1].float().norm(dim=-1, keepdim=True)   # one direction per head
    q = (30 * u + 0.5 * q.float()).to(q.dtype)
    k = (-30 * u + 0.5 * k.float()).to(k.dtype)
    ours = forward_backward(flash_attention, q, k, v, do, False, deterministic=deterministic)
    assert ours[1].max() < -100, "the test did not produce very negative scores"
    for name, t in zip(NAMES, ours):
        assert torch.isfinite(t).all(), f"{name} has NaN or inf"
    if dtype != torch.float32:
        check_against_reference(q, k, v, do, False, deterministic)


@DETERMINISTIC
def test_strided_views_of_fused_qkv(deterministic):
    """The model passes q, k, v as views of one projection; no copies are needed."""
    dtype = DTYPES[0]
    B, N, H, D = 2, 37, 4, 32
    qkv = torch.randn(B, N, 3, H, D, device=DEVICE).to(dtype)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    do = torch.randn(B, N, H, D, device=DEVICE).to(dtype)
    check_against_reference(q, k, v, do, True, deterministic)
    # (B, H, N, D) storage seen through a transpose
    q2, k2, v2 = (torch.randn(B, H, N, D, device=DEVICE).to(dtype).transpose(1, 2) for _ in range(3))
    check_against_reference(q2, k2, v2, do, False, deterministic)


def test_backward_is_deterministic():
    """The default backward gives the same bits on every call. On the GPU the shape is big enough
    for many programs to race, were the kernel order-dependent; the interpreter runs programs one
    after another, so on the CPU a smaller shape with the same ragged tile and GQA suffices."""
    B, H = (2, 8) if HAS_CUDA else (1, 4)
    q, k, v, do = make_inputs(B, 130, 130, H, 2, 64, DTYPES[0])
    first = forward_backward(flash_attention, q, k, v, do, True)
    for _ in range(2):
        again = forward_backward(flash_attention, q, k, v, do, True)
        for a, b in zip(first, again):
            assert torch.equal(a, b), "results differ between identical runs"


def test_fresh_inputs_every_call_give_fresh_answers():
    """Guards against a cached or constant result: different inputs, different outputs."""
    a = make_inputs(1, 40, 40, 2, 2, 32, DTYPES[0])
    b = make_inputs(1, 40, 40, 2, 2, 32, DTYPES[0])
    assert not torch.equal(flash_attention(*a[:3]), flash_attention(*b[:3]))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_later_calls_of_a_signature_are_exact_on_their_own_inputs(causal):
    """A call signature's first call goes through the jit; later ones launch its compiled kernels
    directly (kernels/launch.py) with the grid and arguments it kept: each of three calls on fresh
    inputs of one signature must match the reference on those inputs, and their outputs differ.
    In the interpreter every launch goes through the jit, but the signature's kept plan and
    arguments are reused: a smaller shape (still batched, GQA, a ragged second tile of each
    length) checks that in a fifth of the interpreter's time."""
    shape = (2, 100, 100, 8, 4, 64) if HAS_CUDA else (2, 40, 40, 4, 2, 64)
    outs = []
    for _ in range(3):
        q, k, v, do = make_inputs(*shape, DTYPES[0])
        check_against_reference(q, k, v, do, causal)
        outs.append(flash_attention(q, k, v, causal=causal))
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])


def test_registered_op_passes_opcheck():
    """Schema, fake-tensor and autograd registration are consistent (torch.compile relies on it)."""
    q, k, v, _ = make_inputs(1, 24, 24, 2, 1, 32, DTYPES[-1] if not HAS_CUDA else torch.float16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    checks = ("test_schema", "test_autograd_registration")
    if HAS_CUDA:  # the interpreter runs kernels eagerly, so fake tensors cannot pass through it
        checks += ("test_faketensor",)
    torch.library.opcheck(torch.ops.flashtrain.flash_attn_fwd.default, (q, k, v, True, 0.2),
                          test_utils=checks)


def test_eager_path_and_registered_op_give_identical_results():
    """Outside torch.compile the kernels launch under a plain autograd.Function; the op that
    torch.compile traces must compute the very same bits, forward and backward."""
    q, k, v, do = make_inputs(2, 40, 40, 4, 2, 32, DTYPES[0])

    def through_op(q, k, v, causal, return_lse):
        out, lse = torch.ops.flashtrain.flash_attn_fwd(q, k, v, causal, 1 / math.sqrt(32))
        return out, lse

    eager = forward_backward(flash_attention, q, k, v, do, causal=True)
    op = forward_backward(through_op, q, k, v, do, causal=True)
    for a, b in zip(eager, op):
        assert torch.equal(a, b)


def test_registered_op_runs_the_atomic_backward():
    """deterministic=False travels through the op torch.compile traces (its autograd formula calls
    the backward op with it): same results as the eager path, bit for bit in the interpreter (which
    runs programs one after another), within atomic reordering on a GPU."""
    q, k, v, do = make_inputs(2, 40, 40, 4, 2, 32, DTYPES[0])
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    checks = ("test_schema", "test_autograd_registration") + (("test_faketensor",) if HAS_CUDA else ())
    torch.library.opcheck(torch.ops.flashtrain.flash_attn_fwd.default, (q, k, v, True, 0.2, None, 0, False),
                          test_utils=checks)

    def through_op(q, k, v, causal, return_lse, **_):
        return torch.ops.flashtrain.flash_attn_fwd(q, k, v, causal, 1 / math.sqrt(32), None, 0, False)

    eager = forward_backward(flash_attention, q, k, v, do, causal=True, deterministic=False)
    op = forward_backward(through_op, q, k, v, do, causal=True)
    for a, b in zip(eager, op):
        torch.testing.assert_close(a, b, atol=0 if not HAS_CUDA else 1e-2, rtol=0 if not HAS_CUDA else 1e-2)


# ---- bad input: one clear ValueError naming the argument ------------------------------

def _ok(n=8, D=32, dtype=None):
    dtype = dtype or DTYPES[0]
    return [torch.randn(1, n, 2, D, device=DEVICE).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("mutate, match", [
    (lambda q, k, v: (q, k.half() if q.dtype != torch.float16 else k.float(), v), "share a dtype"),
    (lambda q, k, v: (q[0], k, v), "q must be 4-D"),
    (lambda q, k, v: (q, k, v[:, :5]), "same shape"),
    (lambda q, k, v: (q.int(), k, v), "q has dtype"),
    (lambda q, k, v: (torch.randn(2, 8, 2, 32, device=q.device, dtype=q.dtype), k, v), "batch"),
    (lambda q, k, v: (torch.randn(1, 8, 3, 32, device=q.device, dtype=q.dtype), k, v), "multiple"),
    (lambda q, k, v: (q[..., :16], k, v), "head_dim"),
    (lambda q, k, v: (q[:, :0], k, v), "empty sequence"),
])
def test_bad_input_is_refused(mutate, match):
    with pytest.raises(ValueError, match=match):
        flash_attention(*mutate(*_ok()))


def test_head_dim_over_256_is_refused():
    with pytest.raises(ValueError, match="head_dim 320"):
        flash_attention(*_ok(D=320))


def test_non_bool_deterministic_is_refused():
    with pytest.raises(ValueError, match="deterministic must be True or False"):
        flash_attention(*_ok(), deterministic="false")


def test_bad_softmax_scale_is_refused():
    with pytest.raises(ValueError, match="softmax_scale"):
        flash_attention(*_ok(), softmax_scale=float("nan"))


def test_cpu_tensor_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr("kernels.checks.INTERPRET", False)
    monkeypatch.setattr(flash_op, "_CALLS", {})   # a call signature seen before is not checked again
    q, k, v = (torch.randn(1, 8, 2, 32) for _ in range(3))
    with pytest.raises(ValueError, match="q is on cpu"):
        flash_attention(q, k, v)


@pytest.mark.skipif(HAS_CUDA, reason="interpreter-only restriction")
def test_bfloat16_in_interpreter_is_refused():
    with pytest.raises(ValueError, match="bfloat16"):
        flash_attention(*_ok(dtype=torch.bfloat16))


# ---- GPU only: compile, CUDA graphs ---------------------------------------------------

@contextlib.contextmanager
def pinned_tile_shapes():
    """Every kernel launch on its default tile shape, as FLASHTRAIN_AUTOTUNE=0 pins it.

    Tuned, eager and compiled calls need not agree on a tile shape: eager Triton times the
    candidates itself (or reuses a choice cached by an earlier test), while Inductor re-times
    a user kernel's candidates with its own benchmarker. Another tile shape sums the scores in
    another order, so the bits may differ legitimately. Pinned (and the autotuners' per-process
    choices cleared, restored afterwards), both paths run the same compiled kernel.
    """
    from kernels import tuning
    from kernels.flash_bwd import flash_bwd_kv_kernel, flash_bwd_q_kernel
    from kernels.flash_fwd import flash_fwd_kernel

    tuners = (flash_fwd_kernel, flash_bwd_kv_kernel, flash_bwd_q_kernel)
    saved = tuning.AUTOTUNE, [dict(t.cache) for t in tuners]
    tuning.AUTOTUNE = False   # read by the prune hook at every (eager or traced) launch
    for t in tuners:
        t.cache.clear()
    try:
        yield
    finally:
        tuning.AUTOTUNE = saved[0]
        for t, cache in zip(tuners, saved[1]):
            t.cache.clear()
            t.cache.update(cache)


def assert_compiled_matches_eager(f, q, k, v, do):
    """torch.compile(f, fullgraph=True) gives the bits of eager f, forward and backward, on the
    same tile shapes (pinned_tile_shapes says why tuned shapes may legitimately differ)."""
    with pinned_tile_shapes():
        compiled = torch.compile(f, fullgraph=True)
        eager = forward_backward(lambda *a, **kw: (f(*a[:3]), None), q, k, v, do, True)
        comp = forward_backward(lambda *a, **kw: (compiled(*a[:3]), None), q, k, v, do, True)
    for a, b in zip(eager, comp):
        if a is not None:
            torch.testing.assert_close(a, b, atol=0, rtol=0)


@requires_cuda
def test_torch_compile_fullgraph_matches_eager():
    q, k, v, do = make_inputs(2, 512, 512, 8, 2, 64, torch.bfloat16)
    assert_compiled_matches_eager(lambda q, k, v: flash_attention(q, k, v, causal=True) * 2, q, k, v, do)


@requires_cuda
def test_torch_compile_fullgraph_atomic_backward_matches_eager():
    """The atomic backward under torch.compile (Inductor launches it, zeroing dQ as the autotuner
    asks): as exact as eager against float64, dQ differing only by the order of its additions."""
    q, k, v, do = make_inputs(2, 512, 512, 8, 2, 64, torch.bfloat16)
    f = lambda q, k, v: flash_attention(q, k, v, causal=True, deterministic=False)  # noqa: E731
    compiled = torch.compile(f, fullgraph=True)
    exact = forward_backward(attention_reference, *(t.double() for t in (q, k, v, do)), True)
    plain = forward_backward(attention_reference, q, k, v, do, True)
    for fn in (f, compiled):
        out, _, dq, dk, dv = forward_backward(lambda *a, **kw: (fn(*a[:3]), None), q, k, v, do, True)
        for name, mine, pl, ref in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (plain[0], *plain[2:]),
                                       (exact[0], *exact[2:])):
            assert_as_exact_as_plain(name, mine, pl, ref, do, v)


@requires_cuda
def test_element_offsets_past_int32_range():
    """A million-token view of a wide fused projection puts element offsets past 2^31.

    Only the last R query rows get a gradient, so the check needs no N x N reference:
    with causal masking aligned bottom-right, those rows are exactly attention of
    q[-R:] over all N keys, and rows with dO = 0 add nothing to dK or dV (dS = P * (dP - delta)
    with dP = 0 and delta = 0 there). Addresses computed in int32 would wrap and fail this.
    """
    N, D, width, R = 2**20, 64, 2304, 128  # the row stride of gpt2-small's fused QKV
    assert (N - 1) * width > 2**31
    g = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    buf = torch.randn(1, N, width, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = (buf[:, :, i * D:(i + 1) * D].unsqueeze(2) for i in range(3))
    do = torch.zeros(1, N, 1, D, device="cuda", dtype=torch.bfloat16)
    do[:, -R:] = torch.randn(1, R, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    out, lse, dq, dk, dv = forward_backward(flash_attention, q, k, v, do, True)
    assert torch.equal(dq[:, :-R], torch.zeros_like(dq[:, :-R])), "dq of rows with dO = 0"
    ours = (out[:, -R:], lse[..., -R:], dq[:, -R:], dk, dv)
    last = (q[:, -R:], k, v, do[:, -R:])
    plain = forward_backward(attention_reference, *last, True)
    exact = forward_backward(attention_reference, *(t.double() for t in last), True)
    for name, mine, p, ref in zip(NAMES, ours, plain, exact):
        assert_as_exact_as_plain(name, mine, p, ref, do, v)


@requires_cuda
def test_cuda_graph_replay():
    q, k, v, _ = make_inputs(1, 256, 256, 4, 4, 64, torch.bfloat16)
    flash_attention(q, k, v, causal=True)  # warm up: autotune and compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attention(q, k, v, causal=True)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, flash_attention(q, k, v, causal=True), atol=0, rtol=0)
