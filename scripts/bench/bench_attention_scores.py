"""What attention dropout, soft-capping and sinks cost our kernels, against plain attention.

    python scripts/bench/bench_attention_scores.py --out benchmarks/attention   # H200: about 2 minutes
    python scripts/bench/bench_attention_scores.py --smoke                      # CPU plumbing check, not a benchmark
    python scripts/bench/bench_attention_scores.py --cases sinks --out DIR      # none and one case
    python scripts/bench/bench_attention_scores.py --cases dropout --tokens 1024 --batch 16 \
        --words triton,triton/gluon --out DIR                                   # another length; a backward alone

One shape: gpt2-small's heads (12 of 64) at T = 4096 with B = 4 (16K tokens a batch, as
scripts/bench/bench_attention.py --training times it), bf16, causal, q, k and v strided views of one
fused QKV projection as the model hands them over. Cases (kernels/scores.py): none; dropout 0.1;
soft-capping at 50 (Gemma 2's attention cap); sinks (one per head, drawn N(0, 1), their gradient
taken); all three. Each case runs under two kernel words: `auto`, the plan a training run gets
(each direction on the family kernels/plan.py measured faster with that option), and `triton`, both
directions on the Triton kernels (the option's own cost, the family held fixed); and beside them
`sdpa`, PyTorch's scaled_dot_product_attention left to pick its backend, for none and dropout (it has
no soft-capping or sinks): what the same option costs in the kernels a user could pick instead.
`--words` picks others: `gluon`, a forward/backward pair such as `triton/gluon`, and `flex`,
FlexAttention compiled with the cap as its score_mod, for none and softcap (CUDA only: flex has no
CPU backward; it has no dropout, and sinks are not a score_mod), and `--tokens`/`--batch` another length
(the file's name then says so). `--switches` sets code paths other than their defaults for the whole
run (SWITCHES: kernels/LOG.md, 2026-12-05); the file's name says which, so one device call can time
the same tree both ways. Forward, backward and forward+backward come from the same
forward+backward calls, CUDA events before, between and after each, in do_bench's loop (medians,
L2 flushed; scripts/_common.py, pass_timer); dropout's times include drawing its seed. "host ms" is
the host's time for one forward+backward issued to an idle GPU: where it comes within HOST_BOUND of
the GPU's forward+backward, the GPU waited on the host and the row says so. "x none" is a case's
forward+backward over none's under the same word; the targets the options were built to: dropout
0.1 <= 1.25x, soft-capping <= 1.10x, sinks <= 1.05x, under `auto`.
Results: <out>/attention_scores_<gpu>.json (with date, GPU, versions, commit) and .md.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/, for _common (which puts the repo root first)
import _common  # noqa: F401  (puts the repo root on sys.path)
import torch

from _common import (PASSES, add_out_argument, console, device_slug, environment, error_text, kernel_bench_device, pass_timer,
                     markdown_table, print_table, run_cli, tuning_note, write_json, write_text)

SHAPE = (4, 4096, 12, 12, 64)          # B, T, H, Hkv, D: gpt2-small at 4K, 16K tokens a batch
SMOKE_SHAPE = (1, 64, 2, 1, 16)
CASES = {"none": {}, "dropout": {"dropout_p": 0.1}, "softcap": {"softcap": 50.0}, "sinks": {"sinks": True},
         "all": {"dropout_p": 0.1, "softcap": 50.0, "sinks": True}}
WORDS = ("auto", "triton", "sdpa")
SDPA_CASES = ("none", "dropout")   # SDPA soft-caps nothing and has no sinks
FLEX_CASES = ("none", "softcap")   # FlexAttention: the cap is a score_mod; no dropout, and a sink is no score_mod
TARGETS = {"dropout": 1.25, "softcap": 1.10, "sinks": 1.05}   # forward+backward x none, under auto
HEADERS = ["case", "kernel", "plan", "fwd ms", "bwd ms", "fwd+bwd ms", "host ms", "x none", "target"]
HOST_BOUND = 0.8   # host ms over fwd+bwd ms from which a row is marked host-bound
SWITCHES = {"packed-dropout": "the forwards' dropout mask on P's packed pairs (kernels.scores.PACKED_DROPOUT on)",
            "unpacked-dropout": "the forwards' dropout mask as a float32 select before P's cast "
                                "(kernels.scores.PACKED_DROPOUT off)",
            "exp2-fma": "exponentials on the FMA units where kernels.exp2.CANDIDATES puts them",
            "exp2-off": "every exponential on the special-function unit (kernels.exp2.ON_FMA empty)",
            "softcap-running-max": "the soft-capped Triton forward with a running row max, not the constant "
                                   "shift (kernels.scores.SOFTCAP_FIXED_SHIFT off)"}


def set_switches(switches: list[str]) -> None:
    """Set the SWITCHES named, for every call that follows (the calls made before forgotten)."""
    from kernels import exp2, flash_op, scores

    unknown = [s for s in switches if s not in SWITCHES]
    if unknown:
        raise ValueError(f"--switches: {', '.join(unknown)} not among {', '.join(SWITCHES)}")
    for pair in (("packed-dropout", "unpacked-dropout"), ("exp2-fma", "exp2-off")):
        if set(pair) <= set(switches):
            raise ValueError(f"--switches: {pair[0]} and {pair[1]} exclude each other")
    if "packed-dropout" in switches or "unpacked-dropout" in switches:
        scores.PACKED_DROPOUT = "packed-dropout" in switches
    if "exp2-fma" in switches or "exp2-off" in switches:
        exp2.ON_FMA = dict(exp2.CANDIDATES) if "exp2-fma" in switches else {}
    if "softcap-running-max" in switches:
        scores.SOFTCAP_FIXED_SHIFT = False
    flash_op.forget_calls()


def measure(case: str, word: str, shape, dtype, device, timer) -> dict:
    """One case under one kernel word: its plan and its times, or the error that stopped it."""
    from bench_attention import fused_inputs

    from kernels.flash_op import flash_attention, kernel_plan
    from model.attention import sdpa_attention

    B, N, H, Hkv, D = shape
    row = {"case": case, "kernel": word, "status": "ok"}
    try:
        leaf, (q, k, v), dout = fused_inputs(B, N, H, Hkv, D, False, device, dtype)
        options = dict(CASES[case])
        leaves = [leaf]
        if options.pop("sinks", False):
            sinks = torch.randn(H, device=device, requires_grad=True)
            options["sinks"] = sinks
            leaves.append(sinks)

        if word == "sdpa":
            def attention():
                return sdpa_attention(q, k, v, causal=True, **options)

            row["plan"] = "PyTorch's SDPA, its own choice of backend"
        elif word == "flex":
            attention = _flex_attention(q, k, v, options.get("softcap", 0.0), device)
            row["plan"] = "FlexAttention (compiled), the cap as its score_mod" if options else "FlexAttention (compiled)"
        else:
            kernel = tuple(word.split("/")) if "/" in word else word

            def attention():
                return flash_attention(q, k, v, causal=True, kernel=kernel, **options)

            row["plan"] = str(kernel_plan(q, k, v, causal=True, kernel=kernel, **options))
        times = timer(attention, lambda out: torch.autograd.grad(out, leaves, dout), host=True)
        row.update({f"{p}_ms": times[p] for p in (*PASSES, "host")})
    except Exception as exc:  # noqa: BLE001 (one case failing must not end the run)
        row["status"] = f"error: {error_text(exc)}"
    return row


def _flex_attention(q, k, v, softcap: float, device):
    """FlexAttention on (B, N, H, D) q, k, v, causal, soft-capped as the kernels cap (c tanh(s / c) on
    the scaled scores, which is what flex hands its score_mod). Flex has no backward on a CPU."""
    from bench_attention import _flex

    if device.type != "cuda":
        raise ValueError("FlexAttention has no backward on a CPU: the flex word runs on CUDA only")

    def cap(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    flex = _flex(True, q.shape[1], device, score_mod=cap if softcap else None)
    # flex takes and returns (B, H, N, D); the output goes back to the kernels' (B, N, H, D), the
    # layout of the gradient the timer hands the backward
    return lambda: flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def ratios(results: list[dict]) -> None:
    """Each row's forward+backward over none's under the same kernel word, in place."""
    none = {r["kernel"]: r.get("fwd+bwd_ms") for r in results if r["case"] == "none"}
    for r in results:
        base = none.get(r["kernel"])
        r["x_none"] = r["fwd+bwd_ms"] / base if base and r.get("fwd+bwd_ms") else None


def host_bound(row: dict) -> bool:
    """Whether the host's time for a call came within HOST_BOUND of the GPU's: then the GPU times
    include the GPU waiting for the host."""
    host, gpu = row.get("host_ms"), row.get("fwd+bwd_ms")
    return host is not None and bool(gpu) and host >= HOST_BOUND * gpu


def rows(results: list[dict], judged: bool = True) -> list[list]:
    """Table rows; judged=False (a CPU smoke run) states the targets without judging them."""
    def ms(x):
        return f"{x:.3f}" if x is not None else "-"

    table = []
    for r in results:
        target = TARGETS.get(r["case"]) if r["kernel"] == "auto" else None
        verdict = "-" if target is None else f"<= {target:.2f}x" + (
            "" if not judged or r["x_none"] is None else f": {'met' if r['x_none'] <= target else 'missed'}")
        host = ms(r.get("host_ms")) + (" (host-bound)" if judged and host_bound(r) else "")
        table.append([r["case"], r["kernel"], r.get("plan", r["status"]), *(ms(r.get(f"{p}_ms")) for p in PASSES),
                      host, f"{r['x_none']:.3f}x" if r["x_none"] is not None else "-", verdict])
    return table


def write_outputs(stem, report: dict) -> None:
    write_json(stem.with_suffix(".json"), report)
    meta = report["metadata"]
    B, N, H, Hkv, D = report["shape"]
    failed = [f"- {r['case']} ({r['kernel']}): {r['status']}" for r in report["results"] if r["status"] != "ok"]
    text = (f"# Attention dropout, soft-capping and sinks against none ({meta['device']})\n\n"
            f"{meta['date']}, torch {meta['torch']}, triton {meta['triton']}, commit {meta['git_commit']}, "
            f"`{meta['command']}`. B = {B}, T = {N}, {H}/{Hkv} heads of {D}, {report['dtype']}, causal, q/k/v "
            f"views of a fused QKV projection; dropout 0.1, soft cap 50, a sink per head; timing: "
            f"{report['timing']}.{tuning_note(meta)} \"x none\" is the case's forward+backward over none's under "
            f"the same kernel word; the targets apply to `auto`, what a training run gets."
            + "".join(f" Switched: {SWITCHES[name]}." for name in report.get("switches", [])) + "\n\n"
            + markdown_table(HEADERS, rows(report["results"], meta["device_type"] == "cuda")) + "\n"
            + ("\nNot measured:\n" + "\n".join(failed) + "\n" if failed else ""))
    write_text(stem.with_suffix(".md"), text)


def main(argv: list[str] | None = None) -> dict:
    parser = _common.argument_parser(__doc__)
    parser.add_argument("--smoke", action="store_true", help="CPU-sized shapes that only check the plumbing")
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated cases of {', '.join(CASES)} (none, their base, always runs)")
    parser.add_argument("--words", default=",".join(WORDS),
                        help="kernel words: auto, triton, gluon, a forward/backward pair (triton/gluon), sdpa, flex")
    parser.add_argument("--tokens", type=int, default=SHAPE[1], help="T, the sequence length")
    parser.add_argument("--batch", type=int, default=SHAPE[0], help="B, the batch")
    parser.add_argument("--switches", default="", help=f"comma-separated code paths to set for the run, of {', '.join(SWITCHES)}")
    add_out_argument(parser, "bench_attention_scores")
    args = parser.parse_args(argv)
    switches = [s for s in dict.fromkeys(args.switches.split(",")) if s]
    set_switches(switches)
    words = [w for w in dict.fromkeys(args.words.split(",")) if w]
    cases = ["none"] + [c for c in dict.fromkeys(args.cases.split(",")) if c and c != "none"]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise ValueError(f"--cases: {', '.join(unknown)} not among {', '.join(CASES)}")
    device = kernel_bench_device(args.smoke)
    shape = SMOKE_SHAPE if args.smoke else (args.batch, args.tokens, *SHAPE[2:])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32   # the interpreter's bf16 is not the GPU's
    timer, timing = pass_timer(device, cpu_calls=1)
    out = console()
    length = "" if args.smoke or shape == SHAPE else f"_B{shape[0]}_T{shape[1]}"
    stem = args.out / f"attention_scores_{device_slug(device)}{length}{''.join('_' + s for s in switches)}"
    report = {"metadata": environment(device), "shape": list(shape), "dtype": str(dtype).replace("torch.", ""),
              "timing": timing, "targets": TARGETS, "switches": switches, "results": []}
    for case in cases:
        for word in words:
            if (word == "sdpa" and case not in SDPA_CASES) or (word == "flex" and case not in FLEX_CASES):
                continue
            row = measure(case, word, shape, dtype, device, timer)
            report["results"].append(row)
            ratios(report["results"])
            out.print(f"{case} ({word}): {row.get('fwd+bwd_ms', row['status'])}")
            write_outputs(stem, report)
    print_table(f"Attention dropout, soft-capping and sinks, {report['metadata']['device']}", HEADERS,
                rows(report["results"], device.type == "cuda"))
    out.print(f"wrote {stem}.json, .md")
    return report


if __name__ == "__main__":
    run_cli(main)
