"""Fingerprints of the PTX every attention kernel compiles to for Hopper, to show that a change
made for the reader leaves the generated code as it was.

    python scripts/kernel_dev/kernel_ptx_fingerprint.py                       # print one fingerprint per kernel config
    python scripts/kernel_dev/kernel_ptx_fingerprint.py --check               # compare with tests/kernel_ptx_fingerprints.json
    python scripts/kernel_dev/kernel_ptx_fingerprint.py --write               # record this Triton's fingerprints there
    python scripts/kernel_dev/kernel_ptx_fingerprint.py --quick --only 'fwd'  # the subset the CPU test compiles

No GPU is needed: every kernel is compiled for sm_90a as scripts/kernel_dev/kernel_report.py's compile helpers
do (a launch's specialisation: strides of 1 constant, multiples of 16 divisible), for each kernel
(Triton forward, dQ, dK/dV, atomic dK/dV/dQ, Delta; the Gluon forward's variants, backward and its
prep kernel; the decode kernels), head dims 32 to 256 where the tile tables have them, causal or not,
document masks and windows on and off, at the pinned default tile of each table; and at head dims 64
and 128 the Triton kernels with the score options of kernels/scores.py on (dropout, soft-capping,
sinks; the exponentials split onto the FMA units as a bf16 launch splits them, kernels/exp2.py) and
the Gluon backward with soft-capping and with dropout, which are off in every other config. The
fingerprint is a hash of the PTX text without what only debuggers read: `.loc` and `.file` lines,
`//` comments, the `.section .debug*` tail and the labels that only those sections reference. Two trees
with the same fingerprints run the same machine code, so a refactor needs no new GPU run.
Fingerprints differ between Triton releases; the file keeps one set per release (run the script
with each Triton, e.g. a second virtualenv's python, to record or check it).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/, for _common (which puts the repo root first)
import _common  # noqa: F401  (puts the repo root on sys.path)

from _common import REPO_ROOT, argument_parser, run_cli, write_json

FINGERPRINTS = REPO_ROOT / "tests" / "kernel_ptx_fingerprints.json"
DIMS = (32, 64, 96, 128, 256)
# (causal, docs, window): a window is causal local attention, so it never comes without causal
MASKS = ((False, False, False), (False, True, False), (True, False, False), (True, True, False),
         (True, False, True), (True, True, True))
QUICK_DIMS = (64, 128)
SCORE_DIMS = (64, 128)
# The score options each kernel compiles with (sinks change only the forward: kernels/scores.py)
SCORE_SETS = {"fwd": (("softcap",), ("dropout",), ("sinks",), ("dropout", "softcap", "sinks")),
              **{k: (("softcap",), ("dropout",), ("dropout", "softcap")) for k in ("q", "kv", "kv_dq")}}
QUICK_MASKS = ((False, False, False), (True, True, True))
SHAPE = (2, 1024, 8, 2)   # B, T, H, Hkv: q, k, v views of a fused QKV projection (kernel_report.launch_values)
DEBUG_ONLY = re.compile(r"^\s*(\.loc\b|\.file\b|//|\$L__(tmp|func_begin|func_end)\d+:)")


def normalized_ptx(ptx: str) -> str:
    """The PTX without debug information: what remains is the code ptxas assembles."""
    ptx = re.split(r"^\s*\.section\s+\.debug", ptx, maxsplit=1, flags=re.MULTILINE)[0]
    lines = (re.sub(r"\s*//.*$", "", line).rstrip() for line in ptx.splitlines() if not DEBUG_ONLY.match(line))
    return "\n".join(line for line in lines if line) + "\n"


def fingerprint(ptx: str) -> str:
    return hashlib.sha256(normalized_ptx(ptx).encode()).hexdigest()[:16]


def triton_configs(quick: bool) -> list[tuple[str, tuple]]:
    """(name, compile arguments) of the Triton kernels at each table's pinned default tile."""
    from kernels import tuning

    tables = {"fwd": (tuning._FWD, ("BLOCK_M", "BLOCK_N")), "q": (tuning._BWD_Q, ("BLOCK_M", "BLOCK_N")),
              "kv": (tuning._BWD_KV, ("BLOCK_M", "BLOCK_N")), "kv_dq": (tuning._BWD_KV_DQ, ("BLOCK_M", "BLOCK_N"))}
    configs = []
    for dim in QUICK_DIMS if quick else DIMS:
        block_d = max(16, 1 << (dim - 1).bit_length())
        for kernel, (table, names) in tables.items():
            tile_dim = min(d for d in table if d >= block_d)
            for causal, docs, window in QUICK_MASKS if quick else MASKS:
                default = table[tile_dim][0]
                if kernel == "kv" and causal:
                    default = tuning._BWD_KV_CAUSAL.get(tile_dim, default)
                a, b, warps, stages = default
                consts = dict(HEAD_DIM=dim, BLOCK_D=block_d, CAUSAL=causal, DOCS=docs, WINDOW=window,
                              PRECISION="tf32", **{names[0]: a, names[1]: b})
                name = f"{kernel} d={dim} causal={int(causal)} docs={int(docs)} window={int(window)}"
                configs.append((name, ("triton", kernel, consts, warps, stages, dim)))
        consts = dict(HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_M=64)   # as kernels/flash_op.py launches it
        configs.append((f"delta d={dim}", ("triton", "delta", consts, 4, 3, dim)))
        if not quick and dim in SCORE_DIMS:
            configs += score_configs(dim, block_d)
    return configs


