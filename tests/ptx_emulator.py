"""Runs the kernels' inline PTX on the CPU, one invocation at a time, so that what a piece of PTX
computes can be checked bit for bit without a GPU (CI has none; the interpreter cannot run PTX).

Only the straight-line subset the kernels' inline PTX uses: `.reg` declarations, mov, prmt (default
mode), integer add/sub/shl/and/or/xor/not on 32 bits, and float32 add/sub/mul/fma (round to
nearest even), max (with .NaN), and ex2.approx (taken as 2^x rounded to float32: the hardware's
is within 2 ulp of it, which callers must allow for). Registers hold 32-bit patterns; $N are the
operands as Triton numbers them (outputs first).
"""
from __future__ import annotations

import math
import re
import struct

import numpy as np

MASK32 = 0xFFFFFFFF


def f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & MASK32))[0]


def bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", np.float32(x)))[0]


def _fma(a: float, b: float, c: float) -> float:
    """a * b + c rounded once to float32: the product of two float32 is exact in a Python int ratio."""
    from fractions import Fraction
    if any(math.isnan(v) or math.isinf(v) for v in (a, b, c)):
        return float(np.float32(a) * np.float32(b) + np.float32(c))
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    return _round_f32(exact)


def _round_f32(exact) -> float:
    """The float32 nearest an exact rational (ties to even), through float64 candidates."""
    from fractions import Fraction
    guess = np.float32(float(exact))
    below, above = np.nextafter(guess, np.float32(-np.inf)), np.nextafter(guess, np.float32(np.inf))
    best = min((guess, below, above), key=lambda v: (abs(Fraction(float(v)) - exact),
                                                     bits(float(v)) & 1))
    return float(best)


def _prmt(a: int, b: int, selector: int) -> int:
    """prmt.b32 (default mode): byte i of the result is byte (selector nibble i & 7) of {b, a},
    replicated from its sign bit when the nibble's bit 3 is set."""
    source = (a & MASK32) | ((b & MASK32) << 32)
    out = 0
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = (source >> (8 * (nibble & 7))) & 0xFF
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _value(token: str, regs: dict, operands: list[int]) -> int:
    token = token.strip()
    if token.startswith("$"):
        return operands[int(token[1:])] & MASK32
    if token in regs:
        return regs[token]
    if token.startswith("0f"):
        return int(token[2:], 16)
    return int(token, 0) & MASK32


def run_ptx(asm: str, operands: list[int], n_outputs: int) -> list[int]:
    """The values of $0 .. $(n_outputs - 1) after `asm` runs with `operands` (32-bit patterns; the
    outputs' slots may hold anything)."""
    operands = list(operands)
    regs: dict[str, int] = {}
    for statement in asm.replace("{", ";").replace("}", ";").split(";"):
        statement = statement.strip()
        if not statement or statement.startswith(".reg"):
            continue
        op, rest = statement.split(None, 1)
        args = [a.strip() for a in rest.split(",")]
        dest, srcs = args[0], [_value(a, regs, operands) for a in args[1:]]
        fs = [f32(s) for s in srcs]
        base = op.split(".")[0]
        if base == "mov":
            result = srcs[0]
        elif base == "prmt":
            result = _prmt(*srcs)
        elif op in ("add.u32", "add.s32"):
            result = srcs[0] + srcs[1]
        elif op in ("sub.u32", "sub.s32"):
            result = srcs[0] - srcs[1]
        elif base == "shl":
            result = srcs[0] << min(srcs[1], 32)
        elif base == "and":
            result = srcs[0] & srcs[1]
        elif base == "or":
            result = srcs[0] | srcs[1]
        elif base == "xor":
            result = srcs[0] ^ srcs[1]
        elif base == "not":
            result = ~srcs[0]
        elif op in ("add.f32", "add.rn.f32"):
            result = bits(np.float32(fs[0]) + np.float32(fs[1]))
        elif op in ("sub.f32", "sub.rn.f32"):
            result = bits(np.float32(fs[0]) - np.float32(fs[1]))
        elif op in ("mul.f32", "mul.rn.f32"):
            result = bits(np.float32(fs[0]) * np.float32(fs[1]))
        elif op == "fma.rn.f32":
            result = bits(_fma(*fs))
        elif op in ("max.f32", "max.NaN.f32"):
            if any(math.isnan(v) for v in fs):
                result = 0x7FFFFFFF if op == "max.NaN.f32" else bits(fs[1] if math.isnan(fs[0]) else fs[0])
            else:
                result = bits(max(fs))
        elif op in ("ex2.approx.f32", "ex2.approx.ftz.f32"):
            x = fs[0]
            result = 0x7FFFFFFF if math.isnan(x) else bits(float(np.float32(2.0 ** max(min(x, 200.0), -200.0))))
        else:
            raise NotImplementedError(f"ptx_emulator: {op!r} ({statement})")
        result &= MASK32
        if re.fullmatch(r"\$\d+", dest):
            operands[int(dest[1:])] = result
        else:
            regs[dest] = result
    return operands[:n_outputs]
