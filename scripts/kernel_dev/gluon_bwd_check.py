"""Check, then time, the Gluon (Hopper) attention backward on the GPU: every variant, one run.

    FLASHTRAIN_AUTOTUNE=0 python scripts/kernel_dev/gluon_bwd_check.py --out DIR     # the production kernel, ~4-5 min
    python scripts/kernel_dev/gluon_bwd_check.py --out DIR --variants fa3,v1 --groups quick,warm

Variants: `fa3`, kernels/gluon/backward.py (what a kernel plan runs); `fa3-m64`, `fa3-end`, `fa3-dv`,
the same with one setting of its TILES changed (64-row query tiles; HANDOFF_AT_END; DV_EARLY);
`fa3-loop`, GQA's programs one per KV head looping over its group (what calls past SPLIT_MAX_BYTES
run; `fa3` gives each query head programs of its own); `v1`,
the earlier design kept in kernels/lab/gluon_backward_v1.py (its fastest variant).

Correctness (one subprocess per variant, all at once, each with a time limit, so that a variant
that hangs or crashes costs only itself): our Triton forward, then the Gluon backward, against
float64 attention (kernels.reference) within 2x the plain formula's own error in the same dtype
(tests/test_flash_attention.py's bound and helpers), on odd lengths, GQA, Nq != Nk, rows that see
no key, fused-QKV strides, causal and not; outputs start as NaN-poisoned memory; the
deterministic backward must give the same bits three times over; the gap to our Triton backward
is recorded. Timing (one subprocess, after the others, alone on the GPU): backward-only
milliseconds and TFLOP/s (2.5 x the forward's 4 B H N^2 D, halved when causal) at gpt2-small's
attention (12 x 64: B=16 T=1K, B=4 T=4K, B=1 T=16K) and 16 x 128 (T=4K, 16K), causal, q/k/v views
of a fused QKV projection, for each variant that passed, our Triton backward (deterministic and
atomic; FLASHTRAIN_AUTOTUNE=0 pins its tiles) and cuDNN's (SDPA through autograd: what its
backward adds to a forward+backward, _common.pass_timer). Writes DIR/gluon_bwd_check.json (date,
GPU, versions, commit) and a Markdown table, rewritten as results arrive.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/, for _common (which puts the repo root first)
import _common  # noqa: F401  (puts the repo root on sys.path)

from _common import REPO_ROOT, environment, pass_timer, write_json



def _fa3(config: dict):
    def backward(do, q, k, v, o, lse, causal, scale, deterministic):
        from kernels.gluon.backward import launch_backward
        return launch_backward(do, q, k, v, o, lse, causal, scale, deterministic, config=config)[:3]
    return backward


def _v1(do, q, k, v, o, lse, causal, scale, deterministic):
    from kernels.lab.gluon_backward_v1 import DEFAULT_VARIANT, _launch
    return _launch(do, q, k, v, o, lse, causal, scale, deterministic, **DEFAULT_VARIANT)


# name -> the backward's launch (dout, q, k, v, out, lse, causal, scale, deterministic) -> dq, dk, dv: the
# production kernel (its TILES), the same with one setting changed, and the earlier design
VARIANTS = {"fa3": _fa3({}), "fa3-m64": _fa3(dict(BLOCK_M=64)), "fa3-end": _fa3(dict(HANDOFF_AT_END=True)),
            "fa3-dv": _fa3(dict(DV_EARLY=True)), "fa3-loop": _fa3(dict(SPLIT_GROUP=False)), "v1": _v1}


# (B, Nq, Nk, H, Hkv, D)
SHAPES = [
    (1, 1, 1, 1, 1, 64),
    (2, 17, 17, 4, 4, 64),
    (2, 100, 100, 8, 4, 64),
    (1, 257, 257, 4, 1, 128),
    (2, 1000, 1000, 8, 2, 128),
    (1, 500, 1500, 8, 1, 64),      # Nq < Nk
    (1, 1500, 500, 8, 8, 128),     # Nq > Nk: causal rows that see no key
    (1, 300, 40, 2, 1, 64),        # whole query tiles that see no key
    (4, 2048, 2048, 12, 12, 64),   # several waves of programs
]
BIG = (1, 4096, 4096, 16, 2, 128)
GROUPS = ("shapes", "quick", "strides", "big", "warm")
QUICK = [SHAPES[2], SHAPES[3], SHAPES[6], SHAPES[7], SHAPES[8]]   # GQA, ragged, Nq > Nk, empty tiles, waves
# (B, T, H, Hkv, D, causal): gpt2-small's heads, 16 x 128, GQA 32/8 x 128, and non-causal cells
TIMING = [(16, 1024, 12, 12, 64, True), (4, 4096, 12, 12, 64, True), (1, 16384, 12, 12, 64, True),
          (16, 1024, 16, 16, 128, True), (4, 4096, 16, 16, 128, True), (1, 16384, 16, 16, 128, True),
          (4, 4096, 32, 8, 128, True), (1, 16384, 32, 8, 128, True), (4, 4096, 12, 12, 64, False),
          (1, 16384, 16, 16, 128, False)]


def tflops(B, H, N, D, ms, causal=True):
    return 2.5 * 4 * B * H * N * N * D / (2 if causal else 1) / (ms * 1e-3) / 1e12


# ---- correctness ----------------------------------------------------------------------------

def correctness(variant: str, out: Path, groups: list[str]) -> dict:
    import torch
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    sys.path.insert(0, str(REPO_ROOT / "scripts" / "bench"))
    import torch.utils.deterministic as det
    from test_flash_attention import assert_as_exact_as_plain, make_inputs, NAMES
    from bench_attention import fused_inputs

    from kernels import attention_reference
    from kernels.flash_op import _triton_backward as _launch_backward, _triton_forward as _launch_forward

    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True   # torch.empty returns NaN: an unwritten element fails
    backward = VARIANTS[variant]
    result = {"variant": variant, "cases": []}
    path = out / f"correct_{variant}.json"

    def grads(q, k, v, do, causal, deterministic):
        scale = 1 / math.sqrt(q.shape[-1])
        o, lse = _launch_forward(q, k, v, causal, scale)
        return (o, lse) + backward(do, q, k, v, o, lse, causal, scale, deterministic)

    def reference(q, k, v, do, causal):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o, lse = attention_reference(*leaves, causal=causal, return_lse=True)
        return (o, lse) + torch.autograd.grad(o, leaves, do)

    def case(tag, q, k, v, do, causal, deterministic):
        row = {"case": tag, "causal": causal, "deterministic": deterministic, "dtype": str(q.dtype)}
        t0 = time.time()
        try:
            ours = grads(q, k, v, do, causal, deterministic)
            torch.cuda.synchronize()
            plain = reference(q, k, v, do, causal)
            exact = reference(*(t.double() for t in (q, k, v, do)), causal)
            errs = {}
            for name, mine, p, ref in zip(NAMES, ours, plain, exact):
                if name in ("dq", "dk", "dv"):
                    errs[name] = [((mine.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item(),
                                  ((p.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()]
                assert_as_exact_as_plain(name, mine, p, ref, do, v)
            row["rel_err_ours_plain"] = errs
            if deterministic:
                for _ in range(5):
                    again = grads(q, k, v, do, causal, deterministic)
                    assert all(torch.equal(a, b) for a, b in zip(ours[2:], again[2:])), "not bit-identical on repeat"
                tri = _launch_backward(do, q, k, v, ours[0], ours[1], causal, 1 / math.sqrt(q.shape[-1]))[:3]
                row["rel_diff_vs_triton"] = {n: ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
                                             for n, a, b in zip(("dq", "dk", "dv"), ours[2:], tri)}
            row["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 (record and go on)
            row["status"] = f"FAIL {type(exc).__name__}: {str(exc)[:300]}"
        row["s"] = round(time.time() - t0, 2)
        result["cases"].append(row)
        write_json(path, result)
        print(variant, row["case"], row["causal"], row["deterministic"], row["dtype"], row["status"], flush=True)

    if "shapes" in groups:
        for shape in SHAPES:
            for causal in (True, False):
                inputs = make_inputs(*shape, torch.bfloat16)
                case(f"{shape}", *inputs, causal, True)
                if shape in (SHAPES[2], SHAPES[6], SHAPES[8]):
                    case(f"{shape}", *inputs, causal, False)
            if shape in (SHAPES[3], SHAPES[5]):
                case(f"{shape}", *make_inputs(*shape, torch.float16), True, True)
    if "quick" in groups:
        for shape in QUICK:
            for causal in (True, False):
                case(f"{shape}", *make_inputs(*shape, torch.bfloat16), causal, True)
        case(f"{SHAPES[8]}", *make_inputs(*SHAPES[8], torch.bfloat16), True, False)
    if "strides" in groups:   # q, k, v as views of one fused QKV projection (what the model passes)
        for B, N, H, D in ((2, 37, 4, 64), (2, 1000, 12, 64), (1, 777, 4, 128)):
            qkv = torch.randn(B, N, 3, H, D, device="cuda").to(torch.bfloat16)
            q, k, v = qkv.unbind(2)
            do = torch.randn(B, N, H, D, device="cuda").to(torch.bfloat16)
            case(f"fused_qkv {(B, N, H, D)}", q, k, v, do, True, True)
    if "big" in groups:
        for causal in (True, False):
            case(f"{BIG}", *make_inputs(*BIG, torch.bfloat16), causal, True)
    if "warm" in groups:   # compile what the timing run launches (one small call per head dim)
        for D in sorted({t[4] for t in TIMING}):
            _, (q, k, v), do = fused_inputs(1, 256, 2, 2, D, False, torch.device("cuda"))
            case(f"warm D={D}", *(t.detach() for t in (q, k, v)), do, True, True)
            case(f"warm D={D}", *(t.detach() for t in (q, k, v)), do, True, False)
    result["passed"] = all(c["status"] == "ok" for c in result["cases"])
    write_json(path, result)
    return result


# ---- timing ---------------------------------------------------------------------------------

def cudnn_backward_ms(q, k, v, do, causal=True, warm=False):
    """Milliseconds cuDNN's backward (SDPA forced to CUDNN_ATTENTION, through autograd) adds to its
    forward+backward (_common.pass_timer): timed alone on a retained graph it would start on an idle
    GPU with all of autograd's host work on the clock, which our direct launches do not carry."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [t.transpose(1, 2).detach().clone().requires_grad_() for t in (q, k, v)]
    dout = do.transpose(1, 2)

    def forward():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=q.shape[2] != k.shape[2])

    def backward(out):
        torch.autograd.grad(out, leaves, dout)

    if warm:   # one call compiles
        return lambda: backward(forward())
    timed, _ = pass_timer(q.device)
    return lambda: timed(forward, backward)["bwd"]


