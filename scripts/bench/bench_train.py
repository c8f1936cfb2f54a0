"""Training-step throughput: the real loop (train.py) next to a bare step of the same model.

    python scripts/bench/bench_train.py                         # sdpa and flash at T = 1K, 4K, 16K (H200: ~6 min)
    python scripts/bench/bench_train.py --ablation              # where the loop's time goes (T = 4K, sdpa)
    python scripts/bench/bench_train.py --first-step            # first step cold (empty caches) and warm
    python scripts/bench/bench_train.py --smoke                 # CPU plumbing check, not a benchmark

For each attention implementation and sequence length T (16K tokens per optimizer step, batch
16K / T, gpt2-small, bf16 autocast, fused AdamW, torch.compile):

- `bare`: the model's forward (loss inside), backward, optimizer step and zero_grad on batches
  already on the GPU, nothing else, timed with CUDA events over `--steps` steps after `--warmup`;
- `real`: `train.py` itself in a subprocess with the same model and batch, steady-state tokens/s
  as its own metrics.jsonl reports them (the logging intervals after the first, which compiles);
- `loop overhead` = 1 - real / bare.

`--ablation` starts from the bare step and adds the loop's pieces one at a time (real batches
from the token cache, gradient clipping, the LR update, NaN tracking, the progress bar), and
profiles the bare and the full step with torch.profiler: GPU busy time against wall time per
step, and the kernels/CPU ops that take the most time. That is how the loop's overhead is
found; the committed summary is `benchmarks/train_<gpu>_profile.txt`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/, for _common (which puts the repo root first)
import _common  # noqa: F401  (puts the repo root on sys.path)
import torch
from training.config import merge_overrides

from _common import (REPO_ROOT, add_out_argument, console, device_slug, environment, markdown_table, print_table, run_cli,
                     write_json, write_text)
from _memory import release_memory

GPT2 = ["model=gpt2-small", "logger=none", "trainer.progress=false"]


def compose_cfg(overrides: list[str]):
    """train.py's config for these overrides, with train.py's checks (a bad value is one line)."""
    from training.config import compose
    from training.config.checks import validate_config

    cfg = compose(overrides + ["run.dir=/tmp/unused"])
    validate_config(cfg)
    return cfg


def sequences_a_step(tokens: int, seq_len: int) -> int:
    """The batch of a case: a step holds whole sequences, so --tokens rounds down (at least one)."""
    return max(1, tokens // seq_len)


def case_overrides(attention: str, seq_len: int, args, device: torch.device) -> list[str]:
    """train.py's overrides of one case: T = seq_len, batch sequences_a_step, compiled on CUDA."""
    return GPT2 + [f"attention={attention}", f"trainer.seq_len={seq_len}",
                   f"trainer.batch_size={sequences_a_step(args.tokens, seq_len)}",
                   f"trainer.compile={str(device.type == 'cuda').lower()}", *args.overrides]


def build(cfg, attention: str, device: torch.device):
    """Model (compiled when the config says so) and optimizer, from the Trainer's own builders."""
    from training.loop.optim import build_optimizer
    from training.builders import model_from_config

    model = model_from_config(cfg, cfg.model.vocab_size, attention).to(device)
    optimizer = build_optimizer(model, cfg.optim, device)
    return model, (torch.compile(model) if cfg.trainer.compile else model), optimizer


class Timer:
    """Seconds per step over a block of steps: CUDA events on the GPU, the host clock on the CPU."""

    def __init__(self, device):
        self.device = device

    def __call__(self, step, n: int) -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(n):
                step()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3 / n
        began = time.perf_counter()
        for _ in range(n):
            step()
        return (time.perf_counter() - began) / n


ABLATION = ("bare", "+real batches", "+grad clip", "+lr update", "+nan tracking", "+progress bar")


