"""One device round for the Gluon forward: every variant checked against float64, then timed beside ours
(Triton) and SDPA's cuDNN, forward only, at training shapes.

    python scripts/kernel_dev/gluon_check.py --out DIR                 # every rung of kernels/lab/gluon_forward_ladder.LADDER
    python scripts/kernel_dev/gluon_check.py --variants ws-pingpong --out DIR
    python scripts/kernel_dev/gluon_check.py --rounds r1/gluon_check.json r2/gluon_check.json --out benchmarks/gluon
                                                           # the rounds as gluon_fwd_<gpu>_rounds.{json,md}

Each variant first runs in its own process, all at once, with a time limit: a variant whose mbarrier
protocol deadlocks is killed and reported, and the others still run. That process checks the variant on
poisoned memory (NaN-filled outputs) against the float64 formula, within 2x the same-dtype formula's
error, on odd lengths, GQA, Nq != Nk, causal and not, fused-QKV strides, and launches it once at every
timing shape, so its compiled kernels are in Triton's cache. Then one process times all of them one
after another (triton.testing.do_bench median; q, k, v strided views of one fused QKV projection as the
model passes them), with the Triton forward on its pinned tile shape (FLASHTRAIN_AUTOTUNE=0).
Writes <out>/gluon_check.json; prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/, for _common (which puts the repo root first)
import _common  # noqa: F401  (puts the repo root on sys.path)
import torch

from _common import add_out_argument, environment, error_text, markdown_table, print_table, run_cli, write_json, write_text

# (B, n_q, n_k, H, H_kv, D, causal)
CASES = [
    (1, 1, 1, 1, 1, 64, True), (2, 17, 17, 4, 4, 64, False), (2, 100, 100, 8, 4, 64, True),
    (1, 257, 257, 4, 1, 128, False), (1, 257, 257, 4, 1, 128, True), (2, 1000, 1000, 8, 2, 128, True),
    (1, 500, 1500, 8, 1, 64, True), (1, 1500, 500, 8, 8, 128, True), (1, 1500, 500, 8, 8, 128, False),
]
# (H, H_kv, D, T, causal) at 16K tokens per call (B = 16384 / T)
TIMED = [(12, 12, 64, 1024, True), (16, 16, 128, 1024, True), (12, 12, 64, 4096, True), (12, 12, 64, 16384, True), (16, 16, 128, 4096, True),
         (16, 16, 128, 16384, True), (32, 8, 128, 16384, True), (16, 16, 128, 16384, False),
         (12, 12, 64, 16384, False)]
BASELINES = ("triton", "cudnn")


def fused(B, T, H, H_kv, D, dtype=torch.bfloat16):
    qkv = torch.randn(B, T, (H + 2 * H_kv) * D, device="cuda", dtype=dtype)
    return [t.unflatten(-1, (-1, D)) for t in qkv.split([H * D, H_kv * D, H_kv * D], dim=-1)]


def forward_fn(name: str, causal: bool):
    """(q, k, v) -> out for a Gluon variant or a baseline, all taking (B, N, H, D) views."""
    from kernels import flash_attention
    from kernels.lab import gluon_forward_ladder as ladder

    if name == "triton":
        return lambda q, k, v: flash_attention(q, k, v, causal=causal, kernel="triton")
    if name == "cudnn":
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      is_causal=causal, enable_gqa=q.shape[2] != k.shape[2])
        return cudnn
    return lambda q, k, v: ladder.forward(q, k, v, causal, q.shape[-1] ** -0.5, name)[0]


def check_variant(variant: str) -> dict:
    """Correctness cases (poisoned memory, float64 reference), then one launch per timing shape."""
    import torch.utils.deterministic as det

    from kernels import attention_reference
    from kernels.lab import gluon_forward_ladder as ladder

    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True   # torch.empty is NaN-filled: an unwritten element fails
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        for B, n_q, n_k, H, H_kv, D, causal in CASES + [(2, 333, 333, 12, 4, D, True) for D in (64, 128)]:
            g = torch.Generator().manual_seed(len(rows))
            if n_q == 333:   # fused QKV views
                q, k, v = fused(B, n_q, H, H_kv, D, dtype)
            else:
                q, k, v = (torch.randn(B, n, h, D, generator=g).to("cuda", dtype)
                           for n, h in ((n_q, H), (n_k, H_kv), (n_k, H_kv)))
            out, lse = ladder.forward(q, k, v, causal, D ** -0.5, variant)
            plain = attention_reference(q, k, v, causal=causal)
            ref, ref_lse = attention_reference(q.double(), k.double(), v.double(), causal=causal, return_lse=True)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            bound = 2 * ((plain.double() - ref).norm() / ref.norm()).item()
            finite = torch.isfinite(ref_lse)
            lse_err = (lse.double() - ref_lse)[finite].abs().max().item() if finite.any() else 0.0
            again = ladder.forward(q, k, v, causal, D ** -0.5, variant)
            ok = (not out.isnan().any().item() and err <= bound and lse_err <= 1e-4 * (1 + ref_lse[finite].abs().max().item())
                  and torch.equal(torch.isinf(lse), ~finite) and torch.equal(again[0], out) and torch.equal(again[1], lse))
            rows.append({"dtype": str(dtype).split(".")[-1], "shape": [B, n_q, n_k, H, H_kv, D], "causal": causal,
                         "rel_err": err, "bound": bound, "lse_abs_err": lse_err, "ok": ok})
    for H, H_kv, D, T, causal in TIMED:   # compile the timing shapes' specialisations here, in parallel
        forward_fn(variant, causal)(*fused(16384 // T, T, H, H_kv, D))
    torch.cuda.synchronize()
    return {"variant": variant, "cases": rows, "ok": all(r["ok"] for r in rows)}


def time_all(names: list[str]) -> list[dict]:
    import triton.testing

    rows = []
    for H, H_kv, D, T, causal in TIMED:
        B = 16384 // T
        q, k, v = fused(B, T, H, H_kv, D)
        flops = 4 * B * H * T * T * D / (2 if causal else 1)
        first = None
        for name in names:
            row = {"name": name, "H": H, "Hkv": H_kv, "D": D, "T": T, "B": B, "causal": causal}
            try:
                fn = forward_fn(name, causal)
                out = fn(q, k, v)
                out = (out.transpose(1, 2) if name == "cudnn" else out).float()
                first = out if first is None else first   # the others are compared with the first that ran
                row["rel_diff_vs_" + names[0]] = ((out - first).norm() / first.norm()).item()
                row["ms"] = triton.testing.do_bench(lambda: fn(q, k, v), warmup=25, rep=100, return_mode="median")
                row["tflops"] = flops / row["ms"] / 1e9
            except Exception as exc:  # noqa: BLE001 (one failing backend must not end the round)
                row["error"] = error_text(exc)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def child(args) -> None:
    """--child VARIANT or --child timing: one unit of the round, its JSON on the last line."""
    result = time_all(args.names.split(",")) if args.child == "timing" else check_variant(args.child)
    print("RESULT " + json.dumps(result), flush=True)


def run_child(what: str, names: str, timeout: float) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--child", what, "--names", names]
    env = dict(os.environ, FLASHTRAIN_AUTOTUNE="0")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    proc.deadline = time.monotonic() + timeout
    return proc


def collect(proc: subprocess.Popen, what: str) -> dict | list:
    try:
        output, _ = proc.communicate(timeout=max(1.0, proc.deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        return {"variant": what, "ok": False, "error": "timed out (a deadlock?)", "log": output[-3000:]}
    lines = [ln for ln in output.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"variant": what, "ok": False, "error": f"exit status {proc.returncode}", "log": output[-3000:]}
    return json.loads(lines[-1][len("RESULT "):])


def round_lines(number: int, report: dict) -> list[str]:
    """One round's Markdown: where it ran, each variant's correctness, forward times and ratios."""
    meta, timing = report["metadata"], report["timing"]
    lines = [f"## Round {number}: commit {meta['git_commit']}, {meta['date']}", "",
             f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, cuDNN {meta.get('cudnn')}.", "",
             markdown_table(["variant", "correct (bf16 + fp16, every case)", "worst error / 2x plain formula's"],
                            [[v, "yes" if c.get("ok") else f"no: {c.get('error', 'a case failed')}",
                              f"{max((r['rel_err'] / r['bound'] for r in c.get('cases', []) if r['bound']), default=0):.2f}"]
                             for v, c in report["checks"].items()])]
    if not isinstance(timing, list):
        return lines + [f"Timing failed: {timing.get('error')}", ""]
    names = list(dict.fromkeys(r["name"] for r in timing))
    rows = []
    for key in dict.fromkeys((r["H"], r["Hkv"], r["D"], r["T"], r["B"], r["causal"]) for r in timing):
        cells = {r["name"]: r for r in timing if (r["H"], r["Hkv"], r["D"], r["T"], r["B"], r["causal"]) == key}
        ms = {n: c["ms"] for n, c in cells.items() if "ms" in c}
        best = min((n for n in ms if n not in BASELINES), key=ms.get, default=None)
        rows.append([f"{key[0]}/{key[1]} x {key[2]}", key[3], key[4], "yes" if key[5] else "no"]
                    + [f"{ms[n]:.3f} ({cells[n]['tflops']:.0f})" if n in ms else "error" for n in names]
                    + ([best, f"{ms['cudnn'] / ms[best]:.2f}", f"{ms['triton'] / ms[best]:.2f}"]
                       if best and "cudnn" in ms and "triton" in ms else ["-", "-", "-"]))
    return lines + [markdown_table(["H/Hkv x D", "T", "B", "causal"] + names + ["fastest Gluon", "cuDNN / it", "Triton / it"],
                                   rows)]


def merge_rounds(paths: list[Path], out: Path) -> dict:
    reports = []
    for path in paths:
        try:
            reports.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as exc:
            raise ValueError(f"--rounds: cannot read {path}: {error_text(exc)}") from None
    stem = out / "gluon_fwd_h200_rounds"
    write_json(stem.with_suffix(".json"), {"rounds": reports})
    lines = ["# Gluon forward on the H200, round by round", "",
             "`python scripts/kernel_dev/gluon_check.py` per round. Forward only, bf16; milliseconds (TFLOP/s: forward "
             "4*B*H*T^2*D, halved when causal), triton.testing.do_bench median; q, k, v strided views of one fused "
             "QKV projection, 16K tokens per call. triton: our Triton forward on its pinned tile shape "
             "(FLASHTRAIN_AUTOTUNE=0); cudnn: SDPA restricted to cuDNN. Ratios > 1: the fastest Gluon variant is "
             "faster. Rounds ran on fresh machines: compare within a round, not across.", ""]
    for number, report in enumerate(reports, 1):
        lines += round_lines(number, report)
    write_text(stem.with_suffix(".md"), "\n".join(lines))
    return {"rounds": reports}


def main(argv: list[str] | None = None) -> dict:
    parser = _common.argument_parser(__doc__)
    from kernels.lab.gluon_forward_ladder import LADDER

    parser.add_argument("--variants", default=",".join(LADDER))
    parser.add_argument("--check-timeout", type=float, default=75.0, help="seconds for each variant's check")
    parser.add_argument("--timing-timeout", type=float, default=90.0)
    parser.add_argument("--rounds", nargs="+", type=Path, default=None, metavar="JSON",
                        help="merge the gluon_check.json of several rounds into gluon_fwd_h200_rounds.{json,md} in --out")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--names", default="", help=argparse.SUPPRESS)
    add_out_argument(parser, "gluon_check")
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    if args.rounds:
        return merge_rounds(args.rounds, args.out)
    if not torch.cuda.is_available():
        raise ValueError("no CUDA device: the Gluon kernels run on an sm_90 GPU only")
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in LADDER]
    if unknown:
        raise ValueError(f"--variants: unknown {', '.join(unknown)}; valid: {', '.join(LADDER)}")
    began = time.monotonic()
    procs = {v: run_child(v, "", args.check_timeout) for v in variants}
    procs["triton-warmup"] = run_child("timing", "triton", args.check_timeout)   # compiles ours meanwhile
    checks = {v: collect(p, v) for v, p in procs.items()}
    checks.pop("triton-warmup")
    passed = [v for v in variants if checks[v].get("ok")]
    timing = collect(run_child("timing", ",".join(list(BASELINES) + passed), args.timing_timeout), "timing")
    report = {"metadata": environment(torch.device("cuda")), "seconds": time.monotonic() - began,
              "checks": checks, "timing": timing}
    write_json(args.out / "gluon_check.json", report)
    print_table("Gluon forward: correctness", ["variant", "ok", "worst err / bound", "note"],
                [[v, c.get("ok"), f"{max((r['rel_err'] / max(r['bound'], 1e-12) for r in c.get('cases', [])), default=0):.2f}",
                  c.get("error", "") + " ".join(f"{r['dtype']} {r['shape']} {'causal' if r['causal'] else 'full'}"
                                                for r in c.get("cases", []) if not r["ok"])[:120]]
                 for v, c in checks.items()])
    if isinstance(timing, list):
        print_table("Forward ms (TFLOP/s)", ["H/Hkv x D", "T", "causal"] + list(BASELINES) + passed,
                    [[f"{H}/{Hk} x {D}", T, c] + [next((f"{r['ms']:.3f} ({r['tflops']:.0f})" if "ms" in r else r.get("error", "")
                                                        for r in timing if r["name"] == n and r["T"] == T and r["D"] == D
                                                        and r["H"] == H and r["causal"] == c), "-")
                                                  for n in list(BASELINES) + passed]
                     for H, Hk, D, T, c in TIMED])
    return report


if __name__ == "__main__":
    run_cli(main)
