"""What the attention kernels compile to on Hopper, on any machine: registers, spills and load
pipelining for every tile shape the tuner may pick.

    python scripts/kernel_dev/kernel_report.py                          # all four kernels, every candidate, D = 64 and 128
    python scripts/kernel_dev/kernel_report.py --kernels fwd,kv --dims 128 --shape 1/16384/16/16
    python scripts/kernel_dev/kernel_report.py --unspecialized          # compiled the way test_kernel_compile checks them
    python scripts/kernel_dev/kernel_report.py --gluon                  # the Gluon Hopper forward's variants instead
    python scripts/kernel_dev/kernel_report.py --gluon-bwd --dims 64    # the Gluon backward's steps, per option and tile
    python scripts/kernel_dev/kernel_report.py --scores dropout,softcap # with attention dropout and soft-capping on

Triton compiles for sm_90a without a GPU (ptxas ships in its wheel), so what ptxas says about a
kernel can be read before any device time is spent. A launch specialises its integer arguments: a
stride equal to 1 becomes a constant and multiples of 16 are marked divisible, which is what lets
the loads vectorise and pipeline through cp.async. Compiled without that (`--unspecialized`, as
Inductor's signature test does), loads stay scalar and synchronous and the register counts mislead
(kernels/LOG.md, "Registers, read the way a launch compiles"). The argument values come from
`--shape` B/T/H/Hkv: q, k, v strided views of one fused QKV projection, as the model passes them.

Per kernel, head dim and tile shape: registers per thread and spilled bytes (`ptxas -v`), the
cp.async copies and synchronous loads left in the TTGIR, and whether ptxas serialised wgmma
(warning C7515) or injected a wait for one (C7517). `--gluon-bwd` also reads the SASS (nvdisasm): the
instructions and the local-memory loads and stores (spill traffic) of each step body, the loop bodies
that run exp2 (a causal kernel has a masked and an unmasked one), with each option at 64 and 128
queries a step. Numbers depend on the Triton version: to match a GPU machine, install its version
beside this one (`pip install --target DIR triton==X`) and put DIR first on PYTHONPATH.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/, for _common (which puts the repo root first)
import _common  # noqa: F401  (puts the repo root on sys.path)

from _common import add_out_argument, print_table, run_cli, write_json

POINTERS = {"Lse": "*fp32", "Delta": "*fp32", "Docs": "*i32", "Rng": "*i64", "Sinks": "*fp32"}   # others: the input dtype
FLOATS = ("qk_scale", "sm_scale")
KERNELS = ("fwd", "q", "kv", "kv_dq")
SCORES = ("dropout", "softcap", "sinks")
SCORE_ARGS = ("Rng", "Sinks", "SOFTCAP", "DROPOUT_P")


def score_args(kernel, scores=(), head_dim: int | None = None) -> dict:
    """The constexprs of the score options (kernels/scores.py) of a Triton kernel, for `scores` (of
    SCORES) on: dropout 0.1, a soft cap of 30; what is off is a zero constexpr or a None pointer,
    which compile to the code the kernel has without the option. A pointer left out is compiled as one.
    With head_dim, the exponentials split onto the FMA units as a bf16 launch at it splits them
    (kernels/exp2.py's on_fma); without, none are."""
    import torch

    from kernels.exp2 import on_fma
    from kernels.scores import packed_mask, softcap_shift

    names = getattr(kernel, "arg_names", None) or kernel.fn.arg_names
    off = {"Rng": None, "Sinks": None, "SOFTCAP": 0.0, "DROPOUT_P": 0.0, "SHARE_DRAW": 0, "PACKED_MASK": 0,
           "EXP2_ON_FMA": 0}
    on = {"dropout": {"DROPOUT_P": 0.1, **({"SHARE_DRAW": 1, "PACKED_MASK": packed_mask(0.1, torch.bfloat16, True)}
                                           if "SHARE_DRAW" in names else {})},   # as on sm_90 (bf16)
          "softcap": {"SOFTCAP": 30.0}, "sinks": {}}
    drop = {"dropout": "Rng", "sinks": "Sinks"}
    args = {**off, **{k: v for s in scores for k, v in on[s].items()}}
    args["SHIFT"] = softcap_shift(args["SOFTCAP"], torch.bfloat16, "sinks" if "sinks" in scores else None)   # as launched
    if head_dim is not None:
        args["EXP2_ON_FMA"] = on_fma("triton", head_dim, args["SOFTCAP"], args["DROPOUT_P"], torch.bfloat16, args["SHIFT"])
    return {k: v for k, v in args.items() if k in names and k not in {drop.get(s) for s in scores}}


def kernel_table(name: str):
    """(jitted kernel, candidate table, names of its two block constexprs) of one kernel."""
    from kernels import flash_bwd, flash_fwd, tuning

    return {"fwd": (flash_fwd.flash_fwd_kernel, tuning._FWD, ("BLOCK_M", "BLOCK_N")),
            "q": (flash_bwd.flash_bwd_q_kernel, tuning._BWD_Q, ("BLOCK_M", "BLOCK_N")),
            "kv": (flash_bwd.flash_bwd_kv_kernel, tuning._BWD_KV, ("BLOCK_M", "BLOCK_N")),
            "kv_dq": (flash_bwd.flash_bwd_kv_dq_kernel, tuning._BWD_KV_DQ, ("BLOCK_M", "BLOCK_N"))}[name]


def launch_values(batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int) -> dict[str, int]:
    """The integer arguments of one call: q, k, v views of a fused (B, T, (H + 2 Hkv) D) projection,
    every other tensor contiguous (B, T, heads, D)."""
    row = (heads + 2 * kv_heads) * head_dim
    values = {}
    for t in ("q", "k", "v"):
        values.update({f"stride_{t}b": seq_len * row, f"stride_{t}n": row, f"stride_{t}h": head_dim, f"stride_{t}d": 1})
    for t, h in (("o", heads), ("do", heads), ("dq", heads), ("dk", kv_heads), ("dv", kv_heads)):
        values.update({f"stride_{t}b": seq_len * h * head_dim, f"stride_{t}n": h * head_dim,
                       f"stride_{t}h": head_dim, f"stride_{t}d": 1})
    values.update(n_heads=heads, n_kv_heads=kv_heads, kv_group=heads // kv_heads, n_q=seq_len, n_k=seq_len,
                  seq_bucket=seq_len, window=0)
    return values


def compile_for_hopper(kernel, constexprs: dict, warps: int, stages: int, values: dict | None = None,
                       dtype: str = "*bf16", pointers: dict | None = None):
    """triton.compile for sm_90a. values=None: every int an unspecialised i32 and floats fp64, the
    signature Inductor passes; otherwise specialised as a launch with those integer values is."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    while not isinstance(kernel, JITFunction):
        kernel = kernel.fn
    if not any(name in constexprs for name in SCORE_ARGS):   # the score options off, unless given
        constexprs = {**constexprs, **score_args(kernel)}
    pointers = {**POINTERS, **(pointers or {})}
    signature, consts, attrs = {}, dict(constexprs), {}
    int_args = launch_values(1, 16, 1, 1, 16).keys()
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in FLOATS:
            signature[name] = "fp64" if values is None else "fp32"
        elif name.startswith("stride_") or name in int_args:
            value = None if values is None else values.get(name)   # unknown: left unspecialised
            if value == 1:
                signature[name], consts[name] = "constexpr", 1
            else:
                signature[name] = "i32"
                if value is not None and value % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = pointers.get(name, dtype)
            if values is not None:
                attrs[(i,)] = [["tt.divisibility", 16]]   # torch allocations are 16-byte aligned
    source = ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def compile_gluon_fwd(variant: str | None, head_dim: int, causal: bool, dtype: str = "bf16", softcap: float = 0.0,
                      dropout_p: float = 0.0, sinks: bool = False, packed_mask: bool | None = None,
                      exp2_on_fma: int = 0):
    """triton.compile of the Gluon forward `variant` (a rung of kernels/lab/gluon_forward_ladder.py's
    LADDER, the production variants included; None: the default for the head dim) for sm_90a, with
    the signature its launch has: four TMA descriptors, the LSE pointer, the dropout seed and the
    sinks (None unless dropout_p and sinks ask for them), four integers and the fp32 scale.
    packed_mask: the dropout mask on P's packed pairs (None: kernels/scores.py's PACKED_DROPOUT); exp2_on_fma:
    of every 4 exponentials, how many the FMA units compute (kernels/exp2.py)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from kernels import scores
    from kernels.gluon import forward as gluon_fwd
    from kernels.lab import gluon_forward_ladder

    variant = variant or gluon_fwd.DEFAULT_VARIANTS[head_dim]
    launch = gluon_forward_ladder.variant_launch(variant, causal, head_dim)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]

    def descriptor(rows: int) -> str:
        layout = gluon_fwd.shared_layout(rows, head_dim, torch_dtype)
        return f"tensordesc<{dtype}[1,{rows},1,{head_dim}],{layout!r}>"

    signature = {"q_desc": descriptor(launch.rows), "k_desc": descriptor(gluon_fwd.BLOCK_N),
                 "v_desc": descriptor(gluon_fwd.BLOCK_N), "o_desc": descriptor(launch.rows), "lse_ptr": "*fp32",
                 "Rng": "*i64" if dropout_p else "constexpr", "Sinks": "*fp32" if sinks else "constexpr",
                 **{n: "i32" for n in ("n_heads", "kv_group", "n_q", "n_k")}, "qk_scale": "fp32"}
    consts = dict(launch.constexprs, num_warps=launch.options["num_warps"], SOFTCAP=float(softcap),
                  DROPOUT_P=float(dropout_p))
    packed = (scores.packed_mask(dropout_p, torch_dtype, True) if packed_mask is None
              else int(packed_mask and dropout_p > 0))
    consts.update(PACKED_MASK=packed, EXP2_ON_FMA=int(exp2_on_fma))
    signature.update({name: "constexpr" for name in consts})
    consts.update({name: None for name, kind in signature.items() if kind == "constexpr" and name not in consts})
    source = GluonASTSource(fn=launch.kernel, signature=signature, constexprs=consts,
                            attrs={(4,): [["tt.divisibility", 16]]})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(launch.options))


