"""2^x on the FMA units, for the share of a tile's exponentials the special-function unit cannot keep up with.

Why. A Hopper SM evaluates 16 MUFU operations (ex2, tanh) a clock and 128 float32 FMAs. Plain
attention at head dim 64 already needs one ex2 a score for 2 x 64 multiply-adds of tensor-core work,
and soft-capping adds a tanh, a second MUFU operation a score: counted in SASS, the soft-capped tile's
MUFU time exceeds the time its instructions take to issue. Computing some exponentials with a
polynomial on the FMA units trades MUFU time for issue slots until the two balance (FlashAttention-4
does this on Blackwell). Timed on an H100 it did not pay in our forwards, which are not MUFU-bound
(kernels/LOG.md, "2026-12-05 (H100)"), until the soft-capped Triton forward lost its running max:
ON_FMA below lists where the split is on, and `--switches exp2-fma` (scripts/bench/bench_attention_scores.py)
times every CANDIDATES entry on.

How. For x <= 0 (every P exponent is a score minus its row max; soft-capped scores minus the
constant of kernels/scores.py's softcap_shift reach up to 29, which the steps below take as well:
they hold for any x < 128):

    x  = max(x, -126)             (max.NaN: a NaN stays NaN; below -126 the result is < 2^-126, 0 to
                                   the output's precision, and the exponent field must not underflow)
    t  = x + 1.5 * 2^23           rounds x to the nearest integer n, held in t's low mantissa bits
    f  = x - (t - 1.5 * 2^23)     in [-0.5, 0.5], exact
    2^f ~ c0 + f (c1 + f (c2 + f c3))   Horner, three FMAs
    2^x = 2^f * 2^n, 2^n built from its exponent field: (bits(t) << 23) + bits(1.0)

Nine instructions where ex2.approx is one, but on other units. Adding n to 2^f's exponent field
directly would save the multiply, but turns a NaN into a finite number (NaN's bits plus n's) and
an exponent pushed to 0 into a wrong subnormal; the multiply keeps NaN a NaN and rounds 2^-126
times 2^f < 1 correctly.

The cubic is the minimax fit of 2^f on [-0.5, 0.5] in relative error (Remez exchange; its
coefficients rounded to float32): at most 7.5e-5, below the rounding of P to bfloat16 (2^-9) or
float16 (2^-11) before P V, and below the 16-bit inputs' own error in the row sums. ex2.approx is
exact to 2 ulp: the two paths differ only in rounding the output already hides.

`exp2_split(x, ON_FMA)` computes ON_FMA of every 4 elements this way and the rest with ex2.approx,
in one piece of inline PTX per 4 elements (which 4 Triton groups does not matter: both paths are
exact to the same bound). The CPU interpreter runs no PTX: there every element takes the polynomial,
so the CPU tests check the polynomial against the float64 reference through the whole kernel.
"""
from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from kernels.scores import PTX   # inline PTX runs on the GPU only

# the cubic's coefficients c0 .. c3 (float32), its maximum relative error on [-0.5, 0.5], the clamp
COEFFS = (0.9999280571937561, 0.6932609677314758, 0.2426111251115799, 0.0551716685295105)
MAX_REL_ERROR = 7.5e-5
C0, C1, C2, C3 = (tl.constexpr(c) for c in COEFFS)
ROUND = tl.constexpr(12582912.0)   # 1.5 * 2^23: x + ROUND rounds x to an integer in t's low bits
FLOOR = tl.constexpr(-126.0)


@triton.jit
def exp2_fma(x):
    """2^x of float32 x < 128 by the cubic (the module's docstring), in Triton: what the CPU
    interpreter runs, and the reference the PTX is checked against (tests/test_exp2_fma.py)."""
    x = tl.maximum(x, FLOOR, propagate_nan=tl.PropagateNan.ALL)   # NaN stays NaN, as max.NaN keeps it
    t = x + ROUND
    f = x - (t - ROUND)
    y = ((C3 * f + C2) * f + C1) * f + C0
    return y * ((t.to(tl.uint32, bitcast=True) << 23) + 0x3F800000).to(tl.float32, bitcast=True)


def _hex(value: float) -> str:
    """PTX's float32 literal of value (a float32 already): 0f and its bits."""
    return "0f" + struct.pack(">f", value).hex().upper()


