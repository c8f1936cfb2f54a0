"""Where a kernel's warps wait, per loop body and per instruction, from Nsight Compute's source page.

    ncu -i bwd.ncu-rep --page source --csv --print-source sass > bwd_sass.csv
    python scripts/kernel_dev/ncu_stalls.py bwd_sass.csv                  # per loop body (execution count)
    python scripts/kernel_dev/ncu_stalls.py bwd_sass.csv --body 190464    # that body, instruction by instruction

The profiler samples each warp's state every few thousand cycles; an instruction's samples are the
time warps spent at it (waiting or issuing), by reason. Instructions that run equally often belong
to one loop body (in the Gluon backward: the unmasked step, executed steps x 8 consumer warps; the
masked step; the producer's loop), so grouping by execution count splits the time between bodies
without reading the SASS' branches. A body's listing prints, in program order, every instruction with
at least --min samples and every wgmma, wait and barrier, with the samples since the last line printed,
so the step reads as a timeline: issue, wait, softmax, wait, dS, barrier, the second matmuls, their wait.
"""
from __future__ import annotations

import collections
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/, for _common (which puts the repo root first)
from _common import argument_parser, existing_file, run_cli  # noqa: E402

SAMPLES = "Warp Stall Sampling (All Samples)"
MARKS = ("HGMMA", "DEPBAR", "BAR.SYNC", "SYNCS")


def read(path: Path) -> list[dict]:
    """The instruction rows of an `ncu --page source --csv --print-source sass` export (one kernel)."""
    rows = list(csv.reader(path.open()))
    header = next(r for r in rows if "Address" in r and "Source" in r)
    start = rows.index(header) + 1
    return [dict(zip(header, r)) for r in rows[start:] if len(r) >= len(header)]


def samples(row: dict) -> int:
    return int(row[SAMPLES] or 0)


def reasons(row: dict) -> collections.Counter:
    return collections.Counter({k[len("stall_"):]: int(row[k] or 0) for k in row
                                if k.startswith("stall_") and "Not Issued" not in k})


def opcode(source: str) -> str:
    words = source.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def bodies(rows: list[dict], top: int) -> None:
    total = sum(map(samples, rows))
    groups = collections.defaultdict(list)
    for r in rows:
        groups[r["Instructions Executed"]].append(r)
    print(f"{'executed':>10} {'instr':>6} {'samples':>8} {'share':>6}  top reasons")
    sums = {executed: sum(map(samples, group)) for executed, group in groups.items()}
    for executed in sorted(sums, key=sums.get, reverse=True)[:top]:
        group, count = groups[executed], sums[executed]
        why = sum((reasons(r) for r in group), collections.Counter())
        print(f"{executed:>10} {len(group):>6} {count:>8} {100 * count / total:5.1f}%  "
              + ", ".join(f"{k} {100 * v / max(count, 1):.0f}%" for k, v in why.most_common(5)))


def timeline(rows: list[dict], executed: str, least: int) -> None:
    body = [r for r in rows if r["Instructions Executed"] == executed]
    ops = collections.Counter(opcode(r["Source"]) for r in body)
    print(f"{len(body)} instructions: " + ", ".join(f"{k} {v}" for k, v in ops.most_common(12)))
    since, skipped, running = 0, 0, 0
    for r in body:
        count = samples(r)
        since += count
        running += count
        skipped += 1
        source = r["Source"].strip()
        if count >= least or any(mark in source for mark in MARKS):
            why = ", ".join(f"{k} {v}" for k, v in reasons(r).most_common(2) if v)
            print(f"{running:>8} {since:>7} (+{skipped:>3})  {source[:70]:70s} {why}")
            since, skipped = 0, 0


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("csv", type=existing_file("csv"), help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--body", help="the execution count of the loop body to list instruction by instruction")
    parser.add_argument("--min", type=int, default=150, help="list instructions with at least this many samples")
    parser.add_argument("--top", type=int, default=8, help="loop bodies listed")
    args = parser.parse_args(argv)
    rows = read(args.csv)
    if args.body:
        timeline(rows, args.body, args.min)
    else:
        bodies(rows, args.top)


if __name__ == "__main__":
    run_cli(main)