def loop_step(level: int, cfg, model, step_model, optimizer, device, data=None, bar=None, batches: int = 4):
    """A closure running one training step with the loop's first `level` pieces (ABLATION's
    order). Level 0 is the bare, nanoGPT-style step: forward (loss inside), backward, optimizer
    step and zero_grad on a few batches made on the device beforehand, rotated through."""
    from training.process.device import autocast, resolve_precision
    from training.loop.optim import lr_at

    t = cfg.trainer
    precision = resolve_precision(t.precision, device)
    made = [torch.randint(cfg.model.vocab_size, (2, t.batch_size, t.seq_len), device=device) for _ in range(batches)]
    state = {"i": 0, "healthy": torch.ones((), dtype=torch.bool, device=device)}

    def step():
        i = state["i"]
        state["i"] += 1
        if level >= 1:
            x, y = data.train.next_batch(t.batch_size)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        else:
            x, y = made[i % batches]
        if level >= 3:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(i, cfg.optim, 10**6)
        with autocast(device, precision):
            loss = step_model(x, y)
        loss.backward()
        if level >= 2:
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if level >= 4:
            state["healthy"] &= torch.isfinite(loss.detach()) & torch.isfinite(grad_norm)
        if level >= 5:
            bar.update()
    return step


def real_run(overrides: list[str], steps: int, log_every: int, device, env: dict | None = None) -> dict:
    """train.py in a subprocess; steady-state tokens/s from its metrics.jsonl (intervals after the first)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(REPO_ROOT / "train.py"), *merge_overrides(overrides, [
               f"run.dir={tmp}/run", f"trainer.max_steps={steps}", f"trainer.log_every={log_every}",
               "trainer.eval_every=0", "trainer.ckpt_every=0", f"device={device.type}"])]
        began = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, env={**os.environ, **(env or {})})
        wall = time.perf_counter() - began
        if proc.returncode:
            return {"status": f"train.py exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"}
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    steady = [r["tokens_per_s"] for r in rows[1:]] or [rows[-1]["tokens_per_s"]]
    steady.sort()
    return {"status": "ok", "tokens_per_s": steady[len(steady) // 2], "intervals": [r["tokens_per_s"] for r in rows],
            "wall_s": wall, "mfu": rows[-1].get("mfu"), "first_step_s": rows[0]["tokens"] / rows[0]["tokens_per_s"]}


def first_step(args, device, out) -> list[dict]:
    """The first training step's time with empty compile caches (Triton kernels and their tuning,
    Inductor's graphs), then again with the caches the first process left: what a user's first and
    second run of a config pay before training starts."""
    rows = []
    with tempfile.TemporaryDirectory() as caches:
        env = {"TRITON_CACHE_DIR": f"{caches}/triton", "TORCHINDUCTOR_CACHE_DIR": f"{caches}/inductor"}
        for attention in args.attention:
            for temperature in ("cold", "warm"):
                seq_len = args.ablation_len
                overrides = case_overrides(attention, seq_len, args, device)
                result = real_run(overrides, 2, 1, device, env)
                rows.append({"attention": attention, "T": seq_len, "caches": temperature, "status": result["status"],
                             "first_step_s": result.get("first_step_s"), "process_s": result.get("wall_s")})
                out.print(rows[-1])
    return rows


def measure(attention: str, seq_len: int, args, device, out) -> dict:
    batch = sequences_a_step(args.tokens, seq_len)
    overrides = case_overrides(attention, seq_len, args, device)
    cfg = compose_cfg(overrides)
    row = {"attention": attention, "T": seq_len, "B": batch, "tokens_per_step": batch * seq_len}
    timer = Timer(device)
    model, step_model, optimizer = build(cfg, attention, device)
    step = loop_step(0, cfg, model, step_model, optimizer, device)
    for _ in range(args.warmup):
        step()
    step_s = timer(step, args.steps)
    flops = model.flops_per_token(seq_len)
    del step, model, step_model, optimizer   # the real run below needs the memory back
    row.update(bare_step_ms=step_s * 1e3, bare_tokens_per_s=batch * seq_len / step_s)
    real = real_run(overrides, args.warmup + args.steps, max(1, args.steps // 3), device)
    row["real_status"] = real["status"]
    if real["status"] == "ok":
        row.update(real_tokens_per_s=real["tokens_per_s"], real_intervals=real["intervals"],
                   loop_overhead=1 - real["tokens_per_s"] / row["bare_tokens_per_s"])
    from training.loop.throughput import mfu, peak_flops

    peak = peak_flops(device, None)
    if peak:
        row["bare_mfu"] = mfu(row["bare_tokens_per_s"], flops, peak)
        if "real_tokens_per_s" in row:
            row["real_mfu"] = mfu(row["real_tokens_per_s"], flops, peak)
    out.print(row)
    release_memory(device)
    return row


# ----------------------------------------------------------------------------- ablation

def ablation(args, device, out) -> dict:
    """Cumulative loop features on the bare step at one shape, then a profile of bare vs full."""
    from tqdm import tqdm

    from training.builders import build_data

    seq_len = args.ablation_len
    batch = sequences_a_step(args.tokens, seq_len)
    cfg = compose_cfg(case_overrides(args.attention[0], seq_len, args, device))
    data = build_data(cfg, seq_len=seq_len, seed=cfg.seed, seq_len_from="--ablation-len")
    model, step_model, optimizer = build(cfg, args.attention[0], device)
    bar = tqdm(total=10**9, disable=False, file=open(os.devnull, "w"))

    def make_step(level: int):
        return loop_step(level, cfg, model, step_model, optimizer, device, data, bar)

    timer = Timer(device)
    rows = []
    for level, name in enumerate(ABLATION):
        step = make_step(level)
        for _ in range(args.warmup):
            step()
        step_s = timer(step, args.steps)
        rows.append({"features": name, "step_ms": step_s * 1e3, "tokens_per_s": batch * seq_len / step_s})
        out.print(rows[-1])
    profiles = {}
    if device.type == "cuda":
        for level in (0, len(ABLATION) - 1):
            profiles[ABLATION[level]] = profile(make_step(level), args.steps, device)
    return {"T": seq_len, "B": batch, "attention": args.attention[0], "rows": rows, "profiles": profiles}


def profile(step, steps: int, device) -> dict:
    """GPU busy time vs wall time per step, and the top kernels / CPU ops, under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - began
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.self_device_time_total for e in kernels)
    return {"wall_ms_per_step": wall * 1e3 / steps, "gpu_busy_ms_per_step": gpu_us / 1e3 / steps,
            "table_gpu": events.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70),
            "table_cpu": events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=70)}


