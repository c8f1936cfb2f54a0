"""Host time of one eager forward+backward of our attention: what a small call cannot hide.

    python scripts/bench_attention_host.py            # CUDA: gpt2-small's heads, B=16, T=1K, both backwards
    python scripts/bench_attention_host.py --stub     # any machine: every Triton launch replaced by a no-op

At gpt2-small's attention with T = 1K the GPU needs ~0.39 ms per forward+backward, and the call took
~1.1-1.4 ms on the H200's host (kernels/NOTES.md): the host bounds it. This times the Python side.

- CUDA: back-to-back eager calls on q, k, v viewed from one fused projection (as the model passes
  them), no synchronisation inside the loop; while the host is the bottleneck, wall time per call is
  host time per call. Then cProfile over the same calls: the functions that spend it.
- --stub: the jitted kernels' launch (`run`) does nothing, the autotuners get the GPU's candidate
  lists and a cache that always hits, so their per-call key work runs as on a GPU; tiny CPU tensors.
  What remains is our Python, the autograd Function and the autotuner wrapper: thread CPU time per
  call (minimum over 40 batches, robust to a shared machine), and the number of Python-level and C
  calls one forward+backward makes, against the same autograd graph around a no-op (q * 1.0).
Results print only; kernels/NOTES.md records them.
"""
from __future__ import annotations

import os
import sys
import time

import _common  # noqa: F401  (puts the repo root on sys.path)
import torch

from _common import console, run_cli


def fused_views(B, N, H, Hkv, D, device, dtype):
    qkv = torch.randn(B, N, (H + 2 * Hkv) * D, device=device, dtype=dtype, requires_grad=True)
    q, k, v = (t.unflatten(-1, (-1, D)) for t in qkv.split([H * D, Hkv * D, Hkv * D], -1))
    return qkv, (q, k, v), torch.randn(B, N, H, D, device=device, dtype=dtype)


def stub_launches() -> list[str]:
    """Make every kernel launch a no-op that records the kernel's name; returns that record."""
    import triton
    from triton.runtime.autotuner import Autotuner

    from kernels import flash_bwd, flash_fwd

    launched: list[str] = []

    class AlwaysHit(dict):
        def __init__(self, config):
            super().__init__()
            self.config = config

        def __contains__(self, key):
            return True

        def __getitem__(self, key):
            return self.config

    for module in (flash_fwd, flash_bwd):
        for name, obj in vars(module).items():
            if not name.endswith("_kernel"):
                continue
            target = obj.fn if isinstance(obj, Autotuner) else obj
            target.run = lambda *a, _name=name, **kw: launched.append(_name)
            if isinstance(obj, Autotuner):  # four GPU-sized candidates, as on a GPU
                obj.configs = [triton.Config(dict(c.kwargs), num_warps=c.num_warps, num_stages=c.num_stages)
                               for c in obj.configs] * 4
                obj.cache = AlwaysHit(obj.configs[0])
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


def count_calls(fn) -> int:
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def wall_time_per_call(fn, calls: int = 200) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - began) / calls * 1e6


def main(argv: list[str] | None = None) -> dict:
    parser = _common.argument_parser(__doc__)
    parser.add_argument("--stub", action="store_true", help="no-op launches on tiny CPU tensors (no GPU needed)")
    parser.add_argument("--shape", default="16/1024/12/12/64", help="B/T/H/Hkv/D (CUDA; default gpt2-small at 1K)")
    parser.add_argument("--profile", type=int, default=15, help="cProfile lines to print (0: none)")
    args = parser.parse_args(argv)
    if not args.stub and not torch.cuda.is_available():
        raise ValueError("no CUDA device: use --stub to time the Python side with the launches stubbed out")
    if args.stub:
        os.environ["TRITON_INTERPRET"] = "1"  # before kernels imports triton's jit: tensors may stay on the CPU
    try:
        B, N, H, Hkv, D = (int(x) for x in args.shape.split("/"))
    except ValueError:
        raise ValueError(f"--shape={args.shape!r}: expected B/T/H/Hkv/D, five integers") from None
    from kernels import flash_attention

    out = console()
    launched = stub_launches() if args.stub else []
    device, dtype = ("cpu", torch.float32) if args.stub else ("cuda", torch.bfloat16)
    if args.stub:
        B, N = 1, 16
    leaf, (q, k, v), dout = fused_views(B, N, H, Hkv, D, device, dtype)
    results = {}
    for deterministic in (True, False):
        def step():
            return torch.autograd.grad(flash_attention(q, k, v, causal=True, deterministic=deterministic), leaf, dout)
        label = "deterministic" if deterministic else "atomic"
        if args.stub:
            launched.clear()
            step()
            one_call = list(launched)
            results[label] = {"us": cpu_time_per_call(step), "calls": count_calls(step), "launches": one_call}
            out.print(f"{label}: {results[label]['us']:.0f} us of thread CPU time per forward+backward, "
                      f"{results[label]['calls']} Python/C calls; launches {', '.join(results[label]['launches'])}")
        else:
            results[label] = {"us": wall_time_per_call(step)}
            out.print(f"{label}: {results[label]['us']:.0f} us wall per back-to-back forward+backward "
                      f"(B={B} T={N} H={H}/{Hkv} D={D})")
        if args.profile:
            import cProfile
            import pstats
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(100):
                step()
            profiler.disable()
            pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(args.profile)

    def same_graph():  # the views' and the split's autograd work around a no-op attention
        return torch.autograd.grad(q * 1.0, leaf, dout)
    if args.stub:
        results["graph only"] = {"us": cpu_time_per_call(same_graph), "calls": count_calls(same_graph)}
        out.print(f"the same autograd graph around q * 1.0: {results['graph only']['us']:.0f} us, "
                  f"{results['graph only']['calls']} calls")
    return results


if __name__ == "__main__":
    run_cli(main)
