"""Attention speed and memory: our Triton FlashAttention against SDPA (FA2, cuDNN), FlexAttention, naive.

    python scripts/bench/bench_attention.py            # full sweep: an estimated 5-7 minutes on an H200,
                                                 # half of it compiling FlexAttention for each shape
    python scripts/bench/bench_attention.py --quick    # two lengths, memory up to 32K (1-2 minutes)
    python scripts/bench/bench_attention.py --long     # gpt2-small's heads, batch 1, N up to 256K
    python scripts/bench/bench_attention.py --smoke    # CPU-sized plumbing check (not a benchmark)
    python scripts/bench/bench_attention.py --training # the shapes models train with

--training with every backend (ours, ours-auto, ours-gluon, ours-atomic, sdpa-default, sdpa-cudnn, flex) takes an
estimated ~13-15 minutes on one H200 (ours-gluon adds ~1-2 minutes: its forward compiles in ~5 s per
head dim and causal setting, it reuses ours' backward, and it runs the 20 s sustained shapes too) (Flex compiles each of the 21 shapes, ~8 s each; our
autotuner compiles ~17 candidates per head dim and times each at 64K and 128K, where one
32/8 x 128 call takes ~1 s; the 20 s sustained runs). Split in two lanes of ~6.5 minutes on a
two-GPU host (the first without a sustained run: 12 x 64's is in the file from commit 22c954d),
then merged:

    CUDA_VISIBLE_DEVICES=0 python scripts/bench/bench_attention.py --training --heads 12/12/64,16/16/128 \
        --sustained '' --out lane1 &
    CUDA_VISIBLE_DEVICES=1 python scripts/bench/bench_attention.py --training --heads 32/8/128 \
        --sustained 32/8/128/16384 --out lane2 &
    wait; python scripts/bench/bench_attention.py --merge-training lane1/attention_h200_training.json \
        lane2/attention_h200_training.json --out benchmarks/attention

Throughput: forward, backward and forward+backward TFLOP/s for head dims 64 and 128, sequence
lengths 1K-32K at 16K tokens per batch (B = 16384 / N; one sequence of 32K) and hidden size 2048
(H = 2048 / D), causal and not, bf16. FLOPs: forward 4*B*H*N^2*D, halved when causal; backward
2.5x forward (five matmuls of the same size instead of two); forward+backward 3.5x. Each
backend is timed in its own layout (ours and naive take (B, N, H, D), SDPA and Flex (B, H, N, D);
the transposes happen before timing), on fresh random normal inputs. All three passes come from
the same forward+backward calls, CUDA events before, between and after each, in do_bench's loop
(median; warm-up excluded, L2 flushed between calls; scripts/_common.py, pass_timer): backward is
what it adds to a forward, as in a training step.

Memory: peak allocated memory of one forward+backward at B=1, H=16, D=128, causal, against N, for
ours and naive (naive until it runs out of memory).

A backend that cannot run here (our kernel not importable, a SDPA backend this GPU or build lacks)
is reported as unavailable, never replaced by another. One failing measurement (out of memory, an
unsupported shape) is recorded as such and the sweep goes on. Results are rewritten after each
shape: <out>/attention_<gpu>.json (with metadata), .md (tables) and two PNGs; --out defaults to
outputs/bench_attention/ (git-ignored), `--out benchmarks/attention` writes the committed results.
`--attention ours,sdpa-flash` picks the backends compared (default: all).
"""
from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/, for _common (which puts the repo root first)
import _common  # noqa: F401  (puts the repo root on sys.path)
import torch
import torch.nn.functional as F

from _common import (PASSES, add_out_argument, console, device_slug, draw_safely, environment, error_text, human_bytes,
                     kernel_bench_device, markdown_table, memory_unit, pass_timer, new_figure, plain_log_axis, print_table, run_cli,
                     save_figure, tokens_axis, tokens_label, tuning_note, write_json, write_text)
from _memory import is_oom, peak_meter, release_memory

TOKENS, HIDDEN = 16384, 2048

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
    # the rates behind a million-token training step (benchmarks/max_context/max_context_h200.md)
    "long": Sweep((64,), (16384, 65536, 131072, 262144), 1, 768, (), (1, 12, 64), 16384),
}


