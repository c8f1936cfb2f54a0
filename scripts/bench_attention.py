"""Attention speed and memory: our Triton FlashAttention against SDPA (FA2, cuDNN), FlexAttention, naive.

    python scripts/bench_attention.py            # full sweep: an estimated 5-7 minutes on an H200,
                                                 # half of it compiling FlexAttention for each shape
    python scripts/bench_attention.py --quick    # two lengths, memory up to 32K (1-2 minutes)
    python scripts/bench_attention.py --long     # gpt2-small's heads, batch 1, N up to 256K
    python scripts/bench_attention.py --smoke    # CPU-sized plumbing check (not a benchmark)

Throughput: forward, backward and forward+backward TFLOP/s for head dims 64 and 128, sequence
lengths 1K-32K at 16K tokens per batch (B = 16384 / N; one sequence of 32K) and hidden size 2048
(H = 2048 / D), causal and not, bf16. FLOPs: forward 4*B*H*N^2*D, halved when causal; backward
2.5x forward (five matmuls of the same size instead of two); forward+backward 3.5x. Each
backend is timed in its own layout (ours and naive take (B, N, H, D), SDPA and Flex (B, H, N, D);
the transposes happen before timing) with triton.testing.do_bench (median; warm-up excluded,
L2 flushed between runs), on fresh random normal inputs. Backward is timed as
torch.autograd.grad over a retained graph, so it excludes the forward.

Memory: peak allocated memory of one forward+backward at B=1, H=16, D=128, causal, against N, for
ours and naive (naive until it runs out of memory).

A backend that cannot run here (our kernel not importable, a SDPA backend this GPU or build lacks)
is reported as unavailable, never replaced by another. One failing measurement (out of memory, an
unsupported shape) is recorded as such and the sweep goes on. Results are rewritten after each
shape: <out>/attention_<gpu>.json (with metadata), .md (tables) and two PNGs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import _common  # noqa: F401  (puts the repo root on sys.path)
import torch
import torch.nn.functional as F

from _common import (REPO_ROOT, console, device_slug, draw_safely, environment, error_text, human_bytes,
                     markdown_table, memory_unit, new_figure, plain_log_axis, print_table, run_cli,
                     save_figure, tokens_axis, tokens_label, tuning_note, write_json, write_text)
from _memory import is_oom, peak_meter, release_memory

TOKENS, HIDDEN = 16384, 2048
WARMUP_MS, REP_MS = 25, 100

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Unavailable(Exception):
    """This backend cannot run in this environment (the reason is shown in the results)."""


@dataclass(frozen=True)
class Sweep:
    head_dims: tuple[int, ...]
    lengths: tuple[int, ...]
    tokens: int                    # B * N for the throughput sweep (B is at least 1)
    hidden: int                    # H * D
    memory_lengths: tuple[int, ...]
    memory_shape: tuple[int, int, int]   # B, H, D of the memory sweep
    naive_max_len: int             # naive's N^2 scores do not fit beyond (throughput sweep)


SWEEPS = {
    "full": Sweep((64, 128), (1024, 2048, 4096, 8192, 16384, 32768), TOKENS, HIDDEN,
                  tuple(1024 << i for i in range(8)), (1, 16, 128), 16384),
    "quick": Sweep((64, 128), (4096, 16384), TOKENS, HIDDEN,
                   (1024, 4096, 16384, 32768), (1, 16, 128), 16384),
    "smoke": Sweep((32, 64), (128, 512), 256, 128, (64, 128, 256), (1, 2, 32), 512),
    # gpt2-small's attention (12 heads of 64) at one sequence per batch, up to 256K tokens:
    # the rates behind a million-token training step (benchmarks/max_context_h200.md)
    "long": Sweep((64,), (16384, 65536, 131072, 262144), 1, 768, (), (1, 12, 64), 16384),
}


# ----------------------------------------------------------------------------- backends

def _ours(causal: bool, seq_len: int, device: torch.device) -> Attention:
    try:
        from kernels import flash_attention
    except ImportError as exc:
        raise Unavailable(f"kernels.flash_attention not importable ({exc})") from exc
    return lambda q, k, v: flash_attention(q, k, v, causal=causal)


def _sdpa(backend_name: str):
    def make(causal: bool, seq_len: int, device: torch.device) -> Attention:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)

        def attention(q, k, v):
            with sdpa_kernel(backend):  # a few microseconds per call, hidden behind the GPU's queue
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return attention
    return make


def _flex(causal: bool, seq_len: int, device: torch.device) -> Attention:
    import torch._dynamo
    import torch._functorch.config
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # Fresh compile caches per shape: dynamo's recompile limit would otherwise drop to eager after
    # a handful of shapes. Donated buffers forbid the retained graph that times backward alone.
    torch._dynamo.reset()
    torch._functorch.config.donated_buffer = False
    mask = (create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, seq_len, seq_len,
                              device=device) if causal else None)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, block_mask=mask)


def _naive(causal: bool, seq_len: int, device: torch.device) -> Attention:
    from kernels.reference import attention_reference
    return lambda q, k, v: attention_reference(q, k, v, causal=causal)


@dataclass(frozen=True)
class Backend:
    label: str
    heads_first: bool   # takes (B, H, N, D) rather than (B, N, H, D)
    make: Callable[[bool, int, torch.device], Attention]   # raises Unavailable


BACKENDS = {
    "ours": Backend("ours (Triton)", False, _ours),
    "sdpa-flash": Backend("SDPA flash (FA2)", True, _sdpa("FLASH_ATTENTION")),
    "sdpa-cudnn": Backend("SDPA cuDNN", True, _sdpa("CUDNN_ATTENTION")),
    "flex": Backend("FlexAttention (compiled)", True, _flex),
    "naive": Backend("naive PyTorch", False, _naive),
}
MEMORY_BACKENDS = ("ours", "naive")
PASSES = ("fwd", "bwd", "fwd+bwd")


# ----------------------------------------------------------------------------- measuring

def attention_flops(batch: int, heads: int, seq_len: int, head_dim: int, causal: bool) -> dict[str, float]:
    """FLOPs of each pass: forward 4*B*H*N^2*D (halved when causal), backward 2.5x, both 3.5x."""
    forward = 4 * batch * heads * seq_len**2 * head_dim / (2 if causal else 1)
    return {"fwd": forward, "bwd": 2.5 * forward, "fwd+bwd": 3.5 * forward}


def timer(device: torch.device) -> tuple[Callable[[Callable], float], str]:
    """Milliseconds per call: triton's do_bench median on CUDA; on the CPU a plain median of three."""
    if device.type == "cuda":
        import triton.testing

        return (lambda fn: triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median"),
                f"triton.testing.do_bench median, warmup {WARMUP_MS} ms, rep {REP_MS} ms")

    def cpu_median(fn) -> float:
        fn()
        times = []
        for _ in range(3):
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
        return statistics.median(times)
    return cpu_median, "time.perf_counter median of 3 after 1 warm-up (CPU smoke run, not a benchmark)"