def ptxas_report(compiled) -> dict:
    """Registers, spill bytes and the wgmma-serialisation warning, from `ptxas -v` on the PTX."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path   # the assembler Triton itself uses for sm_90a
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        log = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    ttgir = compiled.asm["ttgir"]
    return {"registers": int(re.search(r"Used (\d+) registers", log).group(1)),
            "spill_bytes": int(re.search(r"(\d+) bytes spill stores", log).group(1)),
            "async_copies": ttgir.count("async_copy_global_to_local"),
            "sync_loads": ttgir.count("tt.load "),
            "wgmma_serialized": "C7515" in log, "wgmma_wait_injected": "C7517" in log}


def disassemble(compiled) -> str:
    """A compiled kernel's SASS, by the nvdisasm in Triton's wheel (no GPU needed)."""
    import triton

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run([str(nvdisasm), "-c", cubin.name], capture_output=True, text=True, check=True).stdout


def sass_loop_bodies(compiled) -> list[Counter]:
    """A kernel's SASS cut at its branch labels: per body, how many of each opcode it issues."""
    bodies = []
    for line in disassemble(compiled).splitlines():
        if re.match(r"^\s*\.L_x_\d+:", line):
            bodies.append(Counter())
        elif bodies and (op := re.search(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)):
            bodies[-1][op.group(1)] += 1
    return bodies


