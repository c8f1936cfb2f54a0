"""Where the host time of one eager attention call goes, on CUDA: a diagnosis, not a benchmark.

    FLASHTRAIN_AUTOTUNE=0 python scripts/kernel_dev/host_probe.py --out DIR

gpt2-small's attention (B=16, T=1K, 12 x 64, causal, bf16, q/k/v views of a fused QKV), SDPA's
default beside ours (kernel=auto). Back-to-back calls can fill the GPU's launch queue, after which
each launch waits for a free slot and the host's "issue time" becomes the GPU's time; so besides
back-to-back loops of 20 and 100 calls, each call is also timed alone, from an idle GPU (the
synchronisation before it is outside the timing): its true host cost. Then, per call:
- the GPU kernels' time and the host's per-op time on every thread (torch.profiler: the autograd
  engine runs a CUDA backward on a thread of its own, which cProfile does not see);
- cProfile of 100 forward+backward calls with the backward on the calling thread
  (torch.autograd.set_multithreading_enabled(False)), so that it does see them;
- the same calls with every Triton/Gluon launch made a no-op: our Python alone.
Prints everything, and writes DIR/host_probe.json.

    python scripts/kernel_dev/host_probe.py --timeline --out DIR

prints instead one forward+backward of each (SDPA, ours, the native `x * 1.0`) as a timeline: every
host event of the call on every thread, by start time, nested, with its thread: where the engine's
thread waits (its wake-up after the calling thread hands it the graph, and back) and which ops it
runs. Writes DIR/host_timeline.json.
"""
from __future__ import annotations

import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))            # scripts/, for _common
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))   # for the host benchmark's timers
import _common  # noqa: E402  (puts the repo root on sys.path)
import torch  # noqa: E402
from _common import run_cli  # noqa: E402
from bench_attention_host import idle_issue, issue_and_wall  # noqa: E402

from kernels import flash_attention  # noqa: E402
from model.attention import sdpa_attention  # noqa: E402


def idle(fn) -> float:
    return idle_issue(fn)


def back_to_back(fn, calls) -> dict:
    issue, wall = issue_and_wall(fn, calls)
    return {"issue": issue, "wall": wall}


def profiled(fn, calls=20) -> tuple[str, str, float]:
    from torch.profiler import ProfilerActivity, profile
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events) / calls
    return (events.table(sort_by="self_cpu_time_total", row_limit=25),
            events.table(sort_by="self_cuda_time_total", row_limit=12), gpu)


def cprofiled(fn, calls=100, lines=35) -> str:
    torch.autograd.set_multithreading_enabled(False)
    try:
        for _ in range(5):
            fn()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            fn()
        profiler.disable()
        torch.cuda.synchronize()
    finally:
        torch.autograd.set_multithreading_enabled(True)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(lines)
    return text.getvalue()


class _Scale(torch.autograd.Function):
    """q * 1.0 as a Python autograd.Function: its backward runs Python on the autograd engine's thread."""

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        return grad


def python_function_cost(qkv, q, dout) -> dict:
    """Host us of one forward+backward of q * 1.0 (with the fused-QKV views' graph), native op or a
    Python Function, the backward on the engine's CUDA thread or on the calling one: what running
    Python in a CUDA backward costs by itself."""
    found = {}
    for name, fn in (("native", lambda x: x * 1.0), ("python", _Scale.apply)):
        def step(fn=fn):
            return torch.autograd.grad(fn(q), qkv, dout)
        for threads in ("engine thread", "calling thread"):
            torch.autograd.set_multithreading_enabled(threads == "engine thread")
            found[f"{name}, {threads}"] = {"idle": idle(step), "b2b100": back_to_back(step, 100)}
        torch.autograd.set_multithreading_enabled(True)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    found["python, engine thread, switch interval 10 us"] = {"idle": idle(lambda: torch.autograd.grad(
        _Scale.apply(q), qkv, dout))}
    sys.setswitchinterval(switch)
    return found


def grad_step(attn, q, k, v, qkv, dout):
    """One eager forward+backward of `attn` on the fused-QKV views, as every measurement here takes it."""
    return lambda: torch.autograd.grad(attn(q, k, v, causal=True), qkv, dout)


def timeline(step, calls: int = 12, depth: int = 3) -> list[dict]:
    """One call's host events on every thread (torch.profiler), in start order, microseconds from
    the call's start: the last of `calls` profiled calls, so that caches are warm."""
    from torch.profiler import ProfilerActivity, profile, record_function
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            with record_function("probe_call"):
                step()
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CPU"]
    call = [e for e in events if e.name == "probe_call"][-1]
    t0, t1 = call.time_range.start, call.time_range.end

    def level(e):
        n = 0
        while e.cpu_parent is not None:
            e, n = e.cpu_parent, n + 1
        return n
    rows = []
    for e in events:
        if t0 <= e.time_range.start <= t1 and e is not call:
            d = level(e)
            if d <= depth:
                rows.append({"start": e.time_range.start - t0, "us": e.time_range.end - e.time_range.start,
                             "thread": e.thread, "depth": d, "name": e.name})
    rows.sort(key=lambda r: r["start"])
    return [{"start": 0.0, "us": t1 - t0, "thread": call.thread, "depth": 0, "name": "the call"}] + rows