def random_inputs(shape: tuple[int, int, int, int], heads_first: bool, device: torch.device):
    """q, k, v (leaves needing grad) and dout, standard normal bf16, in the backend's own layout."""
    B, N, H, D = shape
    tensors = [torch.randn(B, N, H, D, device=device, dtype=torch.bfloat16) for _ in range(4)]
    if heads_first:
        tensors = [t.transpose(1, 2).contiguous() for t in tensors]
    q, k, v, dout = tensors
    return [t.requires_grad_() for t in (q, k, v)], dout


def time_passes(name: str, shape, causal: bool, device, bench) -> dict[str, float]:
    """Milliseconds of forward, backward (on a retained graph) and the two together."""
    backend = BACKENDS[name]
    attention = backend.make(causal, shape[1], device)
    inputs, dout = random_inputs(shape, backend.heads_first, device)
    out = attention(*inputs)
    times = {"fwd": bench(lambda: attention(*inputs)),
             "bwd": bench(lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True))}
    del out
    times["fwd+bwd"] = bench(lambda: torch.autograd.grad(attention(*inputs), inputs, dout))
    return times


def peak_of_step(name: str, shape, device) -> tuple[int, int]:
    """(peak bytes, input bytes) of one causal forward+backward; inputs are q, k, v and dout."""
    backend = BACKENDS[name]
    attention = backend.make(True, shape[1], device)
    inputs, dout = random_inputs(shape, backend.heads_first, device)
    input_bytes = 4 * dout.numel() * dout.element_size()
    torch.autograd.grad(attention(*inputs), inputs, dout)  # compile and autotune outside the measured step
    release_memory(device)
    with peak_meter(device, baseline=input_bytes) as meter:
        torch.autograd.grad(attention(*inputs), inputs, dout)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return meter.peak, input_bytes