def _fma_exp2_ptx(out: int, arg: int) -> str:
    """PTX for $out = 2^$arg by the cubic; temporaries x, t, f, y (declared by the caller)."""
    c0, c1, c2, c3 = (_hex(c) for c in COEFFS)
    return (f"max.NaN.f32 x, ${arg}, {_hex(FLOOR.value)}; add.rn.f32 t, x, {_hex(ROUND.value)}; "
            f"sub.rn.f32 f, t, {_hex(ROUND.value)}; sub.rn.f32 f, x, f; "
            f"fma.rn.f32 y, f, {c3}, {c2}; fma.rn.f32 y, y, f, {c1}; fma.rn.f32 y, y, f, {c0}; "
            f"shl.b32 t, t, 23; add.u32 t, t, 0x3F800000; mul.rn.f32 ${out}, y, t;")


def _split_ptx(on_fma: int) -> str:
    """PTX of `exp2_split` for 4 elements ($4 .. $7 in, $0 .. $3 out): the first `on_fma` by the
    cubic, the others by ex2.approx.ftz (what tl.math.exp2 compiles to)."""
    body = " ".join(_fma_exp2_ptx(i, 4 + i) if i < on_fma else f"ex2.approx.ftz.f32 ${i}, ${4 + i};" for i in range(4))
    return "{ .reg .b32 x, t, f, y; " + body + " }"


SPLIT_PTX = tl.constexpr(tuple(_split_ptx(n) for n in range(5)))   # by ON_FMA


@triton.jit
def exp2_split(x, ON_FMA: tl.constexpr):
    """2^x of float32 x < 128 with ON_FMA (0 to 4) of every 4 elements computed on the FMA units."""
    if ON_FMA == 0:
        return tl.math.exp2(x)
    elif PTX:
        return tl.inline_asm_elementwise(SPLIT_PTX[ON_FMA], "=r,=r,=r,=r,r,r,r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=4)
    else:
        return exp2_fma(x)


# (family, head dim, scores) -> of every 4 exponentials of an unmasked tile, how many the FMA units
# take. family: a forward's ("triton", "gluon") or the Gluon backward's ("gluon-bwd", which recomputes
# a soft-capped P with tanh and exp2 as the forward does); scores: "plain", "softcap" (a running row
# max) or "softcap-shift" (the Triton forward's constant shift, kernels/scores.py softcap_shift).
# CANDIDATES: where the sm_90 code's counts put the balance of MUFU time and issue slots
# (kernels/LOG.md, 2026-12-05); the GPU tests run them all. ON_FMA: those a GPU A/B found faster. On
# an H100 the running-max Triton forward was slower with the split and the Gluon one 2.5% faster
# (LOG.md, "2026-12-05 (H100)"), neither what a run launches at 4K; the shifted Triton forward, ~80
# instructions a step shorter, was 4% faster at head dim 64, and the Gluon backward slower in every
# form with the cap unfolded (LOG.md, both "2026-12-07, night" entries). Head dim 128 was not timed,
# so it stays on ex2. Both soft-capped head-dim-64 tiles wait on the MUFU (LOG.md, "2026-12-07,
# midnight"). The Gluon backward's, with the cap's scale / c folded into K, balances at 1 of 4: 2%
# faster on an H100 (LOG.md, "2026-12-08"). The shifted forward's counts balanced at 2 of 4, which
# measured 4% slower than 1 of 4 there, so it keeps 1.
CANDIDATES = {("triton", 64, "softcap"): 1, ("triton", 128, "softcap"): 1,
              ("triton", 64, "softcap-shift"): 1, ("triton", 128, "softcap-shift"): 1,
              ("gluon", 64, "softcap"): 2, ("gluon", 128, "softcap"): 2, ("gluon", 64, "plain"): 1,
              ("gluon-bwd", 64, "softcap"): 1, ("gluon-bwd", 128, "softcap"): 1}
ON_FMA: dict = {("triton", 64, "softcap-shift"): 1, ("gluon-bwd", 64, "softcap"): 1}


def on_fma(family: str, head_dim: int, softcap: float, dropout_p: float, dtype, shift: float = -1.0) -> int:
    """EXP2_ON_FMA of a launch (shift: its SHIFT, >= 0 where the soft-capped scores take a
    constant shift): 0 with dropout (its tile waits on issue slots, not on the special-function unit)
    and for float32 inputs (whose output does not hide the cubic's error)."""
    if dropout_p > 0 or dtype == torch.float32:
        return 0
    scores = "plain" if softcap <= 0 else ("softcap-shift" if shift >= 0 else "softcap")
    return ON_FMA.get((family, head_dim, scores), 0)