def sass_step_bodies(compiled, min_exp2: int = 16) -> list[dict]:
    """The loop bodies of a kernel's SASS that run at least `min_exp2` MUFU.EX2: per body its
    instructions, exp2s (a thread's scores), and LDL/STL (spill traffic)."""
    def count(body, prefix):
        return sum(n for op, n in body.items() if op.startswith(prefix))
    steps = [{"instructions": sum(body.values()), "exp2": count(body, "MUFU.EX2"), "LDL": count(body, "LDL"),
              "STL": count(body, "STL")} for body in sass_loop_bodies(compiled)]
    return [b for b in steps if b["exp2"] >= min_exp2]


def gluon_bwd_report(dims: list[int]) -> list[dict]:
    """The Gluon backward (kernels/gluon/backward.py) per head dim, causal and not, plain, with dropout
    and soft-capped, at 64 and 128 queries a step: ptxas' registers (the launch cap), spills and
    wgmma warnings, and each step body's instructions and spill traffic."""
    from kernels.checks import drawn_dropout_p
    from kernels.gluon.backward import compile_for_sm90

    options = {"plain": {}, "dropout": {"dropout_p": drawn_dropout_p(0.1)}, "softcap": {"softcap": 50.0}}
    rows = []
    for dim in dims:
        for causal in (False, True):
            for option, kw in options.items():
                for block_m in (64, 128):
                    compiled = compile_for_sm90(dim, causal=causal, config={"BLOCK_M": block_m}, **kw)
                    report = ptxas_report(compiled)
                    rows.append({"head_dim": dim, "causal": causal, "option": option, "BLOCK_M": block_m,
                                 **{k: report[k] for k in ("registers", "spill_bytes", "wgmma_serialized",
                                                            "wgmma_wait_injected")},
                                 "steps": sass_step_bodies(compiled)})
    return rows