def base_row(name: str, shape, causal: bool, status: str = "ok") -> dict:
    B, N, H, D = shape
    return {"backend": name, "D": D, "N": N, "B": B, "H": H, "causal": causal, "status": status}


def failure(exc: Exception) -> str:
    return "out of memory" if is_oom(exc) else f"error: {error_text(exc)}"


def measure_throughput(name: str, shape, causal: bool, device, bench) -> dict:
    row = base_row(name, shape, causal)
    try:
        times = time_passes(name, shape, causal, device, bench)
    except Exception as exc:  # noqa: BLE001 (one shape failing must not end the sweep)
        row["status"] = failure(exc)
    release_memory(device)  # after the measurement's frames (and the exception's) are gone
    if row["status"] == "ok":
        flops = attention_flops(row["B"], row["H"], row["N"], row["D"], causal)
        for p in PASSES:
            row[f"{p}_ms"] = times[p]
            row[f"{p}_tflops"] = flops[p] / (times[p] * 1e-3) / 1e12
    return row


def measure_memory(name: str, shape, device) -> dict:
    row = base_row(name, shape, causal=True)
    try:
        row["peak_bytes"], row["input_bytes"] = peak_of_step(name, shape, device)
    except Exception as exc:  # noqa: BLE001
        row["status"] = failure(exc)
    release_memory(device)
    return row


def not_measured(name: str, seq_len: int, runnable: list[str], sweep: Sweep) -> str | None:
    """Why a backend is left out at this length (None: it is measured)."""
    if name not in runnable:
        return "unavailable"
    if name == "naive" and seq_len > sweep.naive_max_len:
        return f"skipped: N > {sweep.naive_max_len}, the N^2 scores do not fit"
    return None


def check_available(name: str, head_dim: int, device) -> str:
    """'available', or 'unavailable: <why>' when a tiny forward cannot run here at all."""
    try:
        backend = BACKENDS[name]
        inputs, _ = random_inputs((1, 128, 2, head_dim), backend.heads_first, device)
        backend.make(False, 128, device)(*inputs)
        return "available"
    except Exception as exc:  # noqa: BLE001 (whatever stops it, the reason is reported)
        return f"unavailable: {error_text(exc)}"
    finally:
        release_memory(device)


# ----------------------------------------------------------------------------- reporting

def throughput_rows(report: dict) -> list[list]:
    """One row per measurement: TFLOP/s of each pass and how many times faster ours is."""
    ours = {(r["D"], r["causal"], r["N"]): r for r in report["throughput"]
            if r["backend"] == "ours" and r["status"] == "ok"}
    rows = []
    for r in report["throughput"]:
        mine = ours.get((r["D"], r["causal"], r["N"]))
        if r["status"] != "ok":
            rows.append([r["D"], "yes" if r["causal"] else "no", r["N"], r["backend"], r["status"],
                         "", "", "", "", ""])
            continue
        tflops = [f"{r[p + '_tflops']:.4g}" for p in PASSES]
        ratios = [f"{mine[p + '_tflops'] / r[p + '_tflops']:.2f}" if mine and r["backend"] != "ours" else "-"
                  for p in PASSES]
        rows.append([r["D"], "yes" if r["causal"] else "no", r["N"], r["backend"], *tflops, *ratios])
    return rows


THROUGHPUT_HEADERS = ["D", "causal", "N", "backend", "fwd TFLOP/s", "bwd TFLOP/s", "fwd+bwd TFLOP/s",
                      "ours/this fwd", "ours/this bwd", "ours/this fwd+bwd"]
MEMORY_HEADERS = ["N", "backend", "peak memory", "beyond inputs", "status"]


def memory_rows(report: dict) -> list[list]:
    return [[r["N"], r["backend"], human_bytes(r.get("peak_bytes")),
             human_bytes(r["peak_bytes"] - r["input_bytes"]) if "peak_bytes" in r else "-", r["status"]]
            for r in report["memory"]]


def batch_note(tokens: int) -> str:
    return "batch 1" if tokens == 1 else f"B*N = {tokens:,} tokens (B at least 1)"


