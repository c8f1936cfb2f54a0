"""Host time of our attention's calls beside SDPA's: what a small call cannot hide behind the GPU.

    python scripts/bench/bench_attention_host.py --out benchmarks/attention   # CUDA: gpt2-small's heads, B=16, T=1K
    python scripts/bench/bench_attention_host.py --stub                       # any machine: every launch a no-op

gpt2-small's attention at T = 1K is a few hundred microseconds of GPU work per forward+backward,
so the host's Python and launch work decides the speed of an eager step. On CUDA, for SDPA's
default and our kernel (each kernel plan given by `--kernels`), on q, k, v viewed from one fused
projection as the model passes them:

- forward issue, idle GPU: the host time of one forward issued to an idle GPU (median of 200):
  what the call itself costs the host;
- forward issue: host time per call of back-to-back forwards, no synchronisation in the loop
  (the GPU's time instead, once its launch queue is full);
- forward GPU: the same forward replayed from a CUDA graph (no host work), per call;
- forward+backward issue (idle GPU, and back to back): the same for a forward + backward
  (torch.autograd.grad);
- forward+backward wall: the same with the GPU synchronised at the end, per call: the larger of
  the host and the GPU time, what an eager training step pays.
Each is the median of `--rounds` rounds, a round measuring every implementation in turn (from a
different first one each round): the
GPU machine's host speed drifts by tens of percent within minutes, and interleaving lets the drift
reach every implementation alike (the JSON keeps every round). A second table divides each of our
times by SDPA's in the same round (median over rounds): what holds from one host to the next, which
differ by up to 2.5x in SDPA's own issue time.
Then cProfile over our calls: the functions that spend the host time.

--stub: the kernels' launches (every jitted function's `run`, and the direct launches of
kernels/launch.py that follow a call signature's first) do nothing, on tiny CPU tensors that the
kernel plans take for a Hopper GPU's: what remains is our Python and the autograd Function;
thread CPU time per call (minimum over 40 batches, robust to a shared machine) and the launches
one call makes.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/, for _common (which puts the repo root first)
import _common  # noqa: F401  (puts the repo root on sys.path)
import torch

from _common import add_out_argument, console, environment, markdown_table, run_cli, write_json, write_text

WORDS = {"auto": "auto", "triton": "triton", "gluon": "gluon"}


def fused_views(B, N, H, Hkv, D, device, dtype):
    qkv = torch.randn(B, N, (H + 2 * Hkv) * D, device=device, dtype=dtype, requires_grad=True)
    q, k, v = (t.unflatten(-1, (-1, D)) for t in qkv.split([H * D, Hkv * D, Hkv * D], -1))
    return qkv, (q, k, v), torch.randn(B, N, H, D, device=device, dtype=dtype)


def stub_launches() -> list[str]:
    """Make every kernel launch of both families a no-op that records the kernel's name, on a CPU
    taken for a Hopper GPU by the kernel plans (so that the Gluon family's Python runs too)."""
    from triton.runtime.autotuner import Autotuner

    from kernels import flash_bwd, flash_fwd
    from kernels import plan as kernel_plan
    from kernels.gluon import backward, forward

    from kernels import launch

    kernel_plan.device_arch = lambda device: "sm_90"
    launched: list[str] = []

    def compiled(name):   # what a jitted function's launch returns: its compiled kernel
        launched.append(name)
        return SimpleNamespace(name=name)
    for module in (flash_fwd, flash_bwd, forward, backward):
        for name, obj in vars(module).items():
            if hasattr(obj, "run") and hasattr(obj, "fn"):
                target = obj.fn if isinstance(obj, Autotuner) else obj
                target.run = lambda *a, _name=name, **kw: compiled(_name)
    # later launches of a call signature take the direct path, as on a GPU (no interpreter there)
    launch.INTERPRET = False
    launch.direct_launcher = lambda kernel, grid, tail: lambda args: launched.append(kernel.name)
    return launched


def cpu_time_per_call(fn, calls: int = 50, batches: int = 40) -> float:
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(batches):
        began = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - began) / calls)
    return best * 1e6