def rounding_notes(tokens: int, lengths: list[int]) -> list[str]:
    """A note for each length that --tokens is not a multiple of: a step holds whole sequences, so
    it takes fewer tokens there (the report's tokens_per_step says how many)."""
    return [f"--tokens {tokens} at T={n}: {sequences_a_step(tokens, n)} sequence(s) a step, "
            f"{sequences_a_step(tokens, n) * n} tokens" for n in sorted(set(lengths)) if tokens % n]


# ----------------------------------------------------------------------------- main

def main(argv: list[str]) -> dict:
    parser = _common.argument_parser(__doc__)
    parser.add_argument("--attention", default="sdpa,flash", help="comma-separated: sdpa, flash, naive")
    parser.add_argument("--lengths", default="1024,4096,16384", help="comma-separated sequence lengths")
    parser.add_argument("--tokens", type=int, default=16384,
                        help="tokens per optimizer step, in whole sequences (rounded down to a multiple of each length)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (compilation)")
    parser.add_argument("--ablation", action="store_true", help="loop features one by one, and a profile")
    parser.add_argument("--ablation-len", type=int, default=4096)
    parser.add_argument("--first-step", action="store_true",
                        help="first step's time with empty compile caches, then warm (T = --ablation-len)")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run: checks the plumbing only")
    add_out_argument(parser, "bench_train")
    parser.add_argument("overrides", nargs="*", help="extra train.py overrides (key=value)")
    args = parser.parse_args(argv)
    args.attention = [a for a in args.attention.split(",") if a]
    try:
        lengths = [int(n) for n in args.lengths.split(",") if n]
    except ValueError:
        raise ValueError(f"--lengths {args.lengths!r}: expected comma-separated integers, e.g. 1024,4096") from None
    if not lengths:
        raise ValueError(f"--lengths {args.lengths!r}: name at least one sequence length")
    for name, value in (("--tokens", args.tokens), ("--steps", args.steps), ("--warmup", args.warmup),
                        ("--ablation-len", args.ablation_len), *(("--lengths", n) for n in lengths)):
        if value < 1:
            raise ValueError(f"{name}={value}: must be a positive integer")
    used = [args.ablation_len] if args.ablation or args.first_step else lengths
    if args.tokens < min(used):   # a step holds whole sequences: fewer tokens would become one whole sequence
        flag = "--ablation-len" if args.ablation or args.first_step else "--lengths"
        raise ValueError(f"--tokens {args.tokens}: fewer than one sequence of {min(used)} tokens ({flag}); "
                         f"pass --tokens {min(used)} or more")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        raise ValueError("no CUDA device: throughput figures need a GPU; use --smoke for a CPU plumbing check")
    if args.smoke:
        args.overrides = ["model=tiny", "model.vocab_size=512", "data.max_bytes=2000000", *args.overrides]
    out = console()
    notes = rounding_notes(args.tokens, used)   # and what this device cannot run is left out, with the reason
    args.attention = _common.runnable_attentions(args.attention, device, notes)
    for note in notes:
        out.print(f"[yellow]{note}[/]")
    for attention in args.attention[:1] if args.ablation and not args.first_step else args.attention:
        for seq_len in used:   # every case's config checked before the first one is measured
            compose_cfg(case_overrides(attention, seq_len, args, device))
    report = {"metadata": environment(device), "notes": notes,
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    stem = args.out / f"train_{device_slug(device)}{'_smoke' if args.smoke else ''}"
    if args.first_step:
        report["first_step"] = first_step(args, device, out)
        write_json(stem.with_name(stem.name + "_first_step.json"), report)
        return report
    if args.ablation:
        report["ablation"] = ablation(args, device, out)
        write_json(stem.with_name(stem.name + "_ablation.json"), report)
        summary = [f"{r['features']}: {r['step_ms']:.2f} ms/step, {r['tokens_per_s']:,.0f} tokens/s"
                   for r in report["ablation"]["rows"]]
        for name, p in report["ablation"]["profiles"].items():
            summary += [f"\n## {name}: wall {p['wall_ms_per_step']:.2f} ms/step, GPU busy "
                        f"{p['gpu_busy_ms_per_step']:.2f} ms/step\n", p["table_gpu"], p["table_cpu"]]
        write_text(stem.with_name(stem.name + "_profile.txt"), "\n".join(summary) + "\n")
        return report
    report["rows"] = []
    for attention in args.attention:
        for seq_len in lengths:
            report["rows"].append(measure(attention, seq_len, args, device, out))
            write_report(stem, report)  # after every row: a run cut short keeps what it measured
    print_table("training throughput", *table(report))
    return report


def table(report: dict) -> tuple[list[str], list[list]]:
    headers = ["attention", "T", "B", "bare tokens/s", "real tokens/s", "loop overhead", "real MFU"]
    rows = [[r["attention"], r["T"], r["B"], f"{r['bare_tokens_per_s']:,.0f}",
             f"{r['real_tokens_per_s']:,.0f}" if "real_tokens_per_s" in r else r["real_status"],
             f"{r['loop_overhead']:.1%}" if "loop_overhead" in r else "-",
             f"{r['real_mfu']:.1%}" if "real_mfu" in r else "-"] for r in report["rows"]]
    return headers, rows


def write_report(stem: Path, report: dict) -> None:
    meta = report["metadata"]
    write_json(stem.with_suffix(".json"), report)
    write_text(stem.with_suffix(".md"), "\n".join([
        f"# Training throughput: {meta['device']}", "",
        f"{meta['date']}, torch {meta['torch']}, triton {meta['triton']}, commit {meta['git_commit']}. "
        "gpt2-small, bf16 autocast, fused AdamW, torch.compile, 16K tokens per optimizer step. "
        "bare: forward, backward and optimizer step on batches already on the GPU (CUDA events); real: "
        "train.py's own steady-state tokens/s; loop overhead = 1 - real / bare. MFU against "
        "the GPU's dense bf16 peak." + "".join(f" {n}" for n in report.get("notes", [])), "",
        markdown_table(*table(report))]))

if __name__ == "__main__":
    run_cli(main)