def write_outputs(stem: Path, report: dict) -> None:
    write_json(stem.with_suffix(".json"), report)
    meta, sweep = report["metadata"], report["settings"]
    mem_b, mem_h, mem_d = sweep["memory_shape"]
    lines = [f"# Attention benchmark: {meta['device']}", "",
             f"{meta['date']}, torch {meta['torch']}, triton {meta['triton']}, commit {meta['git_commit']}. "
             f"bf16; {batch_note(sweep['tokens'])}, H*D = {sweep['hidden']}. "
             "FLOPs: forward 4*B*H*N^2*D (halved when causal), backward 2.5x forward, forward+backward 3.5x. "
             f"Timer: {sweep['timer']}. 'ours/this' > 1 means ours is faster.{tuning_note(meta)}", ""]
    lines += [f"- {name}: {info['label']}, {info['status']}" for name, info in report["backends"].items()]
    lines += ["", "## Throughput", "", markdown_table(THROUGHPUT_HEADERS, throughput_rows(report))]
    if sweep["memory_lengths"]:
        lines += [f"## Peak memory of one causal forward+backward (B={mem_b}, H={mem_h}, D={mem_d})", "",
                  markdown_table(MEMORY_HEADERS, memory_rows(report))]
    write_text(stem.with_suffix(".md"), "\n".join(lines))


def plot(stem: Path, report: dict) -> None:
    """<stem>_tflops.png: TFLOP/s against N, one panel per pass x (D, causal); <stem>_memory.png."""
    panels = sorted({(r["D"], r["causal"]) for r in report["throughput"]})
    fig, axes = new_figure(len(PASSES), len(panels), figsize=(4.2 * len(panels), 3.4 * len(PASSES)),
                           sharex=True, sharey="row")
    for row, p in enumerate(PASSES):
        for col, (D, causal) in enumerate(panels):
            ax = axes[row][col]
            for name, info in report["backends"].items():
                points = sorted((r["N"], r[f"{p}_tflops"]) for r in report["throughput"]
                                if r["backend"] == name and r["D"] == D and r["causal"] == causal
                                and r["status"] == "ok")
                if points:
                    ax.plot(*zip(*points), marker="o", label=info["label"])
            tokens_axis(ax, "x")
            ax.set(title=f"{p}, D={D}, {'causal' if causal else 'non-causal'}")
            ax.grid(True, alpha=0.3)
            if col == 0:
                ax.set_ylabel("TFLOP/s")
            if row == len(PASSES) - 1:
                ax.set_xlabel("sequence length N (B = tokens / N)")
    for ax in axes.flat:  # once every panel of the (shared) row has its data
        ax.set_ylim(bottom=0)
    lines = {line.get_label(): line for ax in axes.flat for line in ax.lines}
    if lines:
        fig.legend(lines.values(), lines.keys(), loc="upper right", fontsize=8)
    fig.suptitle(f"Attention throughput, bf16, {report['metadata']['device']}")
    save_figure(fig, stem.with_name(stem.name + "_tflops.png"))
    if not report["memory"]:  # a sweep without a memory part (--long)
        return

    fig, axes = new_figure(1, 1, figsize=(6, 4.5))
    ax = axes[0][0]
    measured = [r for r in report["memory"] if "peak_bytes" in r]
    scale, unit = memory_unit([r["peak_bytes"] for r in measured])
    for name in MEMORY_BACKENDS:
        points = sorted((r["N"], r["peak_bytes"] / scale) for r in measured if r["backend"] == name)
        if not points:
            continue
        line, = ax.plot(*zip(*points), marker="o", label=report["backends"][name]["label"])
        failed = [r for r in report["memory"] if r["backend"] == name and "peak_bytes" not in r]
        if failed:  # the sweep stops at a backend's first failure: say where
            ax.annotate(f"{failed[0]['status']} at {tokens_label(failed[0]['N'])}", points[-1],
                        textcoords="offset points", xytext=(6, -4), fontsize=8, color=line.get_color())
    tokens_axis(ax, "x")
    plain_log_axis(ax, "y")
    B, H, D = report["settings"]["memory_shape"]
    ax.set(xlabel="sequence length N", ylabel=f"peak memory ({unit})",
           title=f"one causal forward+backward, B={B}, H={H}, D={D}")
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
        ax.legend()
    save_figure(fig, stem.with_name(stem.name + "_memory.png"))


