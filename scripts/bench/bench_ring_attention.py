"""Ring attention speed and memory across the GPUs of one host, against one GPU.

    torchrun --nproc-per-node 2 scripts/bench/bench_ring_attention.py             # 128K .. 1M tokens
    torchrun --nproc-per-node 2 scripts/bench/bench_ring_attention.py --lengths 1048576
    torchrun --nproc-per-node 2 scripts/bench/bench_ring_attention.py --smoke     # CPU (gloo) plumbing check
    # packed documents and windows against causal, at 128K and 1M (ring_attention_<gpu>_x2_masked.*):
    torchrun --nproc-per-node 2 scripts/bench/bench_ring_attention.py --lengths 131072,1048576 \
        --masks causal,docs-2k,docs-mixed,docs-mixed-w4k --out benchmarks/parallel

gpt2-small's attention (12 heads of 64, batch 1, causal, bf16). Per length, every rank times one
forward+backward of ring attention over its two chunks (all ranks step together: a fixed number
of iterations between barriers, the slowest rank's time counts); rank 0 then times our kernel on
the whole sequence alone, and the ring's time over it is reported beside the ideal 1/C. Peak
memory is the largest rank's. A ring that runs out of memory ends the run (one rank failing
alone would leave the others waiting); the lengths measured before are kept; one GPU running
out of memory is recorded as a result. Writes <out>/ring_attention_<gpu>_x<C>.json and .md, rewritten per length.

`--masks`: besides plain causal, packed documents (the mixes of scripts/bench/bench_ring_balance.py:
docs-2k, docs-mixed, docs-mixed-w4k with attention.window=4096) on the layout
context_parallel_batch picks for them, against one GPU with the same mask; each row also gives
tokens/s of the ring, the layout's imbalance (busiest rank's allowed pairs over the mean) and the
ring steps skipped. Any mask but causal alone writes ring_attention_<gpu>_x<C>_masked.*.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/, for _common (which puts the repo root first)
import _common  # noqa: F401  (puts the repo root on sys.path)
import torch
import torch.distributed as dist

from _common import (add_out_argument, device_slug, environment, error_text, human_bytes, markdown_table, run_cli,
                     tokens_label, write_json, write_text)
from _memory import is_oom, release_memory
from bench_ring_balance import document_lengths
from kernels import attention_reference, flash_attention
from model.context_parallel import context_parallel_batch, document_layout
from model.cp_layout import imbalance, visible_keys, zigzag_layout
from model.ring_attention import STEP_COUNTS, ring_attention
from training.parallel.distributed import close_distributed

HEADS, HEAD_DIM = 12, 64
LENGTHS = (131072, 262144, 524288, 1048576)
SMOKE_LENGTHS = (64, 128)
WARMUP, ITERS = 2, 5
MASKS = ("causal", "docs-2k", "docs-mixed", "docs-mixed-w4k", "window-4k")


def mask_inputs(mask: str, seq_len: int):
    """(whole-window document ids (1, T) on the CPU or None, window or None) of a mask."""
    window = min(4096, seq_len // 4) if mask.endswith("4k") else None
    if not mask.startswith("docs"):
        return None, window
    lengths = document_lengths(mask.removesuffix("-w4k"), seq_len, seed=0)
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None], window


def layout_imbalance(ids, window, seq_len: int, size: int) -> float:
    if ids is None:
        return imbalance(zigzag_layout(seq_len, size), visible_keys(None, seq_len, window))
    layout, starts = document_layout(ids, size, window)
    return imbalance(layout, visible_keys(starts, seq_len, window))


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


def measure(seq_len, group_size, device, dtype, block, iters, mask="causal") -> dict:
    ids, window = mask_inputs(mask, seq_len)
    masks = {} if window is None else {"window": window}
    local = {}
    if ids is not None:   # the local ids carry the batch's layout and steps to the ring
        _, _, kwargs = context_parallel_batch(torch.zeros(1, seq_len, dtype=torch.long, device=device), None,
                                              document_ids=ids, window=window)
        local["document_ids"] = kwargs["document_ids"]
    row = {"mask": mask, "tokens": seq_len, "window": window,
           "imbalance": layout_imbalance(ids, window, seq_len, group_size)}
    before = dict(STEP_COUNTS)
    ms, peak = timed_step(lambda q, k, v: ring_attention(q, k, v, causal=True, block=block, **masks, **local),
                          (1, seq_len // group_size, HEADS, HEAD_DIM), device, dtype, iters)
    calls = WARMUP + iters
    row["steps_skipped_per_call"] = (STEP_COUNTS["skipped"] - before.get("skipped", 0)) / calls
    release_memory(device)
    stats = torch.tensor([ms, peak], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    row.update(ring_ms=stats[0].item(), ring_peak_bytes=int(stats[1].item()))
    row["ring_tokens_per_s"] = seq_len / row["ring_ms"] * 1e3
    if dist.get_rank() == 0:
        single = flash_attention if block == "flash" else attention_reference
        if ids is not None:
            masks["document_ids"] = ids.to(device)
        try:
            row["one_gpu_ms"], row["one_gpu_peak_bytes"] = timed_step(
                lambda q, k, v: single(q, k, v, causal=True, **masks), (1, seq_len, HEADS, HEAD_DIM), device, dtype,
                iters)
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
    rows = [[r.get("mask", "causal"), tokens_label(r["tokens"]), f"{r['ring_ms']:.1f}",
             f"{r['ring_tokens_per_s'] / 1e3:,.0f}K" if "ring_tokens_per_s" in r else "-",
             f"{r['one_gpu_ms']:.1f}" if isinstance(r.get("one_gpu_ms"), float) else r.get("one_gpu_ms", "-"),
             f"{r['ring_over_one_gpu']:.3f}" if "ring_over_one_gpu" in r else "-", f"{1 / size:.3f}",
             f"{r['imbalance']:.3f}" if "imbalance" in r else "-",
             f"{r['steps_skipped_per_call']:.1f}" if "steps_skipped_per_call" in r else "-",
             human_bytes(r["ring_peak_bytes"])] for r in report["rows"]]
    write_text(stem.with_suffix(".md"), (
        f"# Ring attention on {size} x {meta['device']}\n\n"
        f"{meta['date']}, commit {meta['git_commit']}, torch {meta['torch']}, triton {meta['triton']}.\n"
        f"Causal, batch 1, {HEADS} heads of {HEAD_DIM}, {report['dtype']}, one forward+backward; "
        "masks as in scripts/bench/bench_ring_balance.py (imbalance: busiest rank's allowed pairs over the "
        "mean, on the ring's layout; skipped steps: of rank 0's C ring steps per call, those with no key to see).\n\n"
        + markdown_table(["mask", "tokens", f"ring on {size} (ms)", "ring tokens/s", "one GPU (ms)", "ring / one",
                          "ideal", "imbalance", "skipped steps", "ring peak per rank"], rows)))


def main(argv: list[str] | None = None) -> dict:
    parser = _common.argument_parser(__doc__)
    parser.add_argument("--lengths", default=None, help="comma-separated whole-sequence token counts")
    parser.add_argument("--masks", default="causal", help=f"comma-separated, of {', '.join(MASKS)}")
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny lengths: plumbing only")
    add_out_argument(parser, "bench_ring_attention")
    args = parser.parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        raise ValueError("run under torchrun, e.g. torchrun --nproc-per-node 2 scripts/bench/bench_ring_attention.py")
    lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else (SMOKE_LENGTHS if args.smoke else LENGTHS)
    size = int(os.environ["WORLD_SIZE"])
    bad = [n for n in lengths if n <= 0 or n % (2 * size)]
    if bad:
        raise ValueError(f"--lengths: {bad[0]} is not a positive multiple of 2 x {size} ranks")
    masks = args.masks.split(",")
    if any(m not in MASKS for m in masks):
        raise ValueError(f"--masks: {next(m for m in masks if m not in MASKS)!r} is not one of {', '.join(MASKS)}")
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
        stem = args.out / f"ring_attention_{device_slug(device)}_x{size}{'' if masks == ['causal'] else '_masked'}"
        for seq_len in lengths:
            for mask in masks:
                report["rows"].append(measure(seq_len, size, device, dtype, block, iters, mask))
                if dist.get_rank() == 0:
                    write_outputs(stem, report)
                    print(report["rows"][-1], flush=True)
        return report
    finally:
        close_distributed()


if __name__ == "__main__":
    run_cli(main)
