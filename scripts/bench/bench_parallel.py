"""One GPU against N: tokens/s of DDP and FSDP2, loss curves from one seed, gpt-1b memory per GPU.

    python scripts/bench/bench_parallel.py --out benchmarks/parallel   # about 7 minutes on 2 H200s (estimated)
    python scripts/bench/bench_parallel.py --out /tmp/x --steps 40 --only throughput trainer.seq_len=1024

The targets, each one call (the global batch stays the same on 1 and N GPUs; grad_accum must be
a multiple of N):

    # gpt2-small: DDP >= 1.9x one GPU on 2 GPUs, >= 0.9x linear on 4 and 8
    python scripts/bench/bench_parallel.py --out benchmarks/parallel --only throughput --gpus 2
    python scripts/bench/bench_parallel.py --out benchmarks/parallel --only throughput --gpus 4 trainer.grad_accum=8
    python scripts/bench/bench_parallel.py --out benchmarks/parallel --only throughput --gpus 8 trainer.grad_accum=8
    # gpt-1b: FSDP2 >= 0.95x DDP tokens/s and >= 1.85x one GPU on 2 GPUs
    python scripts/bench/bench_parallel.py --out benchmarks/parallel --only throughput --gpus 2 --name parallel_h200_gpt1b \
        model=gpt-1b attention=sdpa trainer.batch_size=1 trainer.grad_accum=8

1. Throughput and loss: train.py three times from the same seed on the same global batch
   (default: experiment=gpt2-small-4k at T=4096, compiled, batch 4 x grad_accum 2 = 32K tokens per
   step): on 1 GPU, then `torchrun --nproc_per_node=2` with trainer.parallel=ddp and =fsdp. tokens/s
   is the median of the logged intervals after the first `--warm` steps (compilation).
2. Memory: `gpt-1b` at T=4096 (batch 1 per rank, not compiled) under DDP and FSDP2 on 2 GPUs, a
   few steps each through this script's worker mode (the Trainer itself, under torchrun); the peak
   allocated memory of every rank.

Where one call may take at most ~10 minutes, run the parts apart: `--only throughput`, then
`--only memory` (results parallel_<gpu>_throughput.* and parallel_<gpu>_memory.*).

Extra arguments are Hydra overrides for the throughput runs. Writes <out>/<name>.json (all rows,
settings, environment), .md (the tables) and .png (the loss curves and their differences), rewritten
after every run, so a run cut short keeps what it measured. NVLink multicast stays off
(NCCL_NVLS_ENABLE=0 and friends are set for every run).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/, for _common (which puts the repo root first)
import _common  # noqa: F401  (puts the repo root on sys.path)
import torch

from _common import (REPO_ROOT, device_slug, environment, markdown_table, new_figure, run_cli, save_figure,
                     write_json, write_text)

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# GPT-2's 50,304-row head, as measured in benchmarks/parallel/parallel_h200_*.md (the preset now sizes it from its tokenizer)
THROUGHPUT = ["experiment=gpt2-small-4k", "tokenizer=bytes", "model.vocab_size=50304", "trainer.batch_size=4",
              "trainer.grad_accum=2", "trainer.log_every=5", "trainer.eval_every=40", "trainer.eval_batches=8",
              "trainer.ckpt_every=0", "trainer.keep_ckpts=1", "trainer.progress=false", "logger=none"]
MEMORY = ["model=gpt-1b", "attention=sdpa", "trainer.seq_len=4096", "trainer.batch_size=1", "trainer.grad_accum=2",
          "trainer.compile=false", "trainer.progress=false", "logger=none"]


def setups(gpus: int) -> list[tuple[str, int, str]]:
    """(name, processes, trainer.parallel) of the throughput runs: one GPU, then DDP and FSDP2 on `gpus`."""
    return [("1 GPU", 1, "ddp"), (f"{gpus} GPUs, DDP", gpus, "ddp"), (f"{gpus} GPUs, FSDP2", gpus, "fsdp")]


def run_env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", **NO_MULTICAST}


def launcher(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def run(command: list[str], timeout: float, log: Path) -> int:
    print("+", " ".join(command[1:]), flush=True)
    with open(log, "a") as out:
        try:
            return subprocess.run(command, cwd=REPO_ROOT, env=run_env(), stdout=out, stderr=subprocess.STDOUT,
                                  timeout=max(timeout, 1)).returncode
        except subprocess.TimeoutExpired:
            return 124


def summarize(rows: list[dict], warm: int) -> dict:
    """Median tokens/s and MFU over the logged intervals after `warm` steps, and the loss curve."""
    steady = [r for r in rows if r["step"] > warm]
    rate = statistics.median(r["tokens_per_s"] for r in steady) if steady else None
    return {"tokens_per_s": rate,
            "mfu": statistics.median(r["mfu"] for r in steady) if steady and "mfu" in steady[0] else None,
            "steps": [r["step"] for r in rows], "loss": [r["loss"] for r in rows],
            "val_loss": {r["step"]: r["val_loss"] for r in rows if "val_loss" in r},
            "tokens_per_step": rows[-1]["tokens"] // rows[-1]["step"] if rows else None}


def throughput(args, report: dict, save) -> None:
    from training.config import merge_overrides
    from training.run.metrics import MetricsFile

    overrides = merge_overrides(THROUGHPUT, [f"trainer.max_steps={args.steps}", f"seed={args.seed}"], args.overrides)
    report["settings"]["throughput_overrides"] = overrides
    for name, nproc, parallel in setups(args.gpus)[: 1 if args.gpus == 1 else 3]:
        run_dir = args.work / f"tp-{nproc}-{parallel}"
        began = time.perf_counter()
        status = run(launcher(nproc) + [str(REPO_ROOT / "train.py"), *merge_overrides(
            overrides, [f"trainer.parallel={parallel}", f"run.dir={run_dir}"])], args.deadline - time.monotonic(), args.log)
        metrics = run_dir / "metrics.jsonl"
        rows = MetricsFile.read(metrics) if metrics.exists() else []
        report["throughput"].append({"setup": name, "gpus": nproc, "parallel": parallel, "exit_status": status,
                                     "wall_s": time.perf_counter() - began, **summarize(rows, args.warm)})
        save()


def memory(args, report: dict, save) -> None:
    for parallel in ("ddp", "fsdp"):
        out = args.work / f"mem-{parallel}.json"
        overrides = MEMORY + [f"trainer.parallel={parallel}", f"run.dir={args.work / f'mem-{parallel}'}"]
        status = run(launcher(args.gpus) + [str(Path(__file__).resolve()), "--memory-worker", str(out),
                                            "--memory-steps", str(args.memory_steps), *overrides],
                     min(args.deadline - time.monotonic(), 240), args.log)
        entry = {"parallel": parallel, "gpus": args.gpus, "exit_status": status, "overrides": overrides}
        if out.exists():
            entry.update(json.loads(out.read_text()))
        report["memory"].append(entry)
        save()


def memory_worker(out: Path, steps: int, overrides: list[str]) -> None:
    """Under torchrun: the Trainer, `steps` optimizer steps, every rank's peak memory to `out`."""
    import torch.distributed as dist

    from training.config import compose
    from training.parallel.distributed import close_distributed
    from training.loop.trainer import Trainer

    trainer = Trainer(compose(overrides))
    try:
        torch.cuda.reset_peak_memory_stats()
        for _ in range(steps):
            loss, _ = trainer.train_step(trainer.next_batch)
        torch.cuda.synchronize()
        mine = {"rank": trainer.plan.env.rank, "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(), "loss": loss.item(),
                "num_params": trainer.cfg.run.num_params}
        ranks = [None] * trainer.plan.env.world_size
        if trainer.plan.env.enabled:
            dist.all_gather_object(ranks, mine)
        else:
            ranks = [mine]
        if trainer.plan.env.is_main:
            write_json(out, {"ranks": ranks})
    finally:
        close_distributed()


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f}"