def print_shape(out, rows: list[dict]) -> None:
    """One line per backend: its TFLOP/s per pass and, for the others, ours divided by theirs."""
    ours = next((r for r in rows if r["backend"] == "ours" and r["status"] == "ok"), None)
    for r in rows:
        line = r["status"]
        if r["status"] == "ok":
            line = "  ".join(f"{p} {r[p + '_tflops']:.4g}" for p in PASSES) + " TFLOP/s"
            if ours and r is not ours:
                line += "   ours/this " + "  ".join(f"{ours[p + '_tflops'] / r[p + '_tflops']:.2f}"
                                                 for p in PASSES)
        out.print(f"    {r['backend']:>10}: {line}")


# ----------------------------------------------------------------------------- main

def run(mode: str, out_dir: Path, names: list[str], device: torch.device) -> dict:
    out = console()
    sweep = SWEEPS[mode]
    bench, timer_note = timer(device)
    stem = out_dir / f"attention_{device_slug(device)}{'' if mode == 'full' else '_' + mode}"
    report = {"metadata": environment(device),
              "settings": {"mode": mode, "tokens": sweep.tokens, "hidden": sweep.hidden, "dtype": "bfloat16",
                           "head_dims": sweep.head_dims, "lengths": sweep.lengths,
                           "memory_lengths": sweep.memory_lengths, "memory_shape": sweep.memory_shape,
                           "naive_max_len": sweep.naive_max_len, "timer": timer_note},
              "backends": {}, "throughput": [], "memory": []}
    for name in names:
        status = check_available(name, sweep.head_dims[-1], device)
        report["backends"][name] = {"label": BACKENDS[name].label, "status": status}
        out.print(f"{name}: {status}")
    runnable = [n for n in names if report["backends"][n]["status"] == "available"]

    for D in sweep.head_dims:
        for causal in (False, True):
            for N in sweep.lengths:
                shape = (max(1, sweep.tokens // N), N, sweep.hidden // D, D)
                out.print(f"[bold]D={D} N={N} B={shape[0]} H={shape[2]} "
                          f"{'causal' if causal else 'non-causal'}[/]")
                rows = [measure_throughput(name, shape, causal, device, bench)
                        if (why := not_measured(name, N, runnable, sweep)) is None
                        else base_row(name, shape, causal, status=why) for name in names]
                report["throughput"] += rows
                print_shape(out, rows)
                write_outputs(stem, report)
            draw_safely(out, plot, stem, report)  # a run cut short still leaves its plots

    B, H, D = sweep.memory_shape
    for name in (n for n in MEMORY_BACKENDS if n in runnable):
        for N in sweep.memory_lengths:
            row = measure_memory(name, (B, N, H, D), device)
            report["memory"].append(row)
            out.print(f"memory {name} N={N}: {human_bytes(row.get('peak_bytes'))} ({row['status']})")
            write_outputs(stem, report)
            if row["status"] != "ok":  # longer sequences fail the same way, only slower
                break

    draw_safely(out, plot, stem, report)
    print_table(f"Attention TFLOP/s, {report['metadata']['device']}", THROUGHPUT_HEADERS,
                throughput_rows(report))
    print_table("Peak memory, one causal forward+backward", MEMORY_HEADERS, memory_rows(report))
    out.print(f"wrote {stem}.json, .md, _tflops.png" + (", _memory.png" if report["memory"] else ""))
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", dest="mode", const="quick",
                      help="N in {4K, 16K}, memory up to 32K (1-2 minutes on an H200)")
    size.add_argument("--long", action="store_const", dest="mode", const="long",
                      help="gpt2-small's attention, batch 1, N from 16K to 256K (a few minutes)")
    size.add_argument("--smoke", action="store_const", dest="mode", const="smoke",
                      help="CPU-sized shapes that only check the plumbing; not a benchmark")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks", help="output folder")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help=f"comma-separated subset of {','.join(BACKENDS)}")
    args = parser.parse_args(argv)
    mode = args.mode or "full"
    names = [n for n in args.backends.split(",") if n]
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise ValueError(f"--backends: unknown {', '.join(unknown)}; valid: {', '.join(BACKENDS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        if mode != "smoke":
            raise ValueError("no CUDA device: real attention figures need a GPU; use --smoke for a CPU "
                             "plumbing check")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # our kernel runs on the CPU only interpreted
        torch.set_num_threads(1)  # tiny shapes: OpenMP threads only wait on each other
    return run(mode, args.out, names, device)


if __name__ == "__main__":
    run_cli(main)
