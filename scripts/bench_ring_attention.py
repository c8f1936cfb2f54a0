"""Ring attention speed and memory across the GPUs of one host, against one GPU.

    torchrun --nproc-per-node 2 scripts/bench_ring_attention.py             # 128K .. 1M tokens
    torchrun --nproc-per-node 2 scripts/bench_ring_attention.py --lengths 1048576
    torchrun --nproc-per-node 2 scripts/bench_ring_attention.py --smoke     # CPU (gloo) plumbing check

gpt2-small's attention (12 heads of 64, batch 1, causal, bf16). Per length, every rank times one
forward+backward of ring attention over its two chunks (all ranks step together: a fixed number
of iterations between barriers, the slowest rank's time counts); rank 0 then times our kernel on
the whole sequence alone, and the ring's time over it is reported beside the ideal 1/C. Peak
memory is the largest rank's. A ring that runs out of memory ends the run (one rank failing
alone would leave the others waiting); the lengths measured before are kept; one GPU running
out of memory is recorded as a result. Writes <out>/ring_attention_<gpu>_x<C>.json and .md, rewritten per length.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import _common  # noqa: F401  (puts the repo root on sys.path)
import torch
import torch.distributed as dist

from _common import (add_out_argument, device_slug, environment, error_text, human_bytes, markdown_table, run_cli,
                     tokens_label, write_json, write_text)
from _memory import is_oom, release_memory
from kernels import attention_reference, flash_attention
from model.ring_attention import ring_attention
from training.distributed import close_distributed

HEADS, HEAD_DIM = 12, 64
LENGTHS = (131072, 262144, 524288, 1048576)
SMOKE_LENGTHS = (64, 128)
WARMUP, ITERS = 2, 5


def timed_step(attention, shape, device, dtype, iters) -> tuple[float, int]:
    """(ms per forward+backward, slowest over the group; peak bytes of one step, largest rank)."""
    q, k, v, dout = (torch.randn(shape, device=device, dtype=dtype) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def step():
        torch.autograd.grad(attention(q, k, v), (q, k, v), dout)

    for _ in range(WARMUP):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    began = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    ms = (time.perf_counter() - began) * 1e3 / iters
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return ms, peak


def measure(seq_len, group_size, device, dtype, block, iters) -> dict:
    row = {"tokens": seq_len}
    ms, peak = timed_step(lambda q, k, v: ring_attention(q, k, v, causal=True, block=block),
                          (1, seq_len // group_size, HEADS, HEAD_DIM), device, dtype, iters)
    release_memory(device)
    stats = torch.tensor([ms, peak], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    row.update(ring_ms=stats[0].item(), ring_peak_bytes=int(stats[1].item()))
    if dist.get_rank() == 0:
        single = flash_attention if block == "flash" else attention_reference
        try:
            row["one_gpu_ms"], row["one_gpu_peak_bytes"] = timed_step(
                lambda q, k, v: single(q, k, v, causal=True), (1, seq_len, HEADS, HEAD_DIM), device, dtype, iters)
            row["ring_over_one_gpu"] = row["ring_ms"] / row["one_gpu_ms"]
        except Exception as exc:  # noqa: BLE001 -- out of memory on one GPU is a result
            if not is_oom(exc):
                raise
            row["one_gpu_ms"] = error_text(exc)
        release_memory(device)
    dist.barrier()
    return row


def write_outputs(stem: Path, report: dict) -> None:
    write_json(stem.with_suffix(".json"), report)
    meta, size = report["metadata"], report["group_size"]
    rows = [[tokens_label(r["tokens"]), f"{r['ring_ms']:.1f}",
             f"{r['one_gpu_ms']:.1f}" if isinstance(r.get("one_gpu_ms"), float) else r.get("one_gpu_ms", "-"),
             f"{r['ring_over_one_gpu']:.3f}" if "ring_over_one_gpu" in r else "-", f"{1 / size:.3f}",
             human_bytes(r["ring_peak_bytes"])] for r in report["rows"]]
    write_text(stem.with_suffix(".md"), (
        f"# Ring attention on {size} x {meta['device']}\n\n"
        f"{meta['date']}, commit {meta['git_commit']}, torch {meta['torch']}, triton {meta['triton']}.\n"
        f"Causal, batch 1, {HEADS} heads of {HEAD_DIM}, {report['dtype']}, one forward+backward.\n\n"
        + markdown_table(["tokens", f"ring on {size} (ms)", "one GPU (ms)", "ring / one", "ideal",
                          "ring peak per rank"], rows)))


def main(argv: list[str] | None = None) -> dict:
    parser = _common.argument_parser(__doc__)
    parser.add_argument("--lengths", default=None, help="comma-separated whole-sequence token counts")
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny lengths: plumbing only")
    add_out_argument(parser, "bench_ring_attention")
    args = parser.parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        raise ValueError("run under torchrun, e.g. torchrun --nproc-per-node 2 scripts/bench_ring_attention.py")
    lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else (SMOKE_LENGTHS if args.smoke else LENGTHS)
    size = int(os.environ["WORLD_SIZE"])
    bad = [n for n in lengths if n <= 0 or n % (2 * size)]
    if bad:
        raise ValueError(f"--lengths: {bad[0]} is not a positive multiple of 2 x {size} ranks")
    if args.smoke:
        device, dtype, block, iters = torch.device("cpu"), torch.float32, "naive", 1
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    elif not torch.cuda.is_available():
        raise ValueError("no CUDA device: ring attention figures need GPUs; use --smoke for a CPU plumbing check")
    else:
        device, dtype, block, iters = torch.device("cuda", int(os.environ["LOCAL_RANK"])), torch.bfloat16, "flash", ITERS
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    try:
        report = {"metadata": environment(device), "group_size": size, "dtype": str(dtype).removeprefix("torch."),
                  "block": block, "rows": []}
        stem = args.out / f"ring_attention_{device_slug(device)}_x{size}"
        for seq_len in lengths:
            report["rows"].append(measure(seq_len, size, device, dtype, block, iters))
            if dist.get_rank() == 0:
                write_outputs(stem, report)
                print(report["rows"][-1], flush=True)
        return report
    finally:
        close_distributed()


if __name__ == "__main__":
    run_cli(main)
