"""How fast the special-function unit runs each form soft-capping could take it in, on an sm_90 GPU.

    python scripts/kernel_dev/mufu_probe.py --out DIR      # CUDA: values per ns of each form, and each over float32's
    python scripts/kernel_dev/mufu_probe.py --sass         # any machine: what each form compiles to for sm_90a

Soft-capping's cost on Hopper is its tanh on the special-function unit (MUFU), beside the softmax's
exp2 (kernels/LOG.md, "2026-12-07, midnight"). PTX has packed 16-bit forms, `tanh.approx.f16x2`,
`.bf16x2` and `ex2.approx.f16x2`, `.bf16x2`: two results an instruction. On sm_90 each compiles to two
16-bit MUFU operations, as many as float32 takes (LOG.md, "2026-12-07, late afternoon"), so the count
cannot say whether they are a lever; how long a 16-bit operation holds the unit can. If a packed
pair ran in the time of one float32 operation, the capped kernels' tanh would hold the unit half as
long (what that buys a step whose issue slots are nearly as busy: kernels/LOG.md, 2026-12-08, CPU).

Each form runs a dependent chain of `--iters` operations on 16 values a thread (independent chains,
enough to cover the unit's latency), over 8 programs of 4 warps an SM, timed with CUDA events
(median of 5 after a warm-up). The exponential is taken of -x, so every chain stays in (0, 1]; where
ptxas does not fold the negation into the MUFU operand it is one more instruction, whose issue slot
the MUFU time covers. `--sass` compiles every form for sm_90a on any machine and counts the loop body's
MUFU operations and other instructions (nvdisasm from Triton's wheel), into DIR/mufu_sass.json.
"""
from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/, for _common (which puts the repo root first)
import _common  # noqa: F401  (puts the repo root on sys.path)
import torch
import triton
import triton.language as tl

from _common import add_out_argument, environment, markdown_table, print_table, run_cli, write_json, write_text
from kernel_report import sass_loop_bodies

VALUES = 16   # independent chains a thread
WARPS = 4
PROGRAMS_PER_SM = 8   # 32 warps an SM, 8 a scheduler, 16 chains each: the unit's latency covered
# name -> (PTX, constraints, dtype, values an instruction)
FORMS = {
    "tanh f32": ("tanh.approx.f32 $0, $1;", "=r,r", torch.float32, 1),
    "tanh f16x2": ("tanh.approx.f16x2 $0, $1;", "=r,r", torch.float16, 2),
    "tanh bf16x2": ("tanh.approx.bf16x2 $0, $1;", "=r,r", torch.bfloat16, 2),
    "ex2 f32": ("{ .reg .f32 t; neg.f32 t, $1; ex2.approx.ftz.f32 $0, t; }", "=r,r", torch.float32, 1),
    "ex2 f16x2": ("{ .reg .b32 t; neg.f16x2 t, $1; ex2.approx.f16x2 $0, t; }", "=r,r", torch.float16, 2),
    "ex2 bf16x2": ("{ .reg .b32 t; neg.bf16x2 t, $1; ex2.approx.ftz.bf16x2 $0, t; }", "=r,r", torch.bfloat16, 2),
}


@triton.jit
def _chains(X, iters, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr, PACK: tl.constexpr, BLOCK: tl.constexpr):
    """x = op(x), iters times, on BLOCK values of X (VALUES a thread), written back so nothing is dead."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs)
    for _ in range(iters):
        x = tl.inline_asm_elementwise(ASM, CONSTRAINTS, [x], dtype=x.dtype, is_pure=True, pack=PACK)
    tl.store(X + offs, x)


def _constexprs(form: str) -> dict:
    asm, constraints, _, pack = FORMS[form]
    return dict(ASM=asm, CONSTRAINTS=constraints, PACK=pack, BLOCK=VALUES * 32 * WARPS)


def sass_counts(form: str) -> dict:
    """The loop body's MUFU operations (by opcode) and all its instructions, compiled for sm_90a."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    dtype = FORMS[form][2]
    signature = {"X": "*" + {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype],
                 "iters": "i32", **{name: "constexpr" for name in _constexprs(form)}}
    source = ASTSource(fn=_chains, signature=signature, constexprs=_constexprs(form),
                       attrs={(0,): [["tt.divisibility", 16]]})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": WARPS})
    bodies = [(body, {op: n for op, n in body.items() if op.startswith("MUFU")}) for body in sass_loop_bodies(compiled)]
    loop, mufu_ops = max(bodies, key=lambda b: sum(b[1].values()))   # the chain's loop (unrolled or not)
    mufu = sum(mufu_ops.values())
    return {"form": form, "loop instructions": sum(loop.values()),
            "MUFU": ", ".join(f"{n} {op}" for op, n in sorted(mufu_ops.items())),
            "instructions a MUFU": round(sum(loop.values()) / mufu, 2)}