def score_configs(dim: int, block_d: int) -> list[tuple[str, tuple]]:
    """The Triton kernels, causal without a mask at their pinned tile, with each score option of
    kernels/scores.py on (and all of them): what the options compile to."""
    from kernel_report import kernel_table, score_args
    from kernels import tuning

    configs = []
    for kernel, scores_list in SCORE_SETS.items():
        fn, table, names = kernel_table(kernel)
        tile_dim = min(d for d in table if d >= block_d)
        default = tuning._BWD_KV_CAUSAL.get(tile_dim, table[tile_dim][0]) if kernel == "kv" else table[tile_dim][0]
        a, b, warps, stages = default
        for scores in scores_list:
            consts = dict(HEAD_DIM=dim, BLOCK_D=block_d, CAUSAL=True, DOCS=False, WINDOW=False, PRECISION="tf32",
                          **{names[0]: a, names[1]: b}, **score_args(fn, scores, dim))
            configs.append((f"{kernel} d={dim} causal=1 docs=0 window=0 scores={'+'.join(scores)}",
                            ("triton", kernel, consts, warps, stages, dim)))
    return configs


def gluon_configs(quick: bool) -> list[tuple[str, tuple]]:
    from kernels import gluon
    from kernels.gluon import forward as gluon_fwd
    from kernels.lab.gluon_forward_ladder import LADDER

    configs = []
    for dim in (128,) if quick else gluon.HEAD_DIMS:
        for causal in (True,) if quick else (False, True):
            for variant in [gluon_fwd.DEFAULT_VARIANTS[dim]] if quick else LADDER:
                configs.append((f"gluon_fwd {variant} d={dim} causal={int(causal)}",
                                ("gluon_fwd", variant, dim, causal)))
            for deterministic in (True,) if quick else (False, True):
                configs.append((f"gluon_bwd d={dim} causal={int(causal)} deterministic={int(deterministic)}",
                                ("gluon_bwd", dim, causal, deterministic)))
        if not quick:   # the backward's score options: soft-capping, and dropout's regenerated mask
            for scores, softcap, dropout_p in (("softcap", 50.0, 0.0), ("dropout", 0.0, 0.1)):
                configs.append((f"gluon_bwd d={dim} causal=1 deterministic=1 scores={scores}",
                                ("gluon_bwd", dim, True, True, softcap, dropout_p)))
        configs.append((f"gluon_bwd_prep d={dim}", ("gluon_prep", dim)))
        configs.append((f"gluon_bwd_dq d={dim}", ("gluon_dq", dim)))
    return configs


def decode_configs(quick: bool) -> list[tuple[str, tuple]]:
    """The decode kernels as tests/test_kernel_compile.py compiles them."""
    if quick:
        return []
    return [("decode_split mha d=64", ("decode_split", dict(GROUP=1, HEAD_DIM=64, BLOCK_R=1, BLOCK_N=64, BLOCK_D=64,
                                                            WINDOW=False, SPLIT_N=256))),
            ("decode_split gqa d=128 window", ("decode_split", dict(GROUP=8, HEAD_DIM=128, BLOCK_R=8, BLOCK_N=16,
                                                                    BLOCK_D=128, WINDOW=True, SPLIT_N=256))),
            ("decode_merge d=64", ("decode_merge", dict(HEAD_DIM=64, BLOCK_S=32, BLOCK_D=64)))]


def configs(quick: bool = False, only: str | None = None) -> list[tuple[str, tuple]]:
    every = triton_configs(quick) + gluon_configs(quick) + decode_configs(quick)
    return [c for c in every if only is None or re.search(only, c[0])]