def issue_and_wall(fn, calls: int = 100) -> tuple[float, float]:
    """(host us per call with no synchronisation in the loop, wall us per call to the GPU's end)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    ended = time.perf_counter()
    return (issued - began) / calls * 1e6, (ended - began) / calls * 1e6


def idle_issue(fn, calls: int = 200) -> float:
    """Median host us of one call issued to an idle GPU (synchronised before it, outside the timing):
    the call's own host cost. Back-to-back calls measure it only while the GPU keeps up: once the
    launch queue is full, each launch waits for a slot and the loop's time is the GPU's."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def graph_time(fn, replays: int = 200) -> float:
    """GPU us per call of fn replayed from a CUDA graph (no host work between calls)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays * 1e3


def implementations(kernels: list[str]) -> dict:
    """name -> (attention function, its kernel plan or None)."""
    import functools

    from kernels import flash_attention
    from model.attention import sdpa_attention

    found = {"sdpa-default": sdpa_attention}
    for words in kernels:
        kernel = tuple(words.split("/")) if "/" in words else words
        found[f"ours-{words}"] = functools.partial(flash_attention, kernel=kernel)
    return found


def plan_of(fn, q, k, v) -> str | None:
    from kernels import flash_op

    if getattr(fn, "func", None) is not flash_op.flash_attention:
        return None
    return str(flash_op.kernel_plan(q, k, v, causal=True, **fn.keywords))


def measure_gpu(shape, kernels: list[str], profile: int, rounds: int = 5) -> dict:
    """Per implementation, the median over `rounds` rounds; each round measures every implementation
    once, in turn, so that a drift in the host's speed (a shared machine's) reaches all alike."""
    B, N, H, Hkv, D = shape
    leaf, (q, k, v), dout = fused_views(B, N, H, Hkv, D, "cuda", torch.bfloat16)
    calls = {}
    for name, fn in implementations(kernels).items():
        def forward(fn=fn):
            return fn(q, k, v, causal=True)

        def step(fn=fn):
            return torch.autograd.grad(fn(q, k, v, causal=True), leaf, dout)
        calls[name] = (forward, step)
    samples: dict = {name: {} for name in calls}
    names = list(calls)
    for index in range(rounds):
        for name in names[index % len(names):] + names[:index % len(names)]:   # each round starts elsewhere
            forward, step = calls[name]
            fwd_issue, _ = issue_and_wall(forward)
            step_issue, step_wall = issue_and_wall(step)
            measured = {"forward_issue_us": fwd_issue, "step_issue_us": step_issue, "step_wall_us": step_wall,
                        "forward_idle_issue_us": idle_issue(forward), "step_idle_issue_us": idle_issue(step)}
            for key, value in measured.items():
                samples[name].setdefault(key, []).append(value)
    rows = {}
    for name, (forward, step) in calls.items():
        with torch.no_grad():
            fwd_gpu = graph_time(forward)
        fn = implementations(kernels)[name]
        rows[name] = {"plan": plan_of(fn, q, k, v), "forward_gpu_us": fwd_gpu, "rounds": samples[name],
                      **{key: statistics.median(values) for key, values in samples[name].items()}}
        if profile and name != "sdpa-default":
            import cProfile
            import pstats
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(100):
                step()
            profiler.disable()
            torch.cuda.synchronize()
            print(f"--- {name}: cProfile of 100 forward+backward calls")
            pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(profile)
    base = rows["sdpa-default"]["step_wall_us"]
    for row in rows.values():
        row["wall_vs_sdpa"] = base / row["step_wall_us"]
        row["vs_sdpa"] = same_round_ratios(row["rounds"], rows["sdpa-default"]["rounds"])
    return rows


# The host's speed: the machines lent for a GPU drift by tens of percent within minutes and differ by
# up to 2.5x from one lease to the next (SDPA's forward+backward issue has measured 222 us on one and
# ~540 on another). So a host time is compared with SDPA's in the same round, and the medians of those
# ratios are what a target is checked against. The targets below were set as absolute times on a host
# where SDPA issued a forward in 31 us and a forward+backward in 222 us; as ratios they are these.
ISSUE_TARGETS = {"forward_issue_us": 60 / 31, "step_issue_us": 250 / 222}


def same_round_ratios(rounds: dict, sdpa_rounds: dict) -> dict:
    """Per measurement, the median over rounds of this call's time over SDPA's in the same round."""
    return {key: statistics.median(ours / sdpa for ours, sdpa in zip(values, sdpa_rounds[key]))
            for key, values in rounds.items()}


def measure_stub(kernels: list[str]) -> dict:
    launched = stub_launches()
    leaf, (q, k, v), dout = fused_views(1, 16, 2, 2, 64, "cpu", torch.float16)
    rows = {}
    for name, fn in implementations(kernels).items():
        if name == "sdpa-default":
            continue

        def step():
            return torch.autograd.grad(fn(q, k, v, causal=True), leaf, dout)
        launched.clear()
        step()
        rows[name] = {"launches": list(launched), "step_cpu_us": cpu_time_per_call(step)}

    def same_graph():  # the views' and the split's autograd work around a no-op attention
        return torch.autograd.grad(q * 1.0, leaf, dout)
    rows["graph only (q * 1.0)"] = {"launches": [], "step_cpu_us": cpu_time_per_call(same_graph)}
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = _common.argument_parser(__doc__)
    parser.add_argument("--stub", action="store_true", help="no-op launches on tiny CPU tensors (no GPU needed)")
    parser.add_argument("--shape", default="16/1024/12/12/64", help="B/T/H/Hkv/D (CUDA; default gpt2-small at 1K)")
    parser.add_argument("--kernels", default="auto,triton",
                        help="our kernel words to time, comma-separated; forward/backward for a pair (gluon/triton)")
    parser.add_argument("--profile", type=int, default=0, help="cProfile lines to print per implementation (0: none)")
    parser.add_argument("--rounds", type=int, default=5, help="CUDA: rounds of every measurement, interleaved (median)")
    add_out_argument(parser, "bench_attention_host")
    args = parser.parse_args(argv)
    if not args.stub and not torch.cuda.is_available():
        raise ValueError("no CUDA device: use --stub to time the Python side with the launches stubbed out")
    if args.stub:
        os.environ["TRITON_INTERPRET"] = "1"  # before kernels imports triton's jit: tensors may stay on the CPU
    try:
        shape = tuple(int(x) for x in args.shape.split("/"))
        assert len(shape) == 5
    except (ValueError, AssertionError):
        raise ValueError(f"--shape={args.shape!r}: expected B/T/H/Hkv/D, five integers") from None
    kernels = [w for w in args.kernels.split(",") if w]
    for words in kernels:
        if any(w not in WORDS for w in words.split("/")) or words.count("/") > 1:
            raise ValueError(f"--kernels: {words!r} is not auto, triton, gluon or a forward/backward pair of them")
    out = console()
    device = torch.device("cpu" if args.stub else "cuda")
    rows = measure_stub(kernels) if args.stub else measure_gpu(shape, kernels, args.profile, args.rounds)
    result = {"meta": environment(device), "shape": dict(zip("B T H Hkv D".split(), shape)), "rows": rows}
    if args.stub:
        table = markdown_table(["call", "thread CPU us per forward+backward", "launches"],
                               [[n, f"{r['step_cpu_us']:.0f}", ", ".join(r["launches"])] for n, r in rows.items()])
    else:
        table = markdown_table(
            ["attention", "forward issue, idle GPU (us)", "forward issue (us)", "forward GPU (us)",
             "forward+backward issue, idle GPU (us)", "forward+backward issue (us)", "forward+backward wall (us)",
             "wall: SDPA / this", "kernel plan"],
            [[n, f"{r['forward_idle_issue_us']:.0f}", f"{r['forward_issue_us']:.0f}", f"{r['forward_gpu_us']:.0f}",
              f"{r['step_idle_issue_us']:.0f}", f"{r['step_issue_us']:.0f}", f"{r['step_wall_us']:.0f}",
              f"{r['wall_vs_sdpa']:.2f}", r["plan"] or "-"] for n, r in rows.items()])
    out.print(table)
    if not args.stub:
        ratios = markdown_table(
            ["attention", "forward issue / SDPA's", "forward+backward issue / SDPA's", "wall / SDPA's",
             "targets (issue)"],
            [[n, f"{r['vs_sdpa']['forward_issue_us']:.2f}", f"{r['vs_sdpa']['step_issue_us']:.2f}",
              f"{r['vs_sdpa']['step_wall_us']:.2f}",
              "-" if n == "sdpa-default" else ", ".join(
                  f"{'met' if r['vs_sdpa'][key] <= bound else 'missed'} ({bound:.2f})"
                  for key, bound in ISSUE_TARGETS.items())] for n, r in rows.items()])
        out.print("\nEach time over SDPA's in the same round, median over rounds (targets as ratios: "
                  f"forward issue <= {ISSUE_TARGETS['forward_issue_us']:.2f}, forward+backward issue <= "
                  f"{ISSUE_TARGETS['step_issue_us']:.2f}):\n")
        out.print(ratios)
        table += "\nEach time over SDPA's in the same round, median over rounds:\n\n" + ratios
    if args.out:
        write_json(args.out / "attention_host.json", result)
        write_text(args.out / "attention_host.md", table + "\n")
    return result


if __name__ == "__main__":
    run_cli(main)