def timing(variants: list[str], out: Path, warm: bool = False) -> dict:
    import torch
    import triton
    sys.path.insert(0, str(REPO_ROOT / "scripts" / "bench"))
    from bench_attention import fused_inputs

    from kernels.flash_op import _triton_backward as _launch_backward, _triton_forward as _launch_forward

    bench = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")  # noqa: E731
    result = {"env": environment(torch.device("cuda")), "rows": []}
    path = out / ("warm_triton.json" if warm else "timing.json")
    for B, N, H, Hkv, D, causal in (sorted({(1, 256, 2, 2, t[4], True) for t in TIMING}) if warm else TIMING):
        row = {"B": B, "T": N, "H": H, "Hkv": Hkv, "D": D, "causal": causal, "ms": {}, "tflops": {}}
        _, (q, k, v), do = fused_inputs(B, N, H, Hkv, D, False, torch.device("cuda"))
        q, k, v = (t.detach() for t in (q, k, v))
        scale = 1 / math.sqrt(D)
        o, lse = _launch_forward(q, k, v, causal, scale)
        runs = {"triton": lambda: _launch_backward(do, q, k, v, o, lse, causal, scale, deterministic=True),
                "triton-atomic": lambda: _launch_backward(do, q, k, v, o, lse, causal, scale, deterministic=False),
                "cudnn": cudnn_backward_ms(q, k, v, do, causal, warm)}   # times itself
        if warm:
            bench = lambda fn: fn()  # noqa: E731  (one call compiles)
        runs.update({f"gluon-{name}": (lambda f=VARIANTS[name]: f(do, q, k, v, o, lse, causal, scale, True))
                     for name in variants})
        for name in variants:   # the atomic (deterministic=False) order of every variant
            runs[f"gluon-{name}-atomic"] = (lambda f=VARIANTS[name]: f(do, q, k, v, o, lse, causal, scale, False))
        result["rows"].append(row)
        for name, fn in runs.items():   # baselines first: a variant that hangs cannot take them along
            try:
                row["ms"][name] = fn() if name == "cudnn" else bench(fn)
            except Exception as exc:  # noqa: BLE001
                row["ms"][name] = f"FAIL {type(exc).__name__}: {str(exc)[:200]}"
            print("   ", name, row["ms"][name], flush=True)
            write_json(path, result)
        for name, ms in row["ms"].items():
            if isinstance(ms, float):
                row["tflops"][name] = round(tflops(B, H, N, D, ms, causal), 1)
        write_json(path, result)
        print(B, N, H, Hkv, D, causal, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row["ms"].items()},
              flush=True)
        del q, k, v, do, o, lse
        torch.cuda.empty_cache()
    return result