def measure(form: str, iters: int, device) -> dict:
    """Values per ns of one form: VALUES a thread, PROGRAMS_PER_SM programs an SM, `iters` deep."""
    dtype = FORMS[form][2]
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    block = _constexprs(form)["BLOCK"]
    programs = sms * PROGRAMS_PER_SM
    x = torch.rand(programs * block, device=device).mul_(0.5).add_(0.25).to(dtype)
    run = lambda: _chains[(programs,)](x, iters, **_constexprs(form), num_warps=WARPS)   # noqa: E731
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e6)   # ns
    if not torch.isfinite(x.float()).all():
        raise RuntimeError(f"{form}: a chain left the finite range; the rate would time special cases")
    ns = statistics.median(times)
    return {"form": form, "ms": ns / 1e6, "values per ns": programs * block * iters / ns,
            "values per ns per SM": programs * block * iters / ns / sms}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = _common.argument_parser(__doc__)
    parser.add_argument("--sass", action="store_true", help="compile every form for sm_90a and count its SASS (no GPU)")
    parser.add_argument("--iters", type=int, default=512, help="operations in each chain (CUDA)")
    parser.add_argument("--forms", default=",".join(FORMS), help=f"comma-separated, of: {', '.join(FORMS)}")
    add_out_argument(parser, "mufu_probe")
    args = parser.parse_args(argv)
    forms = [f for f in args.forms.split(",") if f]
    unknown = [f for f in forms if f not in FORMS]
    if unknown:
        raise ValueError(f"--forms: {', '.join(unknown)} not among {', '.join(FORMS)}")
    _common.require_positive(args, "iters")
    if args.sass:
        if os.environ.get("TRITON_INTERPRET") == "1":
            raise ValueError("--sass compiles for the GPU, which Triton's interpreter replaces: unset TRITON_INTERPRET")
        rows = [sass_counts(f) for f in forms]
        print_table("sm_90a SASS of each chain's loop", list(rows[0]), [list(r.values()) for r in rows])
        write_json(args.out / "mufu_sass.json", {"rows": rows, "triton": triton.__version__})
        return rows
    if not torch.cuda.is_available():
        raise ValueError("no CUDA device: the rates need an sm_90 GPU; --sass reads the code on any machine")
    device = torch.device("cuda")
    rows = [measure(f, args.iters, device) for f in forms]
    base = {r["form"].split()[0]: r["values per ns"] for r in rows if r["form"].endswith("f32")}
    for r in rows:
        op = r["form"].split()[0]
        r["x float32"] = r["values per ns"] / base[op] if op in base else None
    headers = ["form", "ms", "values per ns", "values per ns per SM", "x float32"]
    table = [[r["form"], f"{r['ms']:.3f}", f"{r['values per ns']:.2f}", f"{r['values per ns per SM']:.4f}",
              "-" if r["x float32"] is None else f"{r['x float32']:.2f}x"] for r in rows]
    print_table("special-function unit rates", headers, table)
    env = environment(device)
    stem = args.out / f"mufu_probe_{_common.device_slug(device)}"
    write_json(stem.with_suffix(".json"), {"rows": rows, "iters": args.iters, "values_a_thread": VALUES,
                                           "warps": WARPS, "programs_per_sm": PROGRAMS_PER_SM, "environment": env})
    write_text(stem.with_suffix(".md"), f"# Special-function unit rates ({env['device']})\n\n"
               f"{env['date']}, torch {env['torch']}, triton {env['triton']}, commit {env['git_commit']}, "
               f"`{env['command']}`: {args.iters} operations a chain, {VALUES} chains a thread, "
               f"{PROGRAMS_PER_SM} programs of {WARPS} warps an SM; CUDA events, median of 5.\n\n"
               + markdown_table(headers, table) + "\n")
    return rows


if __name__ == "__main__":
    run_cli(main)