def gluon_report(dims: list[int]) -> list[dict]:
    """Every Gluon forward variant, causal and not: ptxas' count is the launch cap (maxnreg) for the
    warp-specialised ones, whose partitions then take their own budgets (`setmaxnreg`, from the PTX)."""
    from kernels.gluon import forward as gluon_fwd
    from kernels.lab.gluon_forward_ladder import LADDER

    rows = []
    for variant in LADDER:
        for dim in dims:
            for causal in (False, True):
                compiled = compile_gluon_fwd(variant, dim, causal)
                regs = sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)",
                                                          compiled.asm["ptx"])})
                rows.append({"kernel": "gluon " + variant, "head_dim": dim, "causal": causal,
                             "default": gluon_fwd.DEFAULT_VARIANTS.get(dim) == variant,
                             "shared_bytes": compiled.metadata.shared, "setmaxnreg": regs,
                             "wgmma": compiled.asm["ptx"].count("wgmma.mma_async"), **ptxas_report(compiled)})
    return rows


def report(kernels: list[str], dims: list[int], shape: tuple[int, int, int, int], specialize: bool,
           limit: int | None, scores: tuple[str, ...] = ()) -> list[dict]:
    batch, seq_len, heads, kv_heads = shape
    rows = []
    for name in kernels:
        kernel, table, block_names = kernel_table(name)
        for dim in dims:
            values = launch_values(batch, seq_len, heads, kv_heads, dim) if specialize else None
            consts = dict(HEAD_DIM=dim, BLOCK_D=dim, CAUSAL=True, DOCS=False, WINDOW=False, PRECISION="tf32",
                          **score_args(kernel, scores, dim))
            for a, b, warps, stages in table[dim][:limit]:
                compiled = compile_for_hopper(kernel, dict(consts, **{block_names[0]: a, block_names[1]: b}),
                                              warps, stages, values, pointers={"dQ": "*fp32"} if name == "kv_dq" else None)
                rows.append({"kernel": name, "head_dim": dim, block_names[0]: a, block_names[1]: b, "warps": warps,
                             "stages": stages, **ptxas_report(compiled)})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = _common.argument_parser(__doc__)
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated, of {', '.join(KERNELS)}")
    parser.add_argument("--dims", default="64,128", help="comma-separated head dims (64, 128, 256)")
    parser.add_argument("--shape", default="1/16384/16/16", help="B/T/H/Hkv of the call whose strides specialise the launch")
    parser.add_argument("--limit", type=int, default=None, help="only the first N candidates of each list")
    parser.add_argument("--unspecialized", action="store_true", help="compile without a launch's specialisation")
    parser.add_argument("--gluon", action="store_true", help="the Gluon forward's ladder (kernels/lab/gluon_forward_ladder.py)")
    parser.add_argument("--gluon-bwd", action="store_true", help="the Gluon backward's steps, per option and tile")
    parser.add_argument("--scores", default="", help=f"comma-separated score options to compile on, of {', '.join(SCORES)} "
                        "(dropout 0.1, a soft cap of 30; kernels/scores.py)")
    parser.add_argument("--json", action="store_true", help="also write kernel_report.json under --out")
    add_out_argument(parser, "kernel_report")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise ValueError("TRITON_INTERPRET=1 is set: the kernels would be interpreted, not compiled; unset it")
    kernels = [k for k in args.kernels.split(",") if k]
    unknown = [k for k in kernels if k not in KERNELS]
    if unknown or not kernels:
        raise ValueError(f"--kernels {args.kernels!r}: choose from {', '.join(KERNELS)}")
    try:
        dims = [int(d) for d in args.dims.split(",")]
        shape = tuple(int(x) for x in args.shape.split("/"))
    except ValueError:
        raise ValueError(f"--dims {args.dims!r} / --shape {args.shape!r}: integers expected") from None
    if any(d not in (64, 128, 256) for d in dims):
        raise ValueError(f"--dims {args.dims!r}: the candidate tables hold head dims 64, 128 and 256")
    if len(shape) != 4 or min(shape) < 1 or shape[2] % shape[3]:
        raise ValueError(f"--shape {args.shape!r}: B/T/H/Hkv, positive, H a multiple of Hkv")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit {args.limit}: must be a positive integer")
    scores = tuple(s for s in args.scores.split(",") if s)
    if any(s not in SCORES for s in scores):
        raise ValueError(f"--scores {args.scores!r}: choose from {', '.join(SCORES)}")

    import triton

    if args.gluon_bwd:
        rows = gluon_bwd_report([d for d in dims if d != 256])
        print_table(f"Gluon backward, sm_90a, triton {triton.__version__} (step bodies: instructions / LDL+STL)",
                    ["D", "causal", "option", "queries a step", "registers (cap)", "spill B", "C7515", "C7517",
                     "step bodies"],
                    [[r["head_dim"], r["causal"], r["option"], r["BLOCK_M"], r["registers"], r["spill_bytes"],
                      r["wgmma_serialized"], r["wgmma_wait_injected"],
                      ", ".join(f"{b['instructions']} / {b['LDL'] + b['STL']}" for b in r["steps"])] for r in rows])
        if args.json:
            write_json(args.out / "kernel_report.json", {"triton": triton.__version__, "gluon_bwd": True, "rows": rows})
        return rows
    if args.gluon:
        rows = gluon_report([d for d in dims if d != 256])
        print_table(f"Gluon forward, sm_90a, triton {triton.__version__}",
                    ["variant", "D", "causal", "registers (cap)", "setmaxnreg", "spill B", "shared KB", "wgmma"],
                    [[r["kernel"] + (" *" if r["default"] else ""), r["head_dim"], r["causal"], r["registers"],
                      r["setmaxnreg"], r["spill_bytes"], r["shared_bytes"] // 1024, r["wgmma"]] for r in rows])
        if args.json:
            write_json(args.out / "kernel_report.json", {"triton": triton.__version__, "gluon": True, "rows": rows})
        return rows
    rows = report(kernels, dims, shape, not args.unspecialized, args.limit, scores)
    print_table(f"sm_90a, triton {triton.__version__}, {'unspecialised' if args.unspecialized else 'launch of ' + args.shape}"
                + (f", with {' and '.join(scores)}" if scores else ""),
                ["kernel", "D", "tile", "warps", "stages", "registers", "spill B", "cp.async", "sync loads", "C7515"],
                [[r["kernel"], r["head_dim"], f"{r.get('BLOCK_M')} q x {r.get('BLOCK_N')} k", r["warps"], r["stages"],
                  r["registers"], r["spill_bytes"], r["async_copies"], r["sync_loads"], r["wgmma_serialized"]] for r in rows])
    if args.json:
        write_json(args.out / "kernel_report.json", {"triton": triton.__version__, "shape": args.shape,
                                                     "specialized": not args.unspecialized, "scores": list(scores),
                                                     "rows": rows})
    return rows


if __name__ == "__main__":
    run_cli(main)