def markdown(report: dict) -> str:
    env, tp = report["environment"], report["throughput"]
    base = next((r["tokens_per_s"] for r in tp if r["gpus"] == 1 and r["tokens_per_s"]), None)
    rows = [[r["setup"], f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else f"failed ({r['exit_status']})",
             f"{r['tokens_per_s'] / base:.2f}x" if base and r["tokens_per_s"] else "-",
             f"{r['mfu']:.1%}" if r["mfu"] else "-",
             f"{r['loss'][-1]:.4f}" if r["loss"] else "-",
             ", ".join(f"{s}: {v:.4f}" for s, v in r["val_loss"].items()) or "-"] for r in tp]
    mem_rows = [[m["parallel"], m["gpus"], m.get("ranks") and m["ranks"][0]["num_params"] or "-",
                 " / ".join(gib(r["peak_allocated_bytes"]) for r in m.get("ranks", [])) or f"failed ({m['exit_status']})",
                 " / ".join(gib(r["peak_reserved_bytes"]) for r in m.get("ranks", [])) or "-"]
                for m in report["memory"]]
    text = (f"# One GPU against {report['settings']['gpus']}: DDP and FSDP2\n\n{env['device']} x {report['settings']['gpus']}, {env['date']}, "
            f"torch {env['torch']}, triton {env['triton']}, commit {env['git_commit']}.\n\n"
            f"Throughput runs: `{' '.join(report['settings'].get('throughput_overrides', []))}`, the same seed and "
            f"global batch on 1 and {report['settings']['gpus']} GPUs; tokens/s counts every GPU, the median of the logged intervals after "
            f"step {report['settings']['warm']}; MFU is per GPU.\n\n"
            + markdown_table(["setup", "tokens/s", "vs 1 GPU", "MFU", "final loss", "val loss"], rows))
    if report["memory"]:
        text += (f"\nPeak memory per GPU (GiB, rank 0 / rank 1), {report['settings']['memory_steps']} optimizer steps "
                 f"of `{' '.join(MEMORY)}`:\n\n"
                 + markdown_table(["parallel", "GPUs", "parameters", "peak allocated", "peak reserved"], mem_rows))
    return text