# ----------------------------------------------------------------------------- backends

def _ours(deterministic: bool, kernel: str = "triton"):
    """Our kernel with the deterministic backward (`ours`) or the one adding dQ with atomics, its
    forward the Triton one or the Gluon Hopper one (`kernel`, as attention.kernel picks it)."""
    def make(causal: bool, seq_len: int, device: torch.device) -> Attention:
        try:
            from kernels import flash_attention
        except ImportError as exc:
            raise Unavailable(f"kernels.flash_attention not importable ({exc})") from exc
        return lambda q, k, v: flash_attention(q, k, v, causal=causal, deterministic=deterministic, kernel=kernel)
    return make


def _sdpa(backend_name: str | None):
    """SDPA restricted to one backend, or (None) left to pick its own, as `attention=sdpa` does."""
    def make(causal: bool, seq_len: int, device: torch.device) -> Attention:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        only = (lambda: sdpa_kernel(getattr(SDPBackend, backend_name))) if backend_name else contextlib.nullcontext

        def attention(q, k, v):
            with only():  # a few microseconds per call, hidden behind the GPU's queue
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                      enable_gqa=q.shape[1] != k.shape[1])
        return attention
    return make


def _flex(causal: bool, seq_len: int, device: torch.device, score_mod=None) -> Attention:
    """FlexAttention compiled for one shape, with `score_mod` (flex's signature) on its scores."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # Fresh compile caches per shape: dynamo's recompile limit would otherwise drop to eager after
    # a handful of shapes.
    torch._dynamo.reset()
    mask = (create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, seq_len, seq_len,
                              device=device) if causal else None)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, block_mask=mask, score_mod=score_mod, enable_gqa=q.shape[1] != k.shape[1])


def _naive(causal: bool, seq_len: int, device: torch.device) -> Attention:
    from kernels.reference import attention_reference
    return lambda q, k, v: attention_reference(q, k, v, causal=causal)


@dataclass(frozen=True)
class Backend:
    label: str
    heads_first: bool   # takes (B, H, N, D) rather than (B, N, H, D)
    make: Callable[[bool, int, torch.device], Attention]   # raises Unavailable


BACKENDS = {
    "ours": Backend("ours (Triton)", False, _ours(True)),
    "ours-atomic": Backend("ours (Triton), atomic-dQ backward (attention.deterministic=false)", False, _ours(False)),
    "ours-auto": Backend("ours, as attention=flash runs by default (attention.kernel=auto: each direction's "
                         "kernel as the kernel plan picks it)", False, _ours(True, "auto")),
    "ours-gluon": Backend("ours, the Gluon Hopper forward and backward (attention.kernel=gluon)", False,
                          _ours(True, "gluon")),
    "sdpa-default": Backend("SDPA, its own choice of backend", True, _sdpa(None)),
    "sdpa-flash": Backend("SDPA flash (FA2)", True, _sdpa("FLASH_ATTENTION")),
    "sdpa-cudnn": Backend("SDPA cuDNN", True, _sdpa("CUDNN_ATTENTION")),
    "flex": Backend("FlexAttention (compiled)", True, _flex),
    "naive": Backend("naive PyTorch", False, _naive),
}
MEMORY_BACKENDS = ("ours", "naive")


# ----------------------------------------------------------------------------- measuring

def attention_flops(batch: int, heads: int, seq_len: int, head_dim: int, causal: bool) -> dict[str, float]:
    """FLOPs of each pass: forward 4*B*H*N^2*D (halved when causal), backward 2.5x, both 3.5x."""
    forward = 4 * batch * heads * seq_len**2 * head_dim / (2 if causal else 1)
    return {"fwd": forward, "bwd": 2.5 * forward, "fwd+bwd": 3.5 * forward}


def random_inputs(shape: tuple[int, int, int, int], heads_first: bool, device: torch.device):
    """q, k, v (leaves needing grad) and dout, standard normal bf16, in the backend's own layout."""
    B, N, H, D = shape
    tensors = [torch.randn(B, N, H, D, device=device, dtype=torch.bfloat16) for _ in range(4)]
    if heads_first:
        tensors = [t.transpose(1, 2).contiguous() for t in tensors]
    q, k, v, dout = tensors
    return [t.requires_grad_() for t in (q, k, v)], dout