def _compile_decode(kernel, pointers: dict, floats: set, constexprs: dict, warps: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernel_report import score_args

    constexprs = {**score_args(kernel), **constexprs}   # the score options off
    signature = {name: "constexpr" if name in constexprs else pointers.get(name) or ("fp64" if name in floats else "i32")
                 for name in kernel.arg_names}
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def compile_config(spec: tuple):
    """The compiled kernel of one config (see `configs`)."""
    import torch

    from kernel_report import compile_for_hopper, compile_gluon_fwd, kernel_table, launch_values

    kind = spec[0]
    if kind == "triton":
        _, kernel, consts, warps, stages, dim = spec
        if kernel == "delta":
            from kernels.flash_bwd import flash_bwd_delta_kernel as fn
        else:
            fn = kernel_table(kernel)[0]
        pointers = {"dQ": "*fp32"} if kernel == "kv_dq" else None
        return compile_for_hopper(fn, consts, warps, stages, launch_values(*SHAPE, dim), pointers=pointers)
    if kind == "gluon_fwd":
        return compile_gluon_fwd(spec[1], spec[2], spec[3])
    if kind == "gluon_bwd":
        from kernels.gluon import backward as gluon_bwd

        softcap, dropout_p = spec[4:] or (0.0, 0.0)
        return gluon_bwd.compile_for_sm90(spec[1], torch.bfloat16, causal=spec[2], deterministic=spec[3],
                                          softcap=softcap, dropout_p=dropout_p)
    if kind in ("gluon_prep", "gluon_dq"):
        from kernels.gluon import backward as gluon_bwd

        return gluon_bwd.compile_aux_for_sm90(spec[1], torch.bfloat16)[kind == "gluon_dq"]
    from kernels.decode import flash_decode_merge_kernel, flash_decode_split_kernel

    if kind == "decode_split":
        pointers = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "PartO": "*fp32", "PartLse": "*fp32", "Len": "*i64"}
        return _compile_decode(flash_decode_split_kernel, pointers, {"qk_scale"}, spec[1], 4)
    return _compile_decode(flash_decode_merge_kernel, {"PartO": "*fp32", "PartLse": "*fp32", "Out": "*bf16"},
                           set(), spec[1], 1)


def _fingerprint_of(item: tuple[str, tuple], ptx_dir: str | None = None) -> tuple[str, str]:
    name, spec = item
    ptx = compile_config(spec).asm["ptx"]
    if ptx_dir:
        Path(ptx_dir, re.sub(r"[^\w.=-]+", "_", name) + ".ptx").write_text(normalized_ptx(ptx))
    return name, fingerprint(ptx)


def fingerprints(items: list[tuple[str, tuple]], jobs: int = 1, ptx_dir: str | None = None) -> dict[str, str]:
    """{config name: fingerprint}, compiled in `jobs` processes (each compile is single-threaded)."""
    if jobs <= 1:
        return dict(_fingerprint_of(item, ptx_dir) for item in items)
    with ProcessPoolExecutor(jobs) as pool:
        return dict(pool.map(_fingerprint_of, items, [ptx_dir] * len(items)))


def triton_release() -> str:
    import triton

    return "triton " + triton.__version__


def recorded(path: Path = FINGERPRINTS) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"fingerprints": {}}


def differences(current: dict[str, str], path: Path = FINGERPRINTS) -> list[str]:
    """One line per config whose fingerprint differs from (or is missing in) the recorded set of this
    Triton release; empty when every one matches."""
    release = triton_release()
    want = recorded(path)["fingerprints"].get(release)
    if want is None:
        return [f"{path.name} has no fingerprints for {release}: record them with --write"]
    return [f"{name}: {got} != recorded {want.get(name, 'nothing')}" for name, got in current.items()
            if want.get(name) != got]


def main(argv: list[str] | None = None) -> dict[str, str]:
    parser = argument_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="head dims 64 and 128, no mask or every mask, Gluon at "
                        "its defaults (what tests/test_kernel_ptx.py compiles)")
    parser.add_argument("--only", default=None, help="a regular expression: only the configs whose name matches")
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    parser.add_argument("--check", action="store_true", help=f"exit 1 unless every fingerprint matches {FINGERPRINTS.name}")
    parser.add_argument("--write", action="store_true", help=f"record this Triton's fingerprints in {FINGERPRINTS.name}")
    parser.add_argument("--ptx-dir", default=None, help="also write each config's normalised PTX there (to diff)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise ValueError("TRITON_INTERPRET=1 is set: the kernels would be interpreted, not compiled; unset it")
    if args.jobs < 1:
        raise ValueError(f"--jobs {args.jobs}: must be a positive integer")
    if args.write and (args.quick or args.only):
        raise ValueError("--write records the whole set: leave out --quick and --only")
    items = configs(args.quick, args.only)
    if not items:
        raise ValueError(f"--only {args.only!r} matches no kernel config")
    if args.ptx_dir:
        Path(args.ptx_dir).mkdir(parents=True, exist_ok=True)
    current = fingerprints(items, args.jobs, args.ptx_dir)
    for name, value in current.items():
        print(f"{value}  {name}")
    if args.write:
        data = recorded()
        data["fingerprints"][triton_release()] = current
        write_json(FINGERPRINTS, data)
    if args.check:
        wrong = differences(current)
        for line in wrong:
            print(line, file=sys.stderr)
        if wrong:
            raise SystemExit(1)
        print(f"all {len(current)} fingerprints match {FINGERPRINTS.name} ({triton_release()})")
    return current


if __name__ == "__main__":
    run_cli(main)
