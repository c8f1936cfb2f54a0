"""2^x on the FMA units (kernels/exp2.py): the cubic's accuracy, its PTX against its Triton form, and
the forwards with exponentials moved off the special-function unit, as exact as without."""
import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from conftest import HAS_CUDA, requires_hopper
from kernels import exp2
from kernels.exp2 import COEFFS, FLOOR, MAX_REL_ERROR, SPLIT_PTX, exp2_fma
from ptx_emulator import bits, f32, run_ptx
from test_attention_scores import check, forced_shift, heads
from test_flash_attention import DEVICE, DTYPES, make_inputs


@triton.jit
def _exp2_fma_kernel(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, exp2_fma(tl.load(X + offs)))


def exponents(n: int = 4096) -> np.ndarray:
    """P's exponents: x <= 0 spread over [-140, 0] (below the clamp too), dense near 0 and around
    integers (where the rounding to n flips), with 0, -0, tiny negatives and NaN; and up to 29, where
    the soft-capped forward's constant shift puts a row's largest (kernels.scores.softcap_shift)."""
    g = np.random.default_rng(0)
    x = np.concatenate([-g.exponential(3.0, n // 2), -g.uniform(0, 140, n // 4),
                        -np.repeat(np.arange(0, 128), 8) + g.uniform(-1e-3, 1e-3, 1024)])
    x = np.concatenate([np.minimum(x, 0)[: n - 6 - 256], g.uniform(0, 29, 256)])
    return np.concatenate([x, [0.0, -0.0, -1e-30, -0.5, -125.5, np.nan]]).astype(np.float32)


def cubic(x: np.ndarray) -> np.ndarray:
    """exp2_fma's Triton form, run where the kernels run (the CPU interpreter, or the GPU)."""
    y = torch.empty(x.size, dtype=torch.float32, device=DEVICE)
    _exp2_fma_kernel[(1,)](torch.from_numpy(x).to(DEVICE), y, N=x.size)
    return y.cpu().numpy()


def test_the_cubic_is_within_its_bound_of_2_to_the_x():
    """Relative error at most MAX_REL_ERROR (7.5e-5, plus float32 rounding) where 2^x is normal;
    below the clamp (-126) an absolute error under 2^-125; NaN stays NaN."""
    x = exponents()
    y = cubic(x).astype(np.float64)
    exact = np.exp2(x.astype(np.float64))
    normal = x >= FLOOR.value
    rel = np.abs(y[normal] - exact[normal]) / exact[normal]
    assert rel.max() <= MAX_REL_ERROR + 2**-23, rel.max()
    assert np.all(np.abs(y[~normal & ~np.isnan(x)] - exact[~normal & ~np.isnan(x)]) < 2.0**-125)
    assert np.isnan(y[np.isnan(x)]).all() and not np.isnan(y[~np.isnan(x)]).any()


def test_the_ptx_computes_the_triton_form():
    """SPLIT_PTX[n] (run by tests/ptx_emulator.py) gives its first n elements the cubic as the Triton
    form computes it, to the ulp (the PTX fuses each Horner step into one FMA, the interpreter rounds
    the product and the sum apart), and the others 2^x (ex2.approx, emulated as 2^x rounded); its
    literals are COEFFS."""
    x = exponents(512)
    want = cubic(x)
    for n in range(1, 5):
        for i in range(0, x.size, 4):
            group = [bits(v) for v in x[i:i + 4]]
            out = run_ptx(SPLIT_PTX.value[n], [0, 0, 0, 0] + group, 4)
            for j in range(4):
                got, expect = f32(out[j]), (float(want[i + j]) if j < n else float(np.float32(2.0 ** float(x[i + j]))))
                ulps = 1 if j < n else 0
                assert (math.isnan(got) and math.isnan(expect)) or abs(bits(got) - bits(expect)) <= ulps, \
                    (n, x[i + j], got, expect)
    for c in COEFFS:
        assert f"0f{int(np.float32(c).view(np.uint32)):08X}" in SPLIT_PTX.value[4]


def test_the_split_runs_only_where_measured():
    """ON_FMA (what launches use) holds only CANDIDATES a GPU A/B found faster: the shifted soft-capped
    Triton forward and the soft-capped Gluon backward (K folded) at head dim 64. on_fma tells the
    shift from the running max, and never moves an exponential with dropout or float32 inputs."""
    assert exp2.ON_FMA == {("triton", 64, "softcap-shift"): 1, ("gluon-bwd", 64, "softcap"): 1}
    assert set(exp2.ON_FMA) <= set(exp2.CANDIDATES)
    assert exp2.on_fma("triton", 64, 50.0, 0.0, torch.bfloat16, shift=30.0) == 1
    assert exp2.on_fma("gluon-bwd", 64, 50.0, 0.0, torch.bfloat16) == 1
    assert exp2.on_fma("gluon-bwd", 64, 50.0, 0.1, torch.bfloat16) == 0
    assert exp2.on_fma("triton", 64, 50.0, 0.0, torch.bfloat16) == 0            # the running max
    assert exp2.on_fma("triton", 128, 50.0, 0.0, torch.bfloat16, shift=30.0) == 0
    assert exp2.on_fma("triton", 64, 0.0, 0.0, torch.bfloat16) == 0
    assert exp2.on_fma("gluon", 64, 30.0, 0.0, torch.bfloat16) == 0
    with pytest.MonkeyPatch.context() as m:
        m.setattr(exp2, "ON_FMA", dict(exp2.CANDIDATES))
        assert exp2.on_fma("gluon", 64, 30.0, 0.0, torch.bfloat16) == 2
        assert exp2.on_fma("gluon", 64, 0.0, 0.0, torch.bfloat16) == 1
        assert exp2.on_fma("gluon", 64, 30.0, 0.1, torch.bfloat16) == 0
        assert exp2.on_fma("triton", 64, 30.0, 0.0, torch.float32, shift=10.0) == 0


@pytest.mark.parametrize("form", ["running-max", "shift"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_triton_forward_with_exponentials_on_the_fma_units_is_as_exact(monkeypatch, causal, form):
    """The soft-capped Triton forward with EXP2_ON_FMA (on the CPU the cubic takes every exponential
    of an unmasked tile) against the float64 reference, as every kernel test is: with sinks, which
    keep the running max, and without, under the constant shift (scores.softcap_shift; forced on the
    CPU's float16, which bf16 runs take on the GPU: at c = 5 the shift is 0 and P stays under e^5)."""
    from kernels import flash_op, scores

    monkeypatch.setattr(exp2, "ON_FMA", {("triton", d, f): 1 for d in (16, 32, 64, 128)
                                         for f in ("softcap", "softcap-shift")})
    monkeypatch.setattr(flash_op, "_CALLS", {})
    dtype = DTYPES[-1] if HAS_CUDA else torch.float16   # 16-bit: float32 keeps ex2
    if form == "shift" and not HAS_CUDA:
        monkeypatch.setattr(scores, "softcap_shift", forced_shift)
    q, k, v, do = make_inputs(2, 96, 96, 4, 2, 32, dtype)
    q = (q.float() * 3).to(dtype)
    check(q, k, v, do, causal, softcap=5.0, **({"sinks": heads(4)} if form == "running-max" else {}))


@requires_hopper
@pytest.mark.parametrize("kernel", [("triton", "triton"), ("gluon", "triton"), ("triton", "gluon")], ids="/".join)
@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("shape, causal", [((2, 1024, 1024, 8, 2, 64), True), ((1, 300, 517, 4, 4, 128), False),
                                           ((1, 2048, 2048, 4, 4, 64), False)])
def test_the_candidate_splits_are_as_exact_on_the_gpu(monkeypatch, kernel, softcap, shape, causal):
    """Every CANDIDATES entry through its kernel on the GPU, where the PTX runs (the forwards, and the
    Gluon backward's recomputed P): as exact as the plain formula in bf16 and float16."""
    from kernels import flash_op

    monkeypatch.setattr(exp2, "ON_FMA", dict(exp2.CANDIDATES))
    for dtype in (torch.bfloat16, torch.float16):
        monkeypatch.setattr(flash_op, "_CALLS", {})
        q, k, v, do = make_inputs(*shape, dtype)
        q = (q.float() * 4).to(dtype)
        check(q, k, v, do, causal, kernel=kernel, **({"softcap": softcap} if softcap else {}))