def time_passes(name: str, shape, causal: bool, device, timer) -> dict[str, float]:
    """Milliseconds of forward, backward and the two together (`timer` is pass_timer's)."""
    backend = BACKENDS[name]
    attention = backend.make(causal, shape[1], device)
    inputs, dout = random_inputs(shape, backend.heads_first, device)
    return timer(lambda: attention(*inputs), lambda out: torch.autograd.grad(out, inputs, dout))


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


def measure_throughput(name: str, shape, causal: bool, device, timer) -> dict:
    row = base_row(name, shape, causal)
    try:
        times = time_passes(name, shape, causal, device, timer)
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


# ----------------------------------------------------------------------------- training shapes

# (query heads, K/V heads, head dim) of the models people train: gpt2-small's attention, a
# 2048-wide model with heads of 128, and the same with grouped-query attention (32 over 8).
TRAINING_HEADS = ((12, 12, 64), (16, 16, 128), (32, 8, 128))
TRAINING_LENGTHS = (1024, 2048, 4096, 8192, 16384, 65536, 131072)
TRAINING_BACKENDS = ("ours", "ours-auto", "ours-gluon", "ours-atomic", "sdpa-default", "sdpa-cudnn", "flex")
SUSTAINED_S = 20.0


def fused_inputs(batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, heads_first: bool, device,
                 dtype: torch.dtype = torch.bfloat16):
    """q, k, v as strided views of one fused QKV projection output (the leaf that gets the
    gradient), exactly as the model hands them to attention; dout contiguous in (B, N, H, D)."""
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(batch, seq_len, width, device=device, dtype=dtype, requires_grad=True)
    q, k, v = (t.unflatten(-1, (-1, head_dim)) for t in
               qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
    dout = torch.randn(batch, seq_len, heads, head_dim, device=device, dtype=dtype)
    if heads_first:
        q, k, v, dout = (t.transpose(1, 2) for t in (q, k, v, dout))
    return qkv, (q, k, v), dout


def sdpa_choice(attention, args, leaf, dout) -> str:
    """Which backend SDPA ran, read off the kernel names of one forward + backward."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.autograd.grad(attention(*args), leaf, dout)
        torch.cuda.synchronize()
    names = " ".join(e.key.lower() for e in prof.key_averages())
    for needle, label in (("cudnn", "cuDNN"), ("flash_fwd", "FA2"), ("flash", "FA2"), ("fmha", "mem-efficient")):
        if needle in names:
            return label
    return "math"


class PowerLog:
    """SM clock (MHz) and board power (W) sampled every 0.2 s in a thread, through NVML."""

    def __init__(self, device):
        import threading
        self.samples, self._stop = [], threading.Event()
        try:
            import pynvml
            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            self._read = lambda: (pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                                  pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3)
        except Exception:  # noqa: BLE001 (no NVML: the figures go without clocks)
            self._read = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.2):
            self.samples.append(self._read())

    def __enter__(self):
        if self._read:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._read:
            self._thread.join()

    def summary(self) -> dict:
        if not self.samples:
            return {}
        clocks, watts = zip(*self.samples)
        return {"sm_clock_mhz_median": statistics.median(clocks), "sm_clock_mhz_min": min(clocks),
                "power_w_median": statistics.median(watts), "power_w_max": max(watts)}


def sustained_ms(fn, seconds: float, device) -> tuple[float, dict]:
    """Mean milliseconds per call over `seconds` of back-to-back calls (the clock the power cap
    allows under sustained load, not a 100 ms burst), with the clocks and power seen meanwhile."""
    fn()
    torch.cuda.synchronize()
    calls, began = 0, time.perf_counter()
    with PowerLog(device) as power:
        while time.perf_counter() - began < seconds:
            for _ in range(10):
                fn()
            calls += 10
            torch.cuda.synchronize()
    return (time.perf_counter() - began) * 1e3 / calls, power.summary()


def ours_plan(name: str, args) -> str:
    """The kernel plan (kernels/plan.py) our backend `name` runs on these inputs: what a training run
    of the same shape logs and records."""
    from kernels.flash_op import kernel_plan

    kernel = {"ours-auto": "auto", "ours-gluon": "gluon"}.get(name, "triton")
    return str(kernel_plan(*args, causal=True, deterministic=name != "ours-atomic", kernel=kernel))


def measure_training_shape(name: str, shape, device, timer, sustained: bool) -> dict:
    B, N, H, Hkv, D = shape
    row = {"backend": name, "B": B, "N": N, "H": H, "Hkv": Hkv, "D": D, "causal": True, "status": "ok"}
    try:
        backend = BACKENDS[name]
        attention = backend.make(True, N, device)
        leaf, args, dout = fused_inputs(B, N, H, Hkv, D, backend.heads_first, device)
        times = timer(lambda: attention(*args), lambda out: torch.autograd.grad(out, leaf, dout))
        step = lambda: torch.autograd.grad(attention(*args), leaf, dout)  # noqa: E731
        if name == "sdpa-default":
            row["picked"] = sdpa_choice(attention, args, leaf, dout)
        if name.startswith("ours"):
            row["plan"] = ours_plan(name, args)
        if sustained:
            row["sustained_fwd+bwd_ms"], row["sustained_power"] = sustained_ms(step, SUSTAINED_S, device)
    except Exception as exc:  # noqa: BLE001 (one shape failing must not end the sweep)
        row["status"] = failure(exc)
    release_memory(device)
    if row["status"] == "ok":
        flops = attention_flops(B, H, N, D, causal=True)
        for p in PASSES:
            row[f"{p}_ms"] = times[p]
            row[f"{p}_tflops"] = flops[p] / (times[p] * 1e-3) / 1e12
    return row


TRAINING_HEADERS = ["H/Hkv x D", "T", "B", "backend", "fwd ms", "bwd ms", "fwd+bwd ms", "fwd+bwd TFLOP/s",
                    "ours/this fwd", "ours/this bwd", "ours/this fwd+bwd", "atomic/this bwd", "atomic/this fwd+bwd"]


def training_rows(report: dict) -> list[list]:
    """One row per measurement; 'ours/this' is this backend's time over ours-auto's (ours' where
    ours-auto was not run), 'atomic/this' over ours-atomic (its forward is ours', so only bwd and
    fwd+bwd)."""
    def key(r):
        return r["H"], r["Hkv"], r["D"], r["N"]

    def by_key(name):
        return {key(r): r for r in report["training"] if r["backend"] == name and r["status"] == "ok"}

    names = {r["backend"] for r in report["training"]}
    ours, atomic = by_key("ours-auto" if "ours-auto" in names else "ours"), by_key("ours-atomic")
    rows = []
    for r in report["training"]:
        heads = f"{r['H']}/{r['Hkv']} x {r['D']}"
        label = r["backend"] + (f" ({r['picked']})" if "picked" in r else "")
        if r["status"] != "ok":
            rows.append([heads, r["N"], r["B"], label, r["status"]] + [""] * 8)
            continue
        ratios = []
        for mine, passes in ((ours.get(key(r)), PASSES), (atomic.get(key(r)), PASSES[1:])):
            ratios += [f"{r[p + '_ms'] / mine[p + '_ms']:.2f}" if mine and r is not mine else "-" for p in passes]
        rows.append([heads, r["N"], r["B"], label, *(f"{r[p + '_ms']:.3f}" for p in PASSES),
                     f"{r['fwd+bwd_tflops']:.0f}", *ratios])
    return rows


def sustained_rows(report: dict) -> list[list]:
    rows = []
    for r in report["training"]:
        if "sustained_fwd+bwd_ms" in r:
            p = r.get("sustained_power", {})
            rows.append([f"{r['H']}/{r['Hkv']} x {r['D']}", r["N"], r["backend"], f"{r['fwd+bwd_ms']:.3f}",
                         f"{r['sustained_fwd+bwd_ms']:.3f}", p.get("sm_clock_mhz_median", "-"),
                         p.get("sm_clock_mhz_min", "-"), p.get("power_w_median", "-")])
    return rows


def write_training_outputs(stem: Path, report: dict) -> None:
    write_json(stem.with_suffix(".json"), report)
    meta = report["metadata"]
    lines = [f"# Attention at training shapes: {meta['device']}", "",
             f"{meta['date']}, torch {meta['torch']}, triton {meta['triton']}, commit {meta['git_commit']}. "
             "bf16, causal, 16K tokens per call (B = max(1, 16384 / T)); q, k, v are strided views of one "
             "fused QKV projection as the model passes them, gradients taken w.r.t. that projection. "
             f"Times are milliseconds ({report['settings'].get('timer', 'triton.testing.do_bench median')}; burst clocks); 'ours/this' is the "
             "other backend's time over ours-auto's (ours' where ours-auto was not run): > 1 means ours is faster. sdpa-default is SDPA left to "
             f"choose (the backend it ran is in brackets); ours-gluon is ours with attention.kernel=gluon (the Gluon "
             "Hopper forward and backward), ours-auto attention.kernel=auto (what attention=flash runs: each "
             "direction's kernel as the kernel plan picks it, in the 'plan' column); ours-atomic is ours with attention.deterministic=false "
             "(the same forward; the backward adds dQ with float32 atomics), 'atomic/this' its ratios."
             f"{tuning_note(meta)}", "",
             markdown_table(TRAINING_HEADERS, training_rows(report))]
    plans = sorted({(r["H"], r["Hkv"], r["D"], r["N"], r["backend"], r["plan"]) for r in report["training"]
                    if r.get("plan")})
    if plans:
        lines += ["", "## Kernel plans (kernels/plan.py) of our backends", "",
                  markdown_table(["H/Hkv x D", "T", "backend", "plan"],
                                 [[f"{h}/{hkv} x {d}", n, b, p] for h, hkv, d, n, b, p in plans])]
    sustained = sustained_rows(report)
    if sustained:
        lines += [f"## Sustained: {SUSTAINED_S:.0f} s of back-to-back forward+backward calls", "",
                  markdown_table(["H/Hkv x D", "T", "backend", "burst ms", "sustained ms", "SM MHz (median)",
                                  "SM MHz (min)", "power W (median)"], sustained)]
    write_text(stem.with_suffix(".md"), "\n".join(lines))


def run_training(out_dir: Path, names: list[str], device: torch.device, heads, lengths, sustained_at) -> dict:
    out = console()
    timer, timer_note = pass_timer(device)
    stem = out_dir / f"attention_{device_slug(device)}_training"
    report = {"metadata": environment(device),
              "settings": {"mode": "training", "tokens": TOKENS, "dtype": "bfloat16", "heads": heads,
                           "lengths": lengths, "timer": timer_note, "sustained_s": SUSTAINED_S},
              "backends": {n: {"label": BACKENDS[n].label} for n in names}, "training": []}
    for H, Hkv, D in heads:
        for N in lengths:
            shape = (max(1, TOKENS // N), N, H, Hkv, D)
            out.print(f"[bold]H={H} Hkv={Hkv} D={D} T={N} B={shape[0]}[/]")
            for name in names:
                sustained = (H, Hkv, D, N) in sustained_at and name in ("ours", "ours-auto", "ours-gluon", "sdpa-default")
                row = measure_training_shape(name, shape, device, timer, sustained)
                report["training"].append(row)
                out.print(f"    {name:>12}{' (' + row['picked'] + ')' if 'picked' in row else ''}: " + (
                    "  ".join(f"{p} {row[p + '_ms']:.3f} ms" for p in PASSES) if row["status"] == "ok"
                    else row["status"]))
                write_training_outputs(stem, report)
    print_table(f"Attention at training shapes, {report['metadata']['device']}", TRAINING_HEADERS,
                training_rows(report))
    return report


def merge_training(out_dir: Path, parts: list[Path]) -> dict:
    """One training-shapes report from the lanes of a split run (e.g. --heads on two GPUs, each
    writing its own --out): the first part's metadata, every part's command, all rows in order."""
    reports = []
    for part in parts:
        try:
            reports.append(json.loads(part.read_text()))
        except (OSError, ValueError) as exc:
            raise ValueError(f"--merge-training: cannot read {part}: {error_text(exc)}") from None
        if reports[-1].get("settings", {}).get("mode") != "training":
            raise ValueError(f"--merge-training: {part} is not a --training report")
        if reports[-1]["settings"].get("timer") != reports[0]["settings"].get("timer"):
            raise ValueError(f"--merge-training: {part} was timed otherwise than {parts[0]}")
    merged = {**reports[0], "training": [row for r in reports for row in r["training"]]}
    merged["metadata"] = {**reports[0]["metadata"], "command": " ; ".join(r["metadata"]["command"] for r in reports),
                          "lanes": [{k: r["metadata"].get(k) for k in ("date", "command")} for r in reports]}
    merged["backends"] = {name: info for r in reports for name, info in r["backends"].items()}
    merged["settings"]["heads"] = [h for r in reports for h in r["settings"]["heads"]]
    stem = out_dir / Path(parts[0]).stem
    write_training_outputs(stem, merged)
    console().print(f"wrote {stem}.json, .md from {len(parts)} parts")
    return merged


# ----------------------------------------------------------------------------- main

def run(mode: str, out_dir: Path, names: list[str], device: torch.device) -> dict:
    out = console()
    sweep = SWEEPS[mode]
    timer, timer_note = pass_timer(device)
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
                rows = [measure_throughput(name, shape, causal, device, timer)
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
    parser = _common.argument_parser(__doc__)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", dest="mode", const="quick",
                      help="N in {4K, 16K}, memory up to 32K (1-2 minutes on an H200)")
    size.add_argument("--long", action="store_const", dest="mode", const="long",
                      help="gpt2-small's attention, batch 1, N from 16K to 256K (a few minutes)")
    size.add_argument("--training", action="store_const", dest="mode", const="training",
                      help="causal, the heads of trained models, strided fused-QKV inputs, T from 1K to "
                           "128K, against SDPA's own choice (about 12 minutes with every backend on one "
                           "H200; the module docstring gives a two-GPU split)")
    size.add_argument("--smoke", action="store_const", dest="mode", const="smoke",
                      help="CPU-sized shapes that only check the plumbing; not a benchmark")
    size.add_argument("--merge-training", nargs="+", type=Path, metavar="JSON",
                      help="combine the attention_<gpu>_training.json files of a run split into lanes "
                           "(--heads per GPU, each with its own --out) into one report in --out")
    add_out_argument(parser, "bench_attention")
    parser.add_argument("--attention", dest="backends", default=None,
                        help=f"comma-separated subset of {','.join(BACKENDS)} (default: all; with --training "
                             f"{','.join(TRAINING_BACKENDS)})")
    parser.add_argument("--lengths", default=None, help="--training only: comma-separated T (default: "
                        + ",".join(map(str, TRAINING_LENGTHS)) + ")")
    parser.add_argument("--heads", default=None, help="--training only: comma-separated H/Hkv/D, e.g. 12/12/64")
    parser.add_argument("--sustained", default="12/12/64/16384,16/16/128/16384",
                        help="--training only: H/Hkv/D/T shapes also timed over 20 s back to back, with clocks")
    args = parser.parse_args(argv)
    if args.merge_training:
        return merge_training(args.out, args.merge_training)
    mode = args.mode or "full"
    names = [n for n in (args.backends or ",".join(TRAINING_BACKENDS if mode == "training" else BACKENDS)).split(",")
             if n]
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise ValueError(f"--attention: unknown {', '.join(unknown)}; valid: {', '.join(BACKENDS)}")
    device = kernel_bench_device(mode == "smoke", "attention figures")
    if mode == "training":
        def ints(text: str, what: str) -> tuple[int, ...]:
            try:
                values = tuple(int(x) for x in text.split("/"))
            except ValueError:
                raise ValueError(f"{what}={text!r}: expected integers separated by '/'") from None
            if any(v < 1 for v in values):
                raise ValueError(f"{what}={text!r}: every value must be positive")
            return values
        heads = [ints(h, "--heads") for h in args.heads.split(",")] if args.heads else list(TRAINING_HEADS)
        lengths = [ints(n, "--lengths")[0] for n in args.lengths.split(",")] if args.lengths else list(TRAINING_LENGTHS)
        sustained = {ints(x, "--sustained") for x in args.sustained.split(",") if x}
        if any(len(h) != 3 or h[0] % h[1] for h in heads):
            raise ValueError(f"--heads={args.heads!r}: each entry is H/Hkv/D with H a multiple of Hkv")
        return run_training(args.out, names, device, heads, lengths, sustained)
    return run(mode, args.out, names, device)


if __name__ == "__main__":
    run_cli(main)
