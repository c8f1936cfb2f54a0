"""Load balance of the context-parallel ring under document masks, counted on the CPU (no GPU).

    python scripts/bench/bench_ring_balance.py --out benchmarks/parallel   # ~1 minute: ring_balance_cpu.{json,md}
    python scripts/bench/bench_ring_balance.py --smoke              # tiny windows, plumbing only

Each CP rank computes attention for its own queries, so a step of the ring takes as long as its
busiest rank. For packed windows of 64K, 128K and 1M tokens and C = 2, 4, 8 ranks this counts,
from the ring's own plan (model.ring_attention.masked_steps, the blocks it would launch), each
rank's attention work in two measures and reports the busiest rank over the mean:

- pairs: the (query, key) pairs the mask allows, what an ideal kernel computes;
- tiles: the 128 x 64 tiles our forward kernel visits in the blocks the plan launches (from each
  query tile's first row's first key to its last row's last, as kernels/tiles.py bounds them);

for the zig-zag split (chunks i and 2C-1-i) and for the balanced layout context_parallel_batch
uses with documents (model.cp_layout). Also the share of ring steps skipped (no visible key).
Mixes: docs-2k (documents of 2,048 tokens), docs-mixed (benchmarks/attention/document_mask_h200.md's
log-normal mix, median 700 tokens, over `--windows` draws), docs-mixed-w4k (the same with
attention.window=4096). The zig-zag split is exactly even for docs-2k; for the mix it is not.

GPU tokens/s of the same layouts need the 2-GPU host:
`torchrun --nproc-per-node 2 scripts/bench/bench_ring_attention.py --mask docs-mixed --lengths 131072,1048576`.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/, for _common (which puts the repo root first)
import _common  # noqa: F401  (puts the repo root on sys.path)
import torch

from _common import (add_out_argument, environment, markdown_table, require_positive, run_cli, tokens_label, write_json,
                     write_text)
from bench_document_mask import mixed_lengths
from kernels.masks import document_bounds
from model.cp_layout import balanced_layout, imbalance, visible_keys, zigzag_layout
from model.ring_attention import masked_steps

LENGTHS = (65536, 131072, 1048576)
SIZES = (2, 4, 8)
MIXES = ("docs-2k", "docs-mixed", "docs-mixed-w4k")
BLOCK_M, BLOCK_N = 128, 64   # the forward's default tiles at head dim 64 (kernels/tuning.py)
SMOKE = dict(lengths=(1024,), sizes=(2, 4), windows=2, block=(16, 16))


def document_lengths(mix: str, seq_len: int, seed: int) -> list[int]:
    if mix == "docs-2k":
        return [2048] * (seq_len // 2048) + ([seq_len % 2048] if seq_len % 2048 else [])
    # the benchmark's mix at 64K; longer windows keep its median (it scales with the window otherwise)
    lengths = mixed_lengths(seq_len, seed=seed, median=700.0 * 65536 / max(seq_len, 65536))
    lengths[-1] -= sum(lengths) - seq_len   # its last document may overshoot the window by < 16
    return lengths


def tiles_visited(step, block_m: int, block_n: int) -> int:
    """Forward tiles of one launched block, summed over its batch rows (1 here)."""
    rows, cols = step.rows.stop - step.rows.start, step.cols.stop - step.cols.start
    if step.key_bounds is None:
        return math.ceil(rows / block_m) * math.ceil(cols / block_n)
    lo, hi = step.key_bounds[0, 0].long(), step.key_bounds[0, 1].long()
    first = torch.arange(0, rows, block_m)
    last = torch.clamp(first + block_m - 1, max=rows - 1)
    start = lo[first] // block_n * block_n
    return int(torch.clamp(torch.div(hi[last] - start + block_n - 1, block_n, rounding_mode="floor"), min=0).sum())


def layout_costs(layout, starts, window, block) -> dict:
    """Each rank's allowed pairs and visited tiles, and how many of its steps are skipped."""
    work = visible_keys(starts, starts.shape[1], window)
    tiles, skipped = [], 0
    for rank in range(layout.size):
        steps = masked_steps(layout, rank, starts, window, "cpu")
        skipped += sum(step is None for step in steps)
        tiles.append(sum(tiles_visited(step, *block) for step in steps if step is not None))
    return {"pairs": imbalance(layout, work), "tiles": max(tiles) * len(tiles) / sum(tiles),
            "skipped": skipped / layout.size ** 2}


