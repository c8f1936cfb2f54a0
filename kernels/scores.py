"""What the Triton kernels do to a tile's scores besides masking them: logit soft-capping, attention
sinks and attention dropout, forward and backward.

Soft-capping (Gemma 2). Each score s = scale * q.k becomes t = c tanh(s / c) before the softmax,
so no logit leaves (-c, c). The kernels' softmax runs in base 2, so `softcap_scores` returns
t log2(e) directly, with u = tanh(s / c): the backward needs dt/ds = 1 - u^2, and multiplies the
score gradient dS by it before dQ and dK are formed from it. Triton has no tanh that both compiles
for the GPU and runs in its CPU interpreter; `tanh` below is Cephes' single-precision one (an odd
polynomial below 0.625, 1 - 2 / (e^2x + 1) above, both a few ulp). That costs some 25 instructions
a score, a full division among them, which doubled the forward at head dim 64 on the H200
(benchmarks/attention/attention_scores_h200_029f81b.md, kernels/LOG.md). On a GPU with 16-bit inputs the
kernels take the hardware's tanh instead (PTX tanh.approx.f32, one special-function instruction, as
FlashAttention's soft-capping does): its relative error, below 2^-10.9, is less than the rounding
of a bfloat16 or float16 score that the plain formula in those dtypes makes. float32 inputs, and
the CPU interpreter, which cannot run PTX, keep the polynomial.

Sinks (gpt-oss). One learnable logit per head joins every row's softmax denominator and carries
no value: P_ij = exp(s_ij) / (exp(sink) + sum_k exp(s_ik)). In the online softmax that is the
state every row starts from (running max m = sink, running sum l = 1: `sink_start`), so the row's
log-sum-exp L includes the sink, and a row that sees no key gets O = 0 and L = sink. The backward
needs nothing more: P = exp(S - L) recomputed from that L is already the sink-aware probability,
and Delta = rowsum(dO * O) = sum_j P_ij dP_ij still holds, since the sink adds no value to O. The
sink's own gradient is -sum_i exp(sink - L_i) Delta_i over the rows of its head: a reduction over
(batch, row) done in PyTorch (kernels/flash_op.py), deterministic and a few microseconds long.

Dropout. A kept probability is scaled by 1 / (1 - p), a dropped one is 0, on P after the
softmax (as SDPA and FlashAttention-2 do: the normaliser L is the undropped one). Nothing of
size N x N is stored: the mask is a function of the score's coordinates, drawn from Philox
(Salmon et al. 2011, the counter-based generator of cuRAND and of Triton's tl.rand), so the
forward and both backward kernels regenerate the same mask for any tile shape. For score
(i, j) of head h of batch row b, one Philox4x32 call with

    key     = the call's 64-bit seed
    counter = (j with bits 0 and 3 cleared, i with bits 0 and 3 cleared, b * H + h, the call's offset)

gives 128 bits for the 16 scores (i | 8a | e, j | 8c | d), a, c, d, e in {0, 1}: score (i, j) takes
word 2 (i bit 3) + (j bit 3) and, of it, byte 2 (i bit 0) + (j bit 0), and is kept iff that byte,
read as an integer, is below 256 (1 - p). So p is drawn in steps of 1/256, the nearest to the
caller's (kernels.checks.drawn_dropout_p; check_scores refuses a p that rounds to 0 or 1), and the kept
scores are scaled by that p's 1 / (1 - p): the expected output is exactly the undropped one.
FlashAttention-2, which SDPA runs, draws 8 bits a score too (with the caller's p in the scale).
Why those bits: in the layout of a tensor-core accumulator (mma and wgmma alike) row bit 3 and
column bits 0 and 3 are registers of one thread, row bit 0 a lane bit. In S = Q K^T two threads
(lanes 4 apart) compute each call, each for its own 8 scores; in S^T, which the backward's dK/dV
kernels work on, rows are keys and the same holds with key bit 0 the lane. Row and key bits 3 are
the only ones in registers in both orientations, so this is as few calls a score as a draw both
directions share can make in a thread: one per 8 scores each way (with 16-bit draws on row bit 3
and key bits 0 and 3, the forward made one per 8 and the backward one per 4: kernels/LOG.md,
2026-12-04). The compiler, given the counter as a tile start plus a masked arange, computes each
call once. The Gluon kernels, whose accumulator layouts are explicit, go one step further: of the
two calls that a pair of lanes both read, each lane makes one and shuffles its partner the words
it lacks (SHARE, `_shared_word`), one call per 16 scores. Seven rounds, as FlashAttention-2 uses
(Philox4x32-7 passes the BigCrush battery; ten is cuRAND's margin).
The seed and offset are two int64 drawn per call from torch's generator on q's device
(`dropout_seed`): the backward reads the same two numbers, a resumed run that restored the
generator draws the same ones, and torch.compile traces the draw. `dropout_mask` launches the
same function over a whole (B, H, Nq, Nk) grid: what the tests compare the kernels against.
With every option off, the kernels compile to the code they had without them: the options are
constexprs (SOFTCAP, DROPOUT_P) and None arguments (Rng, Sinks), which Triton leaves out.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import INTERPRET, drawn_dropout_p
from kernels.tiles import LOG2E

PHILOX_ROUNDS = tl.constexpr(7)
PTX = tl.constexpr(not INTERPRET)   # inline PTX runs on the GPU only

# The forwards zero dropped halves of P's packed 16-bit pairs (`drop_scores`): on an H100 the Triton
# forward 3% and the Gluon one 8% faster with dropout (benchmarks/attention/score_switches_ab_h100.md).
# Which scores share an asm call is Triton's choice, checked on the CPU only through the layout it
# compiles to; on the GPU test_the_packed_dropout_mask_is_the_unpacked_one checks the outputs bit for
# bit against the unpacked mask (passed on an H100, triton 3.6). False restores the unpacked mask
# (bench_attention_scores.py --switches unpacked-dropout). Like SOFTCAP_FIXED_SHIFT below, it is read
# at a call signature's first call, whose kernels kernels/flash_op.py then keeps: set it before.
PACKED_DROPOUT = True

# A soft-capped score lies in [-c, c], so the Triton forward may shift every exponent by one constant
# instead of a running row max: no max, no rescale of O and l per tile (`softcap_shift`). False keeps
# the running max (bench_attention_scores.py --switches softcap-running-max).
SOFTCAP_FIXED_SHIFT = True
SHIFT_HEADROOM = 20.0   # natural-log units: P <= e^20, so l and O's accumulator stay finite for any N and |v| < 1e20


# ---- soft-capping ------------------------------------------------------------------------------

@triton.jit
def tanh(x):
    """tanh in float32 to a few ulp (Cephes' tanhf: the polynomial keeps small |x| relatively exact)."""
    a = tl.abs(x)
    # |x| >= 0.625: no cancellation; e^2x stops at 2^64 (tanh is 1.0 in float32 long before)
    big = 1.0 - 2.0 / (tl.math.exp2(tl.minimum(a * (2 * LOG2E), 64.0)) + 1.0)
    z = x * x
    small = ((((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z + 1.33314422036e-1) * z
             - 3.33332819422e-1) * z * x + x
    return tl.where(a < 0.625, small, tl.where(x < 0, -big, big))


@triton.jit
def hardware_tanh(x):
    """tanh of float32 x in one special-function instruction (PTX tanh.approx.f32, sm_75 and later)."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


def softcap_shift(softcap: float, dtype: torch.dtype, sinks) -> float:
    """SHIFT of a Triton forward launch: the constant k (natural log) that every soft-capped exponent
    is shifted by in place of the running max, or -1.0 where the running max stays.

    P = e^(t - k) for capped scores t in [-c, c] lies in [e^(-c-k), e^(c-k)]. k = max(0, c - 20) keeps
    the top at e^20 or less (row sums under 2^31 e^20, so nothing overflows in float32) and the bottom
    at e^(20 - 2c) or more, which stays a normal float32 while c <= 53: Gemma 2's cap of 50 fits.
    What the shift costs is the exponent's rounding: a row's largest scores now sit up to (c + k)
    log2(e) from 0 in exp2's argument (115 at c = 50) where the max put them at 0, which gives P a
    relative error up to 115 x 2^-24 ~ 7e-6. bfloat16 inputs round P to 2^-9 before P V, so there
    it is lost; float32 inputs' own formula is ~1e-7 exact, and float16's P would overflow its
    65,504: both keep the running max, as do sinks (an unbounded learned logit joins every row) and
    larger caps."""
    if not (SOFTCAP_FIXED_SHIFT and softcap > 0 and sinks is None and dtype == torch.bfloat16
            and softcap <= 53.0):
        return -1.0
    return max(0.0, float(softcap) - SHIFT_HEADROOM)


@triton.jit
def softcap_scores(dots, qk_scale, SOFTCAP: tl.constexpr, INPUT_DTYPE: tl.constexpr):
    """(c tanh(s / c) log2(e), u = tanh(s / c)) of raw products `dots` = q.k, where s = scale q.k and
    qk_scale = scale log2(e), c = SOFTCAP: the capped scores in the kernels' base-2 domain, and the
    tanh whose 1 - u^2 is the cap's derivative."""
    u = softcap_tanh(dots, qk_scale, SOFTCAP, INPUT_DTYPE)
    return u * (SOFTCAP * LOG2E), u


@triton.jit
def softcap_tanh(dots, qk_scale, SOFTCAP: tl.constexpr, INPUT_DTYPE: tl.constexpr):
    """u = tanh(s / c) of raw products `dots`, as `softcap_scores`. A forward scales u by c log2(e)
    where it scales raw scores by qk_scale: in its row max (c > 0, so max(u) c log2(e) is the max of
    the capped scores) and in P's exponent, one FMA with the max as without the cap, where the
    capped tile itself, kept for the max, cost a multiply a score more (kernels/LOG.md, 2026-12-05).
    INPUT_DTYPE, q's: 16-bit inputs on a GPU take the hardware's tanh, float32 ones the polynomial
    (see the module's docstring)."""
    x = dots * (qk_scale / (SOFTCAP * LOG2E))
    if PTX and INPUT_DTYPE != tl.float32:
        return hardware_tanh(x)
    else:
        return tanh(x)


# ---- sinks -------------------------------------------------------------------------------------

@triton.jit
def sink_start(Sinks, h, BLOCK_M: tl.constexpr):
    """The online softmax's starting (m, l) of BLOCK_M rows of head h: (-inf, 0) without sinks
    (Sinks None), (sink log2(e), 1) with them, the sink counted as one more score of every row."""
    if Sinks is None:
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BLOCK_M], dtype=tl.float32)
    else:
        m = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(Sinks + h) * LOG2E
        l = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    return m, l


# ---- dropout -----------------------------------------------------------------------------------

@triton.jit
def dropout_seed_of(Rng, DROPOUT_P: tl.constexpr):
    """The call's (seed, offset) from Rng (two int64 drawn by `dropout_seed`); (0, 0) without dropout."""
    seed = 0
    offset = 0
    if DROPOUT_P > 0:
        seed = tl.load(Rng)
        offset = tl.load(Rng + 1).to(tl.uint32)
    return seed, offset


def _mul_wide(m: int) -> tl.constexpr:
    """PTX for the (low, high) 32 bits of $2 * m, m an immediate."""
    return tl.constexpr(f"{{ .reg .b64 t; mul.wide.u32 t, $2, 0x{m:08X}; mov.b64 {{$0, $1}}, t; }}")


PHILOX_A, PHILOX_B = tl.constexpr(0xD2511F53), tl.constexpr(0xCD9E8D57)   # Philox4x32's multipliers
MUL_WIDE_A, MUL_WIDE_B = _mul_wide(PHILOX_A.value), _mul_wide(PHILOX_B.value)


@triton.jit
def _wide(x, M: tl.constexpr, MUL_WIDE: tl.constexpr):
    """(low, high) 32 bits of x * M; MUL_WIDE, `_mul_wide(M)` (MUL_WIDE_A or MUL_WIDE_B)."""
    if PTX:   # one IMAD.WIDE.U32, where mul.hi and mul.lo each take ptxas two IMADs
        return tl.inline_asm_elementwise(MUL_WIDE, "=r,=r,r", [x], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)
    else:
        return x * M, tl.umulhi(x, M)


@triton.jit
def philox(seed, c0, c1, c2, c3):
    """Philox4x32 with PHILOX_ROUNDS rounds on uint32 counters: the bits of tl.philox, with each
    round's two products taken whole (kernels/LOG.md: ~14 instructions fewer a call on the GPU)."""
    seed = seed.to(tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    for _ in tl.static_range(PHILOX_ROUNDS):
        lo_b, hi_b = _wide(c2, PHILOX_B, MUL_WIDE_B)
        lo_a, hi_a = _wide(c0, PHILOX_A, MUL_WIDE_A)
        c0 = hi_b ^ c1 ^ k0
        c2 = hi_a ^ c3 ^ k1
        c1 = lo_b
        c3 = lo_a
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def dropout_keep(seed, offset, bh, start_m, start_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 DROPOUT_P: tl.constexpr):
    """(BLOCK_M, BLOCK_N) booleans: whether score (start_m + r, start_n + c) of head bh (b * H + h)
    is kept. start_m and start_n are multiples of 16, as every tile's start is; DROPOUT_P a multiple
    of 1/256 (kernels.checks.drawn_dropout_p)."""
    return dropout_draw(seed, offset, bh, start_m, start_n, BLOCK_M, BLOCK_N) < _keep_below(DROPOUT_P)


@triton.jit
def dropout_draw(seed, offset, bh, start_m, start_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 SHARE: tl.constexpr = 0):
    """`dropout_keep`'s draws (`dropout_draw_at`), for `kept`."""
    word, r, c = dropout_words(seed, offset, bh, start_m, start_n, BLOCK_M, BLOCK_N, SHARE)
    return _top_byte(word, r, c)


@triton.jit
def dropout_words(seed, offset, bh, start_m, start_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  SHARE: tl.constexpr = 0):
    """(words, r, c) of a (BLOCK_M, BLOCK_N) tile from (start_m, start_n): each score's word
    (`dropout_word_at`) and the tile's relative query and key indices, for `drop_scores`."""
    r = tl.arange(0, BLOCK_M)[:, None]
    c = tl.arange(0, BLOCK_N)[None, :]
    return dropout_word_at(seed, offset, bh, start_m, r, start_n, c, (r * 0 + c * 0).to(tl.uint32), SHARE), r, c


@triton.jit
def dropout_keep_at(seed, offset, bh, start_q, q, start_k, k, zero, DROPOUT_P: tl.constexpr,
                    SHARE: tl.constexpr = 0):
    """Whether score (query start_q + q, key start_k + k) of head bh is kept, for a tile in any
    orientation and layout: q and k are the tile's relative query and key indices (aranges
    broadcast against each other), zero a uint32 tile of zeros of the tile's shape, start_q and
    start_k multiples of 16. Elementwise only, so the Gluon kernels call it on tiles in their
    accumulators' layouts (S, or S^T with q and k swapped) and draw the Triton kernels' bits.

    SHARE (the Gluon kernels', whose layouts are known): 1 where the tile is S in a wgmma
    accumulator (query bit 0 is lane bit 2), 2 where it is S^T (key bit 0 is). Then the two lanes
    that need each call's bits split the calls instead of both making each: see `_shared_word`."""
    return dropout_draw_at(seed, offset, bh, start_q, q, start_k, k, zero, SHARE) < _keep_below(DROPOUT_P)


@triton.constexpr_function
def _keep_below(dropout_p):
    """A draw (`dropout_draw_at`) below this keeps its score: 256 (1 - p) at the top of a word."""
    return int((1.0 - dropout_p) * 256 + 0.5) << 24


@triton.jit
def dropout_draw_at(seed, offset, bh, start_q, q, start_k, k, zero, SHARE: tl.constexpr = 0):
    """`dropout_keep_at`'s draw: the score's byte at the top of a uint32 (compared there, the bits
    below it cannot matter); the score is kept iff it is below `_keep_below`."""
    return _top_byte(dropout_word_at(seed, offset, bh, start_q, q, start_k, k, zero, SHARE), q, k)


@triton.jit
def dropout_word_at(seed, offset, bh, start_q, q, start_k, k, zero, SHARE: tl.constexpr = 0):
    """The Philox word that holds score (q, k)'s byte (arguments as `dropout_keep_at`'s): what
    `drop_scores` reads, a pair of keys 2j, 2j + 1 of one query sharing it."""
    if SHARE == 0:
        return _dropout_word(seed, offset, bh, start_q, q & ~9, start_k, k & ~9, q, k, zero)
    else:
        return _shared_word(seed, offset, bh, start_q, q, start_k, k, zero, SHARE)


@triton.jit
def _top_byte(word, q, k):
    """Score (q, k)'s byte of its word (byte 2 (q bit 0) + (k bit 0)) moved to the top."""
    return word << (24 - 16 * (q & 1) - 8 * (k & 1)).to(tl.uint32)


@triton.jit
def _dropout_word(seed, offset, bh, start_q, call_q, start_k, call_k, q, k, zero):
    """The word of call (start_q + call_q, start_k + call_k) that holds score (q, k)'s byte.
    The call's counter is its coordinates (the score's with query and key bits 0 and 3 cleared),
    taken from the tile's own arange so that the compiler sees which of a thread's scores share
    a call; query and key bit 3 pick the word."""
    keys = zero + (start_k + call_k).to(tl.uint32, bitcast=True)
    queries = zero + (start_q + call_q).to(tl.uint32, bitcast=True)
    w0, w1, w2, w3 = philox(seed, keys, queries, zero + bh.to(tl.uint32), zero + offset)
    return tl.where((q & 8) != 0, tl.where((k & 8) != 0, w3, w2), tl.where((k & 8) != 0, w1, w0))


@triton.jit
def _shared_word(seed, offset, bh, start_q, q, start_k, k, zero, SHARE: tl.constexpr):
    """`_dropout_word` with each Philox call made by one of the two lanes that read it.

    In a wgmma accumulator the call's 16 scores are 8 in each of two lanes 4 apart (lane bit 2
    is S's query bit 0, S^T's key bit 0), and each lane holds both halves of two calls that differ
    in the other index's bit 4, a register. The lane whose bit is 0 makes the call with that bit
    clear, its partner the one with it set; each then takes the word it lacks from the same
    register of its partner (shfl.sync.bfly 4: the partner's score is the one at the next row or
    key, at the same word). Half the calls for two shuffles and a select a word. The CPU
    interpreter has no lanes: there the partner's word is its call made again."""
    if SHARE == 1:   # S: query bit 0 is the lane, keys pair on bit 4
        lane = q & 1
        pair = (k >> 4) & 1
    else:            # S^T: key bit 0 is the lane, queries pair on bit 4
        lane = k & 1
        pair = (q >> 4) & 1
    word = _paired_word(seed, offset, bh, start_q, q, start_k, k, zero, lane, SHARE)
    if PTX:
        other = _partner(word)
    else:
        other = _paired_word(seed, offset, bh, start_q, q, start_k, k, zero, 1 - lane, SHARE)
    return tl.where(pair == lane, word, other)


@triton.jit
def _paired_word(seed, offset, bh, start_q, q, start_k, k, zero, bit, SHARE: tl.constexpr):
    """`_dropout_word` of the call whose pairing bit (bit 4 of the key with SHARE=1, of the query
    with SHARE=2) is `bit`."""
    if SHARE == 1:
        return _dropout_word(seed, offset, bh, start_q, q & ~9, start_k, (k & ~25) | (bit << 4), q, k, zero)
    return _dropout_word(seed, offset, bh, start_q, (q & ~25) | (bit << 4), start_k, k & ~9, q, k, zero)


@triton.jit
def _partner(x):
    """x from the lane 4 away (lane bit 2 flipped), the same register. Every lane of the warp
    must run it together, as the Gluon kernels' straight-line tile code does."""
    return tl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 4, 0x1f, 0xffffffff;", "=r,r", [x],
                                     dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def kept(draw, p, DROPOUT_P: tl.constexpr):
    """p where its draw (`dropout_draw_at`) keeps it, 0 where dropped, in float32. On the GPU the
    compare and the select are one piece of inline PTX: left to LLVM, the select moved past P's
    cast to 16 bits (fptrunc of a select with a constant operand) onto the halves of packed pairs
    (two PRMTs and a SEL a score), or ptxas packed the keep bits into a register and unpacked
    them a bit at a time (kernels/LOG.md, 2026-12-05)."""
    if PTX:
        return tl.inline_asm_elementwise(
            f"{{ .reg .pred k; setp.lt.u32 k, $1, {_keep_below(DROPOUT_P)}; selp.f32 $0, $2, 0f00000000, k; }}", "=r,r,r",
            [draw, p], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.where(draw < _keep_below(DROPOUT_P), p, 0.0)


@triton.jit
def drop_scores(word, q, k, p, dtype: tl.constexpr, DROPOUT_P: tl.constexpr, PACKED: tl.constexpr):
    """P with its dropped scores 0, `kept` of each score's draw: in P's own dtype, the caller's cast
    to `dtype` following. word: `dropout_word_at`'s, q and k the tile's query and key indices as there.

    PACKED (a 16-bit dtype, on the GPU): cast first, then zero the dropped halves of each 32-bit
    register, which holds keys 2j and 2j + 1 of one query wherever the tile is an MMA accumulator
    or A operand (callers pass it only there: kernels/flash_fwd.py's PACKED_MASK). Both draws sit
    in adjacent bytes of one word, so four instructions serve the pair (`_kept_pair_ptx`), where
    the unpacked mask takes a shift, a compare and a select a score before the cast."""
    if PACKED and PTX:
        select = (q & 1).to(tl.uint32) * 0x0202 + 0x4140   # prmt: bytes 2 (q bit 0) + 0 and + 1
        p = p.to(dtype)
        return tl.inline_asm_elementwise(_kept_pair_ptx(DROPOUT_P), "=r,r,r,r,r,r", [word, select, p],
                                         dtype=p.dtype, is_pure=True, pack=2)
    else:
        return kept(_top_byte(word, q, k), p, DROPOUT_P)


@triton.constexpr_function
def _kept_pair_ptx(dropout_p):
    """PTX of `drop_scores`'s packed step, per 32-bit register $5 of two 16-bit probabilities (keys
    2j, 2j + 1 of one query) with their word $1 and byte selector $3 (0x4140 for query bit 0 clear,
    0x4342 set; $2 and $4 are the same for the register's second score):
      prmt  each half gets its score's draw byte, 0 above it;
      add   0x8000 - T to each half: its bit 15 is set iff draw >= T (dropped), T = `_keep_below`'s
            256 (1 - p); no carry crosses halves (the sum stays within 0x8000 - 255 .. 0x80FE);
      prmt  sign-replicates bit 15 and bit 31 over their halves: 0xFFFF where dropped;
      and   P with its complement (ptxas: one LOP3)."""
    half = 0x8000 - (_keep_below(dropout_p) >> 24)
    return (f"{{ .reg .b32 z, d; mov.b32 z, 0; prmt.b32 d, $1, z, $3; add.u32 d, d, 0x{half * 0x10001:08X}; "
            f"prmt.b32 d, d, z, 0xBB99; not.b32 d, d; and.b32 $0, $5, d; }}")


@triton.jit
def dropout_mask_kernel(Rng, Mask, n_heads, n_q, n_k, DROPOUT_P: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Mask (B, H, n_q, n_k) int8: 1 where the kernels keep a score. Grid (cdiv(n_q, BLOCK_M),
    cdiv(n_k, BLOCK_N), B * H)."""
    seed, offset = dropout_seed_of(Rng, DROPOUT_P)
    bh = tl.program_id(2)
    start_m = tl.program_id(0) * BLOCK_M
    start_n = tl.program_id(1) * BLOCK_N
    rows = start_m + tl.arange(0, BLOCK_M)
    cols = start_n + tl.arange(0, BLOCK_N)
    keep = dropout_keep(seed, offset, bh, start_m, start_n, BLOCK_M, BLOCK_N, DROPOUT_P)
    ptrs = Mask + bh.to(tl.int64) * n_q * n_k + rows[:, None].to(tl.int64) * n_k + cols[None, :]
    tl.store(ptrs, keep.to(tl.int8), mask=(rows < n_q)[:, None] & (cols < n_k)[None, :])


def packed_mask(dropout_p: float, dtype: torch.dtype, wgmma: bool) -> int:
    """PACKED_MASK of a forward launch: dropout on 16-bit P whose pairs lie in a wgmma accumulator
    (the Gluon forward's always, the Triton forward's on sm_90), with PACKED_DROPOUT on."""
    return int(dropout_p > 0 and wgmma and dtype != torch.float32 and PACKED_DROPOUT)


def dropout_seed(device) -> torch.Tensor:
    """A call's (seed, offset): two int64 from torch's default generator of `device`."""
    return torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device)


def dropout_mask(rng: torch.Tensor, dropout_p: float, batch: int, heads: int, n_q: int, n_k: int) -> torch.Tensor:
    """(B, H, Nq, Nk) bool: the scores a call with this `rng` (`dropout_seed`) and `dropout_p` keeps
    (drawn in steps of 1/256: kernels.checks.drawn_dropout_p), as its kernels regenerate them. For
    tests and checks (it materialises the N x N mask)."""
    mask = torch.empty((batch, heads, n_q, n_k), dtype=torch.int8, device=rng.device)
    block = 32
    dropout_mask_kernel[(triton.cdiv(n_q, block), triton.cdiv(n_k, block), batch * heads)](
        rng, mask, heads, n_q, n_k, DROPOUT_P=drawn_dropout_p(float(dropout_p)), BLOCK_M=block, BLOCK_N=block)
    return mask.bool()


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The sinks' gradient from out, dout (B, Nq, H, D) and lse (B, H, Nq) of the attention (its L
    includes the sinks): `sink_grad_from_delta` of Delta = rowsum(dO * O)."""
    acc = torch.promote_types(lse.dtype, torch.float32)                              # float64 stays float64
    return sink_grad_from_delta((dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2), lse, sinks)


def sink_grad_from_delta(delta: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The sinks' gradient, -sum over batch and rows of exp(sink - L) Delta, from Delta and lse (B, H, Nq).
    The backward kernels compute Delta anyway: taking theirs spares reading dO and O again in
    float32 copies (~0.1 ms of a ~1 ms backward at gpt2-small's 4K shape). Traced, it runs as the
    opaque op below, so that compiled and eager training reduce in the same order and get the same
    bits: traced as plain torch code, Inductor fused the expression into a reduction of its own
    order (the backward's graph is traced where torch.compiler.is_compiling() is False, so a branch
    on it did not reach there). The eager autograd Function, never traced, calls `sink_grad_eager`,
    the op's function itself (kernels/flash_op.py): the same bits, without the op's host time."""
    return sink_grad_op(delta, lse, sinks)


def sink_grad_eager(delta: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """`sink_grad_from_delta`'s computation itself, for code that is never traced: the op's bits
    without its host time."""
    acc = torch.promote_types(lse.dtype, torch.float32)
    return -(torch.exp(sinks.to(acc)[None, :, None] - lse) * delta.to(acc)).sum((0, 2)).to(sinks.dtype)


@torch.library.custom_op("flashtrain::sink_grad", mutates_args=())
def sink_grad_op(delta: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """sink_grad_from_delta as one opaque op: the same computation under torch.compile as in eager."""
    return sink_grad_eager(delta, lse, sinks)


@sink_grad_op.register_fake
def _sink_grad_fake(delta, lse, sinks):
    return sinks.new_empty(sinks.shape)