def print_timeline(name: str, rows: list[dict]) -> None:
    threads = {}
    print(f"--- timeline: {name} (us from the call's start; thread numbers in order of appearance)")
    for r in rows:
        t = threads.setdefault(r["thread"], len(threads))
        print(f"{r['start']:9.1f} {r['us']:8.1f}  t{t} {'  ' * r['depth']}{r['name'][:90]}")


def stub_launches():
    from triton.runtime.autotuner import Autotuner

    from kernels import flash_bwd, flash_fwd
    from kernels.gluon import backward, forward
    for module in (flash_fwd, flash_bwd, forward, backward):
        for obj in vars(module).values():
            if hasattr(obj, "run") and hasattr(obj, "fn"):
                target = obj.fn if isinstance(obj, Autotuner) else obj
                target.run = lambda *a, **kw: None
    from triton.compiler.compiler import CompiledKernel
    CompiledKernel.__getitem__ = lambda self, grid: (lambda *a, **kw: None)


def main(argv: list[str] | None = None) -> None:
    parser = _common.argument_parser(__doc__)
    parser.add_argument("--out", type=Path, help="folder for host_probe.json")
    parser.add_argument("--shape", default="16/1024/12/64", help="B/T/H/D")
    parser.add_argument("--timeline", action="store_true", help="only one call of each as a timeline of host events")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise ValueError("no CUDA device: the probe times CUDA calls (bench_attention_host.py --stub times the Python alone)")
    try:
        B, N, H, D = (int(x) for x in args.shape.split("/"))
    except ValueError:
        raise ValueError(f"--shape={args.shape!r}: expected B/T/H/D, four integers") from None
    qkv = torch.randn(B, N, 3 * H * D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = (t.unflatten(-1, (-1, D)) for t in qkv.split([H * D] * 3, -1))
    dout = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "shape": args.shape, "rows": {}}
    fns = {"sdpa-default": sdpa_attention, "ours-auto": flash_attention}
    if args.timeline:
        steps = {name: grad_step(attn, q, k, v, qkv, dout) for name, attn in fns.items()}
        steps["native q * 1.0"] = lambda: torch.autograd.grad(q * 1.0, qkv, dout)
        found = {}
        for name, step in steps.items():
            for threads in ("engine thread", "calling thread"):
                torch.autograd.set_multithreading_enabled(threads == "engine thread")
                found[f"{name}, {threads}"] = rows = timeline(step)
                print_timeline(f"{name}, {threads}", rows)
            torch.autograd.set_multithreading_enabled(True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "host_timeline.json").write_text(json.dumps({**result, "timelines": found}, indent=1))
        return
    for name, attn in fns.items():
        def forward():
            return attn(q, k, v, causal=True)

        step = grad_step(attn, q, k, v, qkv, dout)
        row = {"forward_idle": idle(forward), "step_idle": idle(step),
               "forward_b2b20": back_to_back(forward, 20), "forward_b2b100": back_to_back(forward, 100),
               "step_b2b20": back_to_back(step, 20), "step_b2b100": back_to_back(step, 100)}
        torch.autograd.set_multithreading_enabled(False)
        row["step_idle_one_thread"] = idle(step)
        row["step_b2b100_one_thread"] = back_to_back(step, 100)
        torch.autograd.set_multithreading_enabled(True)
        cpu_table, gpu_table, gpu_us = profiled(step)
        row["step_gpu_us_profiler"] = gpu_us
        print(f"=== {name}\n{json.dumps(row, indent=1)}\n--- torch.profiler, per 20 steps, by host time\n{cpu_table}"
              f"\n--- by GPU time\n{gpu_table}")
        if name != "sdpa-default":
            print(f"--- cProfile, 100 steps on one thread\n{cprofiled(step)}")
        result["rows"][name] = row
    result["rows"]["python Function vs native op"] = python_function_cost(qkv, q, dout)
    print(json.dumps(result["rows"]["python Function vs native op"], indent=1))
    stub_launches()

    stubbed = grad_step(flash_attention, q, k, v, qkv, dout)
    result["rows"]["ours-auto launches stubbed"] = {"step_idle": idle(stubbed), "forward_idle": idle(
        lambda: flash_attention(q, k, v, causal=True))}
    print(json.dumps(result["rows"]["ours-auto launches stubbed"]))
    print(f"--- cProfile, stubbed launches\n{cprofiled(stubbed, lines=25)}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    run_cli(main)
