"""What the Gluon kernels do to a tile's scores besides masking them, in the accumulator's own layout:
the hardware tanh of soft-capping and the dropout mask. The definitions are kernels/scores.py's (the
Triton kernels'), which the module's docstring explains; these are the same computations written
in Gluon, so that a Gluon forward and a Triton backward, or the other way round, agree bit for bit
on every dropped score (tests/test_attention_scores.py, tests/test_gluon_backward.py)."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kernels.scores import PHILOX_ROUNDS


@gluon.jit
def hardware_tanh(x):
    """tanh of float32 x in one special-function instruction (PTX tanh.approx.f32), as the Triton
    kernels take it for 16-bit inputs (kernels/scores.py: its error is below a 16-bit score's rounding)."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def philox(seed, c0, c1, c2, c3, ROUNDS: gl.constexpr):
    """Philox4x32 as triton.language.philox computes it."""
    seed = seed.to(gl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(gl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(gl.uint32)
    for _ in gl.static_range(ROUNDS):
        a0 = c0
        a2 = c2
        c0 = gl.umulhi(0xCD9E8D57, a2) ^ c1 ^ k0
        c2 = gl.umulhi(0xD2511F53, a0) ^ c3 ^ k1
        c1 = a2 * 0xCD9E8D57
        c3 = a0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@gluon.jit
def dropout_seed_of(Rng, DROPOUT_P: gl.constexpr):
    """The call's (seed, offset) from Rng (two int64 drawn by kernels.scores.dropout_seed); (0, 0) without dropout."""
    seed = 0
    offset = 0
    if DROPOUT_P > 0:
        seed = gl.load(Rng)
        offset = gl.load(Rng + 1).to(gl.uint32)
    return seed, offset


@gluon.jit
def dropout_keep(seed, offset, bh, start_q, q, start_k, k, zero, DROPOUT_P: gl.constexpr):
    """Whether score (query start_q + q, key start_k + k) of head bh is kept, for a tile in any
    orientation: q and k are the tile's relative query and key indices (aranges broadcast against
    each other), zero a uint32 tile of zeros in its layout, start_q and start_k multiples of 16.
    Row bit 3 and key bits 0 and 3 pick a score's 16 bits of one Philox call (kernels/scores.py); the
    counter is each start plus its masked arange, so the compiler sees which scores share a call."""
    KEEP: gl.constexpr = int((1.0 - DROPOUT_P) * 65536 + 0.5)
    keys = zero + (start_k + (k & ~9)).to(gl.uint32, bitcast=True)
    queries = zero + (start_q + (q & ~8)).to(gl.uint32, bitcast=True)
    w0, w1, w2, w3 = philox(seed, keys, queries, zero + bh.to(gl.uint32), zero + offset, PHILOX_ROUNDS)
    word = gl.where((q & 8) != 0, gl.where((k & 8) != 0, w3, w2), gl.where((k & 8) != 0, w1, w0))
    bits = gl.where((k & 1) != 0, word >> 16, word & 0xFFFF)
    return bits < KEEP