# ---- driver ---------------------------------------------------------------------------------

def run_workers(commands: dict[str, list[str]], limit_s: float, out: Path) -> dict[str, str]:
    """Start every command at once; kill any still running after limit_s. name -> exit status."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = {name: subprocess.Popen(cmd, stdout=open(out / f"{name}.log", "w"), stderr=subprocess.STDOUT, env=env)
             for name, cmd in commands.items()}
    began, status = time.time(), {}
    while procs:
        for name, p in list(procs.items()):
            if p.poll() is not None:
                status[name] = f"exit {p.returncode}"
                del procs[name]
            elif time.time() - began > limit_s:
                p.kill()
                p.wait()
                status[name] = f"killed after {limit_s:.0f} s"
                del procs[name]
        time.sleep(0.5)
    return status


def main(argv=None):
    parser = _common.argument_parser(__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", default="fa3", help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--worker", choices=("correct", "time"), help=argparse.SUPPRESS)
    parser.add_argument("--groups", default=",".join(GROUPS), help=f"correctness groups, of {', '.join(GROUPS)}")
    parser.add_argument("--warm-triton", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--correct-limit", type=float, default=300.0, help="seconds per correctness worker")
    parser.add_argument("--time-limit", type=float, default=120.0, help="seconds for the timing worker")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants {args.variants!r}: choose from {', '.join(VARIANTS)}")
    groups = [g for g in args.groups.split(",") if g]
    if any(g not in GROUPS for g in groups):
        raise SystemExit(f"--groups {args.groups!r}: choose from {', '.join(GROUPS)}")
    if args.worker == "correct":
        correctness(variants[0], args.out, groups)
        return
    if args.worker == "time":
        timing([] if args.warm_triton else variants, args.out, warm=args.warm_triton)
        return
    me = [sys.executable, str(Path(__file__).resolve())]
    work = args.out / "work"   # the workers' files; folded into one JSON at the end
    work.mkdir(exist_ok=True)
    commands = {f"correct_{v}": me + ["--worker", "correct", "--variants", v, "--groups", args.groups,
                                      "--out", str(work)] for v in variants}
    if not args.skip_timing:   # compile our Triton kernels for the timing shapes meanwhile
        commands["warm_triton"] = me + ["--worker", "time", "--warm-triton", "--out", str(work)]
    status = run_workers(commands, args.correct_limit, work)
    summary = {"env": None, "worker_status": status, "correctness": {}, "passed": []}
    for v in variants:
        path = work / f"correct_{v}.json"
        report = json.loads(path.read_text()) if path.exists() else {"cases": []}
        summary["correctness"][v] = report
        fails = [c for c in report["cases"] if c["status"] != "ok"]
        print(f"{v}: {status[f'correct_{v}']}, {len(report['cases'])} cases, {len(fails)} failed", flush=True)
        for c in fails[:4]:
            print("   ", c["case"], c["causal"], c["deterministic"], c["dtype"], c["status"][:160], flush=True)
        if report.get("passed"):
            summary["passed"].append(v)
    if not args.skip_timing and summary["passed"]:
        summary["timing_status"] = run_workers({"time": me + ["--worker", "time", "--variants", ",".join(summary["passed"]),
                                                              "--out", str(work)]}, args.time_limit, work)
        if (work / "timing.json").exists():
            timed = json.loads((work / "timing.json").read_text())
            summary["env"], summary["timing"] = timed["env"], timed["rows"]
    write_json(args.out / "gluon_bwd_check.json", summary)
    for row in summary.get("timing", []):
        print(row["B"], row["T"], row["H"], row["Hkv"], row["D"], row["causal"], {k: (round(x, 3) if isinstance(x, float) else x)
                                                       for k, x in row["ms"].items()}, flush=True)
    shutil.rmtree(work)


if __name__ == "__main__":
    _common.run_cli(main)