def measure(mix: str, seq_len: int, size: int, windows: int, block) -> dict:
    window = 4096 if mix.endswith("w4k") else None
    draws = 1 if mix == "docs-2k" else windows
    per_layout = {"zigzag": [], "balanced": []}
    for seed in range(draws):
        lengths = document_lengths(mix, seq_len, seed)
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
        starts = document_bounds(ids)[:, 0].long()
        balanced = balanced_layout(visible_keys(starts, seq_len, window), size)
        for name, layout in (("zigzag", zigzag_layout(seq_len, size)), ("balanced", balanced)):
            per_layout[name].append(layout_costs(layout, starts, window, block))
    row = {"mix": mix, "tokens": seq_len, "context_parallel": size, "window": window, "draws": draws}
    for name, costs in per_layout.items():
        row[name] = {f"{key}_{stat}": fn(c[key] for c in costs) for key in ("pairs", "tiles", "skipped")
                     for stat, fn in (("mean", lambda xs: sum(xs) / draws), ("max", max))}
    return row


def write_outputs(stem: Path, report: dict) -> None:
    write_json(stem.with_suffix(".json"), report)
    meta = report["metadata"]
    rows = [[r["mix"], tokens_label(r["tokens"]), r["context_parallel"], r["draws"],
             *(f"{r[layout][f'{key}_mean']:.3f} / {r[layout][f'{key}_max']:.3f}"
               for layout in ("zigzag", "balanced") for key in ("pairs", "tiles")),
             f"{r['zigzag']['skipped_mean']:.0%}", f"{r['balanced']['skipped_mean']:.0%}"] for r in report["rows"]]
    bm, bn = report["block"]
    write_text(stem.with_suffix(".md"), (
        "# Context-parallel load balance under document masks (work counts, CPU)\n\n"
        f"{meta['date']}, commit {meta['git_commit']}, torch {meta['torch']}, `{meta['command']}`.\n"
        "Busiest rank's attention work over the mean (mean / worst over the draws of the mix): "
        f"allowed (query, key) pairs, and {bm} x {bn} forward tiles visited in the blocks the ring "
        "launches; and the share of ring steps skipped (their K/V hold no key a local query sees). "
        "Zig-zag: rank i holds chunks i and 2C-1-i; balanced: the layout context_parallel_batch "
        "uses with documents (model/cp_layout.py). Counted from model.ring_attention.masked_steps; "
        "no GPU involved.\n\n"
        + markdown_table(["mix", "T", "C", "draws", "zig-zag pairs", "zig-zag tiles", "balanced pairs",
                          "balanced tiles", "zig-zag skipped", "balanced skipped"], rows)))


def main(argv: list[str] | None = None) -> dict:
    parser = _common.argument_parser(__doc__)
    parser.add_argument("--windows", type=int, default=20, help="draws of the log-normal mix per setting")
    parser.add_argument("--smoke", action="store_true", help="tiny windows: plumbing only")
    add_out_argument(parser, "bench_ring_balance")
    args = parser.parse_args(argv)
    require_positive(args, "windows")
    lengths, sizes, windows, block = LENGTHS, SIZES, args.windows, (BLOCK_M, BLOCK_N)
    if args.smoke:
        lengths, sizes, windows, block = SMOKE["lengths"], SMOKE["sizes"], SMOKE["windows"], SMOKE["block"]
    report = {"metadata": environment(torch.device("cpu")), "block": list(block), "rows": []}
    for mix in MIXES:
        for seq_len in lengths:
            for size in sizes:
                report["rows"].append(measure(mix, seq_len, size, windows, block))
                print(report["rows"][-1], flush=True)
    write_outputs(args.out / "ring_balance_cpu", report)
    return report


if __name__ == "__main__":
    run_cli(main)