def draw(report: dict, path: Path) -> None:
    tp = [r for r in report["throughput"] if r["loss"]]
    if not tp:
        return
    fig, axes = new_figure(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    curves, gap = axes[0][0], axes[1][0]
    base = tp[0]
    for r, style in zip(tp, ("-", "--", ":")):
        line, = curves.plot(r["steps"], r["loss"], style, lw=1.2, label=f"{r['setup']} (train)")
        val = r["val_loss"]
        curves.plot([int(s) for s in val], list(val.values()), "o", mfc="none", color=line.get_color())
        if r is not base and r["steps"] == base["steps"]:
            gap.plot(r["steps"], [abs(a - b) for a, b in zip(r["loss"], base["loss"])], style, lw=1,
                     color=line.get_color(), label=r["setup"])
    curves.set_ylabel("loss (nats)")
    curves.set_title(f"same seed and global batch; val loss as circles ({report['environment']['device']})",
                     fontsize=9)
    curves.legend(fontsize=8)
    gap.set_ylabel(f"|loss - {base['setup']}|")
    gap.set_xlabel("step")
    if gap.lines:
        gap.legend(fontsize=8)
    for ax in (curves, gap):
        ax.grid(alpha=0.3)
    save_figure(fig, path)


def main(argv: list[str]) -> None:
    parser = _common.argument_parser(__doc__)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the throughput runs")
    parser.add_argument("--out", type=Path, help="folder for the results (required)")
    parser.add_argument("--name", type=_common.file_stem, help="file stem (default parallel_<gpu>)")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warm", type=int, default=10, help="steps left out of tokens/s (compilation)")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--only", choices=["throughput", "memory"], help="run one part (default: both)")
    parser.add_argument("--budget-s", type=float, default=470, help="stop starting runs after this long")
    parser.add_argument("--work", type=Path, help="folder for the run dirs (default: a new temp folder)")
    parser.add_argument("--memory-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_worker:
        memory_worker(args.memory_worker, args.memory_steps, args.overrides)
        return
    if args.out is None:
        raise ValueError("--out is required: the folder for the results")
    for key in ("gpus", "steps", "memory_steps"):
        if getattr(args, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')}={getattr(args, key)}: must be at least 1")
    if not 0 <= args.warm < args.steps:
        raise ValueError(f"--warm={args.warm}: must lie in [0, --steps={args.steps})")
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.gpus:
        raise ValueError(f"needs {args.gpus} CUDA devices, torch sees {torch.cuda.device_count()}")
    args.deadline = time.monotonic() + args.budget_s
    args.work = args.work or Path(tempfile.mkdtemp(prefix="bench_parallel-"))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / (args.name or f"parallel_{device_slug(torch.device('cuda'))}" + (f"_{args.only}" if args.only else ""))
    args.log = stem.with_suffix(".log")
    report = {"environment": {**environment(torch.device("cuda")), "gpus": args.gpus, **NO_MULTICAST},
              "settings": {"gpus": args.gpus, "steps": args.steps, "warm": args.warm, "seed": args.seed,
                           "memory_steps": args.memory_steps},
              "throughput": [], "memory": []}

    def save() -> None:
        write_json(stem.with_suffix(".json"), report)
        write_text(stem.with_suffix(".md"), markdown(report))
        draw(report, stem.with_suffix(".png"))

    if args.only != "memory":
        throughput(args, report, save)
    if args.only != "throughput":
        memory(args, report, save)
    save()
    print(markdown(report))
    print(f"wrote {stem}.json, .md, .png (run logs: {args.log})")


if __name__ == "__main__":
    run_cli(main)
