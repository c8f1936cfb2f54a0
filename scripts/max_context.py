"""How long a context can one training step take? Largest sequence per attention implementation.

    python scripts/max_context.py --attention naive,sdpa,flash model=gpt2-small features=[plain,ckpt+chunked]

Takes the training config (configs/max_context.yaml adds the search's keys to train.yaml, so
every model preset and override of train.py applies, as positional key=value arguments);
`--attention` names the implementations compared (ratios are to naive). For each memory-feature set and attention
implementation it builds the model once, then probes lengths: one full training step per probe
(forward and loss inside the model, backward, clipping, optimizer step; bf16 autocast and fused
AdamW on CUDA: train.py's own TrainStep), doubling from `start` until a step fails, then bisecting to
`granularity`. The optimizer's state is allocated before the first probe, so every probe sees the
steady-state footprint of step 2 onwards, not the lighter first step.

Probes run in this process, one after another: an out-of-memory error is caught, the step's
tensors dropped and the allocator's cache emptied, so the next probe starts from the same
baseline (each probe records what was allocated when it began: weights, optimizer state and
library workspaces). That is much cheaper than a fresh process per probe (CUDA start-up, kernel
compilation and model init every time), which matters when a million-token step takes minutes.
Any other error ends that implementation's search, recorded as an error, and the run moves on;
if the GPU itself is broken (a kernel fault), the run stops and keeps what it measured.

On the CPU there is no device limit to hit: every tensor created during the step is counted
(live bytes, plus the model and optimizer state) against a budget, and a step whose count passes
it fails like an out-of-memory: `memory_budget_mb=N` in all, or by default the model and optimizer
state plus CPU_STEP_BUDGET_MB for the step. flash runs there in Triton's interpreter (set before
the kernels are imported), seconds per step, so the CPU's search defaults (CPU_SEARCH) are short
lengths: `python scripts/max_context.py` compares naive, sdpa and flash on the tiny model in about
a minute, naive running out first on its N x N scores. Only CUDA runs give real figures, which the
output says. A search in which not even `granularity` tokens fit says why and which setting to
change. model.vocab_size=null (model=tiny) takes the tokenizer's size, as training does (tokens
here are random).

Writes <out>/<name>.json (after every probe), .md (the table) and two PNGs: peak memory
against length, and the maximum per implementation; --out defaults to outputs/max_context/
(git-ignored), `--out benchmarks/max_context` writes the committed results. Without --name an
earlier search's files are never replaced: the default stem takes the next free number
(max_context_cpu_2, ...); `--name STEM` replaces STEM's files, `extend=true` adds to them.

Several GPUs, one sequence split over them (docs/parallel.md, "Context parallelism"):

    torchrun --standalone --nproc_per_node=2 scripts/max_context.py model=gpt2-small --attention flash \
        'features=[ckpt+chunked]' trainer.context_parallel=2

Every rank runs the same step on its chunks (the training step of train.py under torchrun: the
ring, DDP over all ranks); a probe fits when it fits on every rank, and records the largest peak
of any one GPU and the slowest rank's step time. Lengths are multiples of `granularity`, which
must be a multiple of 2 x C. Default file stem: max_context_<device>_x<N>_cp<C>. One step at one
length, e.g. to time the million-token step on 1 and on 2 GPUs: start=cap=granularity=1048576.
Under torchrun a probe that runs out of memory rebuilds the model and optimizer (DDP cannot go on
after an interrupted backward); the ranks are symmetric, so they run out at the same allocation.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import _common  # noqa: F401  (puts the repo root on sys.path)
import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from rich.console import Console

from _common import (OUTPUTS, add_out_argument, attention_list, console, device_slug, draw_safely, environment,
                     error_text, human_bytes, runnable_attentions,
                     markdown_table, memory_unit, new_figure, plain_log_axis, print_table, run_cli,
                     save_figure, tokens_axis, tokens_label, tuning_note, write_json, write_text)
from _first_call import KernelSetupTime
from _memory import allocated_bytes, is_oom, peak_meter, release_memory

RETIME_BELOW_S = 2.0  # a step shorter than this is timed again: the first call at a length compiles
CPU_STEP_BUDGET_MB = 16    # the CPU's default budget for one step, beyond the model and optimizer state
# The search's lengths where start/granularity/cap are left null. On the CPU, with the budget above,
# the tiny model's naive step runs out near 200 tokens and sdpa's and flash's near 300, and flash's
# interpreted steps keep the whole comparison to about a minute on 2 cores.
CUDA_SEARCH = {"start": 1024, "granularity": 1024, "cap": 1_048_576}
CPU_SEARCH = {"start": 64, "granularity": 64, "cap": 1024}


# ----------------------------------------------------------------------------- search (pure)

@dataclass
class Probe:
    """One training step at `length` tokens per sequence: did it fit, and what did it cost."""
    length: int
    fits: bool
    start_bytes: int | None = None   # allocated before the step: weights, optimizer state, caches
    peak_bytes: int | None = None
    step_s: float | None = None
    tokens_per_s: float | None = None
    error: str | None = None  # why it did not fit
    compile_s: float = 0.0    # of step_s: compiling Triton kernels (or loading them from Triton's cache)
    tune_s: float = 0.0       # of step_s: autotuning them (scripts/_first_call.py)


@dataclass
class Search:
    max_length: int      # largest length that fitted; 0 when not even `granularity` did
    capped: bool         # `cap` itself fitted: the true maximum may be larger
    probes: list[Probe] = field(default_factory=list)


def check_search_bounds(start, granularity, cap) -> None:
    """Positive integers, multiples of `granularity`, start <= cap: else one ValueError line."""
    for name, value in {"granularity": granularity, "start": start, "cap": cap}.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name}={value!r}: must be a positive integer")
    for name, value in {"start": start, "cap": cap}.items():
        if value % granularity:
            raise ValueError(f"{name}={value} is not a multiple of granularity={granularity}")
    if start > cap:
        raise ValueError(f"start={start} exceeds cap={cap}")


def find_max_length(probe: Callable[[int], Probe], start: int, granularity: int, cap: int) -> Search:
    """Largest multiple of `granularity` in [granularity, cap] for which `probe(n).fits`.

    Doubles from `start` until a probe fails (or `cap` fits), then bisects between the last fit
    and the first failure. Assumes that fitting is monotone in length; where it is not, the answer
    is still a verified boundary: the returned length fitted and the one `granularity` above it
    failed (both were probed), unless it is `cap`. Each length is probed at most once.
    """
    check_search_bounds(start, granularity, cap)
    probes: list[Probe] = []

    def fits(n: int) -> bool:
        probes.append(probe(n))
        return probes[-1].fits

    fitted, failed = 0, None  # 0 stands for "nothing fits": bisection may go below start
    n = start
    while failed is None:
        if not fits(n):
            failed = n
        elif n == cap:
            return Search(max_length=cap, capped=True, probes=probes)
        else:
            fitted, n = n, min(2 * n, cap)
    while failed - fitted > granularity:
        mid = fitted + (failed - fitted) // granularity // 2 * granularity
        if fits(mid):
            fitted = mid
        else:
            failed = mid
    return Search(max_length=fitted, capped=False, probes=probes)


# ----------------------------------------------------------------------------- one training step

class _TopBlockDone(Exception):
    """Raised once the top block's backward is done: a partial step ends there."""


def _stop_when_differentiated(block, args) -> None:
    """Forward pre-hook on the top block: its input's gradient, the last thing the top block's
    backward makes, ends the step (partial_step=true)."""
    if args[0].requires_grad:
        args[0].register_hook(lambda grad: (_ for _ in ()).throw(_TopBlockDone()))


class StepProbe:
    """A model and optimizer built once; calling it with a length runs one training step, the
    step train.py runs (training.loop.step.TrainStep: autocast, compile, clipping, optimizer; under
    torchrun (`env`) DDP/FSDP2 and the context-parallel ring too)."""

    def __init__(self, cfg: DictConfig, impl: str, device: torch.device, budget_bytes: int | None, env=None):
        from training.builders import model_from_config
        from training.loop.step import TrainStep
        from training.parallel.distributed import DistEnv
        from training.parallel.plan import ParallelPlan

        self.device, self.batch_size, self.budget = device, cfg.batch_size, budget_bytes
        self.partial = cfg.partial_step
        self.vocab_size, self.env = cfg.model.vocab_size, env or DistEnv()
        self.model = model_from_config(cfg, self.vocab_size, attention=impl).to(device)
        self.train_step = TrainStep(self.model, cfg, device, ParallelPlan(self.env, cfg.trainer.parallel), micro_steps=1)
        self.optimizer = self.train_step.optimizer
        for p in self.model.parameters():  # allocate Adam's moments now: steady-state footprint
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        release_memory(device)
        if device.type == "cpu" and self.budget is None:   # the default: the state, plus one step's share
            self.budget = self._allocated() + CPU_STEP_BUDGET_MB * 2**20

    def _allocated(self) -> int:
        state = [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return allocated_bytes(self.device, [*self.model.parameters(), *self.model.buffers(), *state])

    def _step(self, idx: torch.Tensor, targets: torch.Tensor) -> None:
        if not self.partial:
            self.train_step(lambda: (idx, targets))  # the loss comes out of the model: no logits here
            return
        for p in self.model.parameters():  # the gradients a whole step ends up holding, from the start
            p.grad = torch.zeros_like(p)
        top = self.model.blocks[-1].register_forward_pre_hook(_stop_when_differentiated)
        try:
            self.train_step(lambda: (idx, targets))
        except _TopBlockDone:
            pass
        finally:
            top.remove()

    def timed_step(self, length: int) -> float:
        shape = (self.batch_size, length)
        g = torch.Generator(self.device).manual_seed(length)  # the same tokens on every rank of a CP group
        idx = torch.randint(self.vocab_size, shape, device=self.device, generator=g)
        targets = torch.randint(self.vocab_size, shape, device=self.device, generator=g)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        began = time.perf_counter()
        self._step(idx, targets)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - began

    def __call__(self, length: int) -> Probe:
        start_bytes = self._allocated()
        # Under torchrun the CPU meter only records: one rank raising mid-step would leave the others
        # waiting in a collective of the ring, and live bytes differ between ranks (when a storage
        # is freed depends on gloo's threads). Every rank then runs the whole step, and it fits if
        # its peak stayed within the budget: the verdict of stopping at the first byte over it.
        one_process = not self.env.enabled
        meter = peak_meter(self.device, baseline=start_bytes, budget=self.budget if one_process else None)
        error = None
        setup = KernelSetupTime()
        try:
            with meter, setup:
                step_s = self.timed_step(length)
            if self.device.type != "cuda" and not one_process and meter.peak > self.budget:
                error = (f"out of memory: {meter.peak} live tensor bytes exceed the CPU budget of "
                         f"{self.budget}")
            step_s = self._slowest(step_s)
            if step_s < RETIME_BELOW_S and not self.partial:  # on the slowest rank's time: every rank steps again or none
                step_s = self._slowest(self.timed_step(length))
        except Exception as exc:  # noqa: BLE001 (anything but OOM is re-raised)
            if not is_oom(exc):
                raise
            error = error_text(exc)
        self.optimizer.zero_grad(set_to_none=True)
        release_memory(self.device)
        fits, peak, start_bytes, step_s = self._agree(error is None, meter.peak, start_bytes,
                                                      None if error else step_s)
        if not fits:
            return Probe(length, fits=False, start_bytes=start_bytes, error=error or "out of memory on another rank")
        if self.partial:   # not a step's time
            return Probe(length, fits=True, start_bytes=start_bytes, peak_bytes=peak)
        retimed = step_s < RETIME_BELOW_S   # the second step's time: nothing left to compile or tune
        return Probe(length, fits=True, start_bytes=start_bytes, peak_bytes=peak, step_s=step_s,
                     tokens_per_s=self.env.dp_size * self.batch_size * length / step_s,
                     compile_s=0.0 if retimed else setup.compile_s, tune_s=0.0 if retimed else setup.tune_s)

    def _slowest(self, step_s: float) -> float:
        """The slowest rank's step time under torchrun (this one's alone)."""
        if not self.env.enabled:
            return step_s
        import torch.distributed as dist

        value = torch.tensor([step_s], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.env.control)
        return value.item()

    def _agree(self, fits: bool, peak, start_bytes: int, step_s):
        """Under torchrun: fits on every rank, the largest peak and start of any rank, the slowest
        rank's time (over the host-side control group, which an out-of-memory leaves usable)."""
        if not self.env.enabled:
            return fits, peak, start_bytes, step_s
        import torch.distributed as dist

        values = torch.tensor([-float(fits), peak or 0, start_bytes, step_s or 0], dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.env.control)
        return values[0].item() == -1, int(values[1]), int(values[2]), values[3].item()

    def close(self) -> None:
        del self.model, self.optimizer, self.train_step
        release_memory(self.device)


# ----------------------------------------------------------------------------- config

DEFAULT_ATTENTION = ["naive", "sdpa", "flash"]


def compose_config(overrides: list[str], attention: list[str] = DEFAULT_ATTENTION, out: Path | None = None,
                   name: str | None = None, config_name: str = "max_context") -> DictConfig:
    """The search's config: configs/<config_name>.yaml with the overrides, checked against its
    schema, plus what the options name (the implementations, where the results go)."""
    from omegaconf import open_dict

    from training.config import compose
    from training.config.checks import validate_config

    cfg = compose(overrides, config_name=config_name)
    validate_config(cfg, config_name)
    with open_dict(cfg):
        cfg.impls, cfg.out_dir, cfg.out_name = list(attention), str(out or OUTPUTS / config_name), name
    return cfg


def with_features(cfg: DictConfig, name: str) -> DictConfig:
    """`cfg` with the model.* keys of feature set `name` applied."""
    run_cfg = cfg.copy()
    run_cfg.model = OmegaConf.merge(cfg.model, cfg.feature_sets[name])
    return run_cfg


def fill_from_device_and_tokenizer(cfg: DictConfig, device: torch.device) -> None:
    """What the config leaves to the machine, decided before any work and said in `cfg.notes`: the
    implementations this device can run (flash needs CUDA), and model.vocab_size=null as the
    tokenizer's size rounded up to 64, as training sizes it (random tokens here, no corpus read)."""
    from omegaconf import open_dict

    from data.tokenizer import configured_vocab_size
    from model.config import VOCAB_MULTIPLE

    notes: list[str] = []
    impls = runnable_attentions(list(cfg.impls), device, notes)
    if device.type == "cpu" and "flash" in impls:
        notes.append("flash runs in Triton's interpreter on a CPU: seconds per step where naive and sdpa take "
                     "milliseconds; its memory is counted as theirs is.")
    with open_dict(cfg):
        cfg.impls, cfg.notes = impls, notes
        if cfg.model.vocab_size is None:
            size = configured_vocab_size(cfg.tokenizer)
            cfg.model.vocab_size = -(-size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
            notes.append(f"model.vocab_size={cfg.model.vocab_size}: tokenizer={cfg.tokenizer.name}'s {size:,} "
                         "tokens rounded up to a multiple of 64.")


def validate(cfg: DictConfig, device: torch.device, world_size: int = 1) -> None:
    """Raise ValueError naming the first bad tool key before any model is built (start,
    granularity and cap left null get the device's defaults first)."""
    from model.attention import ATTENTION
    from training.parallel.context import check_attention, check_processes

    with open_dict(cfg):
        for key, value in (CUDA_SEARCH if device.type == "cuda" else CPU_SEARCH).items():
            if cfg[key] is None:
                cfg[key] = value

    for impl in cfg.impls:
        if impl not in ATTENTION:
            raise ValueError(f"--attention: {impl!r} is not registered; valid: {', '.join(ATTENTION)}")
    for name in cfg.features:
        if name not in cfg.feature_sets:
            raise ValueError(f"features: {name!r} is not in feature_sets ({', '.join(cfg.feature_sets)})")
        for key in cfg.feature_sets[name]:
            if key not in cfg.model:
                raise ValueError(f"feature_sets.{name}.{key}: not a model.* key")
    pairs = {f"{impl}/{name}" for impl in cfg.impls for name in cfg.features}
    for pair in cfg.skip:
        if pair not in pairs:
            raise ValueError(f"skip: {pair!r} is none of the runs ({', '.join(sorted(pairs))})")
    check_search_bounds(cfg.start, cfg.granularity, cfg.cap)
    size = cfg.trainer.context_parallel
    check_processes(size, world_size)
    if cfg.granularity % (2 * size):
        raise ValueError(f"granularity={cfg.granularity} is not a multiple of 2 x trainer.context_parallel = "
                         f"{2 * size} (every probed length is split into {2 * size} equal chunks)")
    for impl in cfg.impls:
        check_attention(impl, size)
    if cfg.cap > cfg.model.max_seq_len:
        raise ValueError(f"cap={cfg.cap} exceeds model.max_seq_len={cfg.model.max_seq_len}; "
                         f"pass model.max_seq_len={cfg.cap} as well")
    if cfg.partial_step and cfg.trainer.compile:
        raise ValueError("partial_step=true with trainer.compile=true: the hook that ends the step at the top "
                         "block is not compiled; measure memory uncompiled")
    if cfg.partial_step and any(cfg.feature_sets[name].get("activation_checkpointing", cfg.model.activation_checkpointing)
                                == "none" for name in cfg.features):
        raise ValueError("partial_step=true needs activation checkpointing in every feature set: without it "
                         "the peak need not come at the top block's backward")
    if device.type == "cuda" and cfg.memory_budget_mb is not None:
        raise ValueError(f"memory_budget_mb={cfg.memory_budget_mb}: CUDA runs search the real memory "
                         "limit; leave it null")


# ----------------------------------------------------------------------------- reporting

def memory_line(probes: list[dict]) -> tuple[float, float] | None:
    """(bytes per sequence position, fixed bytes): the line through the peaks of the two longest
    steps that fitted; None with fewer than two. Every memory feature here is linear in length."""
    fitted = sorted((p["length"], p["peak_bytes"]) for p in probes if p["fits"])
    if len(fitted) < 2:
        return None
    (n1, b1), (n2, b2) = fitted[-2:]
    slope = (b2 - b1) / (n2 - n1)
    return slope, b2 - slope * n2


def predicted_max(line: tuple[float, float] | None, limit_bytes: int | None, granularity: int) -> int | None:
    """Longest length (a multiple of granularity) whose peak on `line` stays within limit_bytes."""
    if line is None or limit_bytes is None or line[0] <= 0:
        return None
    return max(0, int((limit_bytes - line[1]) / line[0]) // granularity * granularity)


def summary_rows(results: list[dict], limit_bytes: int | None = None, batch_size: int = 1) -> list[list]:
    """One table row per search; `limit_bytes` (the device's memory, or the CPU budget) turns the
    memory line into a predicted maximum length; a step holds batch_size x length tokens."""
    naive = {r["features"]: r["max_length"] for r in results if r["impl"] == "naive" and r["max_length"]}
    rows = []
    for r in results:
        best = max((p for p in r["probes"] if p["fits"]), key=lambda p: p["length"], default=None)
        if r["error"]:
            shown = f"error: {r['error']}"
        elif r["max_length"] is None:
            shown = "running"
        else:
            shown = ("≥ " if r["capped"] else "") + f"{r['max_length']:,}"
        ratio = (("≥ " if r["capped"] else "") + f"{r['max_length'] / naive[r['features']]:.1f}x"
                 if r["max_length"] and r["features"] in naive else "-")
        line = memory_line(r["probes"])
        timed = best is not None and best["step_s"] is not None   # partial steps are not timed
        predicted = predicted_max(line, limit_bytes, r["granularity"])
        rows.append([r["features"], r["impl"], shown, ratio, f"{r['granularity']:,}",
                     human_bytes(best and best["peak_bytes"]), f"{best['step_s']:.2f}" if timed else "-",
                     setup_time(best) if timed else "-",
                     f"{best['tokens_per_s']:,.0f}" if timed else "-",
                     f"{1e6 / best['tokens_per_s']:,.1f}" if timed else "-",
                     f"{line[0] / batch_size:,.0f}" if line else "-",
                     f"{predicted:,}" if predicted is not None else "-", len(r["probes"])])
    return rows


HEADERS = ["features", "attention", "max tokens", "vs naive", "granularity", "peak memory", "step s",
           "of which compile + tune s", "tokens/s", "µs/token", "bytes/token", "linear max", "probes"]


def setup_time(probe: dict) -> str:
    """The part of a once-timed step spent compiling and tuning kernels (older reports: unknown)."""
    if "compile_s" not in probe:
        return "?"
    return f"{probe['compile_s']:.1f} + {probe['tune_s']:.1f}"


def memory_limit(report: dict) -> int | None:
    """What a step must fit in: the device's memory on CUDA, the live-tensor budget on the CPU (by
    default the state each probe began with plus the step's share)."""
    settings = report["settings"]
    budget, step_share = settings["memory_budget_mb"], settings.get("cpu_step_budget_mb")
    if report["metadata"].get("device_memory_bytes") or budget:
        return report["metadata"].get("device_memory_bytes") or int(budget * 2**20)
    starts = [p["start_bytes"] for r in report["results"] for p in r["probes"] if p.get("start_bytes")]
    return min(starts) + step_share * 2**20 if starts and step_share else None


def write_outputs(stem: Path, report: dict) -> None:
    """<stem>.json (everything, every probe) and <stem>.md (the summary table)."""
    write_json(stem.with_suffix(".json"), report)
    meta, settings = report["metadata"], report["settings"]
    world, size = settings.get("world_size", 1), settings.get("context_parallel", 1)
    lines = [f"# Longest training step: {report['model']['name']}, batch {settings['batch_size']}"
             + (f", {world} GPUs, context_parallel={size}" if world > 1 else ""), "",
             f"{meta['device']}, {meta['date']}, torch {meta['torch']}, triton {meta['triton']}, "
             f"commit {meta['git_commit']}.",
             f"One step = forward, backward, optimizer step; precision {settings['precision']}. Each length "
             "is doubled until a step does not fit, then bisected to the row's granularity; '≥' marks a "
             "search that reached its cap. 'vs naive' divides by naive's maximum under the same features. "
             "Peak memory, step time and tokens/s are those of the longest step that fitted. A step of "
             f"over {RETIME_BELOW_S:g} s is timed once, so its time includes first-call costs: 'of which "
             "compile + tune s' is the part spent compiling Triton kernels (or loading them from Triton's "
             "on-disk cache, which an earlier run may have filled) and autotuning them; kernel speed is "
             "measured by scripts/bench/bench_attention.py. µs/token is that step's "
             "time per token. 'bytes/token' is the slope of peak memory through the two longest steps that "
             "fitted, and 'linear max' the length at which that line reaches the "
             + ("device's memory" if meta["device_type"] == "cuda" else "budget")
             + ": a prediction from two probes, not a measurement (every feature set here is linear in length)."
             + tuning_note(meta)]
    if settings.get("partial_step"):
        lines.append("Partial steps (partial_step=true): each probe ran the forward and the backward until the "
                     "top block's was done, with every parameter's gradient allocated from the start. Under "
                     "activation checkpointing that is where a step's memory peaks (each block further down "
                     "holds one saved input fewer), so the peaks are those of whole steps; the times are not.")
    if world > 1:
        lines.append(f"{world} processes (torchrun), each sequence split over {size} of them: peak memory is the "
                     "largest of any one GPU, the step time the slowest rank's, tokens/s counts all ranks.")
    if meta["device_type"] != "cuda":
        budget = (f"a {settings['memory_budget_mb']} MiB" if settings["memory_budget_mb"] else
                  f"the model and optimizer state + {settings['cpu_step_budget_mb']} MiB")
        lines.append(f"CPU run against {budget} live-tensor budget: it exercises the tool; only CUDA runs give "
                     "real figures.")
    lines += settings.get("notes", []) + nothing_fits(report)
    write_text(stem.with_suffix(".md"), "\n".join(lines) + "\n\n"
               + markdown_table(HEADERS, summary_rows(report["results"], memory_limit(report), settings["batch_size"])))


def earlier_results(path: Path, report: dict) -> list[dict]:
    """The completed searches in an earlier report, if it measured the same thing (extend=true)."""
    if not path.exists():
        raise ValueError(f"extend=true: {path} does not exist (run once without extend, "
                         "with the same --out and --name)")
    earlier = json.loads(path.read_text())
    same = {"model": (earlier["model"], report["model"]),
            "batch_size": (earlier["settings"]["batch_size"], report["settings"]["batch_size"]),
            "precision": (earlier["settings"]["precision"], report["settings"]["precision"]),
            "partial_step": (earlier["settings"].get("partial_step", False), report["settings"]["partial_step"]),
            "world size": (earlier["settings"].get("world_size", 1), report["settings"]["world_size"]),
            "context_parallel": (earlier["settings"].get("context_parallel", 1),
                                 report["settings"]["context_parallel"]),
            "device": (earlier["metadata"]["device"], report["metadata"]["device"])}
    for key, (then, now) in same.items():
        if then != now:
            raise ValueError(f"extend=true: {path} was measured with a different {key} ({then} vs {now} now)")
    return [r for r in earlier["results"] if r["error"] is None and r["max_length"] is not None]


def plot(stem: Path, report: dict) -> None:
    """<stem>_memory.png: peak memory of the steps that fitted, against length (one panel per
    feature set); <stem>_max.png: the longest step per implementation and feature set."""
    results = report["results"]
    features = list(dict.fromkeys(r["features"] for r in results))
    impls = list(dict.fromkeys(r["impl"] for r in results))
    colour = {impl: f"C{i % 10}" for i, impl in enumerate(impls)}   # one colour per implementation, in both plots
    device_bytes = report["metadata"].get("device_memory_bytes")
    peaks = [p["peak_bytes"] for r in results for p in r["probes"] if p["fits"]]
    scale, unit = memory_unit(peaks + ([device_bytes] if device_bytes else []))
    fig, axes = new_figure(1, len(features), figsize=(6 * len(features), 4.5))
    for ax, name in zip(axes[0], features):
        for r in (r for r in results if r["features"] == name):
            fitted = sorted((p["length"], p["peak_bytes"] / scale) for p in r["probes"] if p["fits"])
            if fitted:
                ax.plot(*zip(*fitted), marker="o", color=colour[r["impl"]], label=r["impl"])
        if device_bytes:
            ax.axhline(device_bytes / scale, color="grey", ls="--", lw=1, label="device memory")
        if ax.lines:
            tokens_axis(ax, "x")
            plain_log_axis(ax, "y")
            ax.legend()
        ax.set(xlabel="sequence length (tokens)", ylabel=f"peak memory ({unit})",
               title=f"one training step, features: {name}")
        ax.grid(True, which="both", alpha=0.3)
    save_figure(fig, stem.with_name(stem.name + "_memory.png"))

    fig, axes = new_figure(1, 1, figsize=(max(6, 1.2 * len(impls) * len(features) + 2), 4.5))
    ax, width = axes[0][0], 0.8 / len(impls)
    for i, impl in enumerate(impls):
        xs, heights = [], []
        for j, name in enumerate(features):
            r = next((r for r in results if r["impl"] == impl and r["features"] == name), None)
            if r and r["max_length"]:
                xs.append(j + (i - (len(impls) - 1) / 2) * width)
                heights.append(r["max_length"])
        if not heights:   # nothing fitted (or it failed): no bars, so no legend entry either
            continue
        bars = ax.bar(xs, heights, width, color=colour[impl], label=impl)
        ax.bar_label(bars, labels=[tokens_label(h) for h in heights], fontsize=8)
    ax.set_xticks(range(len(features)), features)
    found = [r["max_length"] for r in results if r["max_length"]]
    if found:  # bars rise from half the shortest, so even that one shows
        tokens_axis(ax, "y")
        ax.set_ylim(bottom=min(found) / 2, top=max(found) * 2)
    ax.set(xlabel="memory features", ylabel="longest sequence (tokens)",
           title=f"{report['model']['name']}, batch {report['settings']['batch_size']}: longest training "
                 f"step, {report['metadata']['device']}")
    if ax.containers:
        ax.legend()
    save_figure(fig, stem.with_name(stem.name + "_max.png"))


# ----------------------------------------------------------------------------- main

def search_one(cfg: DictConfig, record: dict, device: torch.device, budget: int | None, save, out, env) -> None:
    """Fill `record` with the search for one implementation under one feature set."""
    impl, name = record["impl"], record["features"]
    prober = StepProbe(with_features(cfg, name), impl, device, budget, env)

    def probe(length: int) -> Probe:
        nonlocal prober
        out.print(f"[bold]{impl}[/] · {name} · probing {length:,} tokens …")
        result = prober(length)
        if not result.fits and env.enabled:  # DDP's reducer cannot continue after an interrupted backward
            prober.close()
            prober = StepProbe(with_features(cfg, name), impl, device, budget, env)
        record["probes"].append(asdict(result))
        save()
        out.print("    " + (f"fits: peak {human_bytes(result.peak_bytes)}"
                            + (f", {result.step_s:.2f} s, {result.tokens_per_s:,.0f} tokens/s, "
                               f"{1e6 / result.tokens_per_s:,.1f} µs/token" if result.step_s else " (partial step)")
                            if result.fits
                            else f"does not fit ({result.error})"))
        return result

    try:
        search = find_max_length(probe, cfg.start, cfg.granularity, cfg.cap)
    finally:
        prober.close()
    record.update(max_length=search.max_length, capped=search.capped)


def run(cfg: DictConfig) -> dict:
    """The searches; under torchrun every rank runs them and rank 0 writes the results."""
    from training.process.device import resolve_device
    from training.parallel.distributed import close_distributed, env_world, init_distributed

    device, world = resolve_device(cfg.device), env_world()[1]
    validate(cfg, device, world)
    fill_from_device_and_tokenizer(cfg, device)
    env = init_distributed(device.type, cfg.trainer.dist_timeout_s, cfg.trainer.context_parallel)
    try:
        if device.type == "cuda" and env.enabled:
            device = torch.device("cuda", env.local_rank)
        return run_searches(cfg, device, env)
    finally:
        env = None  # it holds the process groups: let go before leaving them, as train.py does
        close_distributed()


def run_searches(cfg: DictConfig, device: torch.device, env) -> dict:
    from training.process.device import resolve_precision

    out = console() if env.is_main else Console(quiet=True)
    budget = None if cfg.memory_budget_mb is None else int(cfg.memory_budget_mb * 2**20)
    size = cfg.trainer.context_parallel
    default_stem = f"max_context_{device_slug(device)}" + (f"_x{env.world_size}_cp{size}" if env.enabled else "")
    stem = Path(cfg.out_dir) / (cfg.out_name or default_stem)
    if not cfg.out_name and not cfg.extend:   # an earlier search's files are kept: the next free stem
        stem = free_stem(stem)
        if stem.name != default_stem:
            out.print(f"{default_stem}.json in {cfg.out_dir} holds an earlier search, kept: this one is {stem.name} "
                      f"(--name sets the file stem, extend=true adds to a search)")
    settings = {key: OmegaConf.to_container(cfg[key]) if OmegaConf.is_config(cfg[key]) else cfg[key]
                for key in ("impls", "features", "skip", "batch_size", "start", "granularity", "cap",
                            "memory_budget_mb", "feature_sets", "partial_step")}
    settings["precision"] = resolve_precision(cfg.trainer.precision, device)
    settings.update(world_size=env.world_size, context_parallel=size, parallel=cfg.trainer.parallel,
                    notes=list(cfg.notes))
    if device.type == "cpu" and cfg.memory_budget_mb is None:
        settings["cpu_step_budget_mb"] = CPU_STEP_BUDGET_MB
    for note in cfg.notes:
        out.print(f"[yellow]{note}[/]")
    meta = environment(device)
    report = {"metadata": meta, "settings": settings,
              "model": OmegaConf.to_container(cfg.model, resolve=True), "results": []}
    if cfg.extend:
        report["results"] = earlier_results(stem.with_suffix(".json"), report)
    done = {(r["impl"], r["features"]) for r in report["results"]}
    main = env.is_main  # every rank searches; rank 0 alone writes

    def save() -> None:
        if main:
            write_json(stem.with_suffix(".json"), report)

    for name in cfg.features:
        for impl in (impl for impl in cfg.impls if f"{impl}/{name}" not in cfg.skip):
            if (impl, name) in done:
                out.print(f"{impl} · {name}: kept from {stem}.json (extend=true)")
                continue
            record = {"impl": impl, "features": name, "max_length": None, "capped": False, "error": None,
                      "start": cfg.start, "granularity": cfg.granularity, "cap": cfg.cap,
                      "date": meta["date"], "git_commit": meta["git_commit"], "probes": []}
            report["results"].append(record)
            try:
                search_one(cfg, record, device, budget, save, out, env)
            except Exception as exc:  # noqa: BLE001 (one failing implementation must not end the run)
                record["error"] = error_text(exc)
                out.print(f"[red]{impl} · {name}: {record['error']}[/]")
            try:
                release_memory(device)
            except Exception as exc:  # noqa: BLE001 (a faulted GPU fails every later probe too)
                if main:
                    write_outputs(stem, report)
                raise SystemExit(f"the device is unusable after {impl} · {name} ({error_text(exc)}); "
                                 f"results so far are in {stem}.json") from exc
            if main:
                write_outputs(stem, report)
                draw_safely(out, plot, stem, report)  # after every search: a run cut short keeps its plots

    if not main:
        return report
    print_table(f"Longest training step: {cfg.model.name}, batch {cfg.batch_size}, {report['metadata']['device']}",
                HEADERS, summary_rows(report["results"], memory_limit(report), cfg.batch_size))
    for line in nothing_fits(report):
        out.print(f"[yellow]{line}[/]")
    if device.type == "cpu":
        out.print("[yellow]CPU run against a live-tensor budget: only CUDA runs give real figures.[/]")
    out.print(f"wrote {stem}.json, .md, _memory.png, _max.png")
    return report


def nothing_fits(report: dict) -> list[str]:
    """For the searches in which not even `granularity` tokens fit: why, and which setting to change."""
    settings, meta = report["settings"], report["metadata"]
    failed = [f"{r['impl']} · {r['features']}" for r in report["results"] if r["max_length"] == 0]
    if not failed:
        return []
    tokens = f"{settings['batch_size']} x {settings['granularity']:,} tokens"
    if meta["device_type"] == "cuda":
        return [f"Nothing fitted in {', '.join(failed)}: one step of {tokens} needs more than the GPU's memory; "
                f"use memory features (features=[ckpt+chunked]), a smaller batch_size or model, or a smaller "
                f"granularity."]
    limit = memory_limit(report)
    state = min((p["start_bytes"] for r in report["results"] for p in r["probes"] if p.get("start_bytes")),
                default=None)
    budget = (f"memory_budget_mb={settings['memory_budget_mb']:g}" if settings["memory_budget_mb"] else
              f"the model and optimizer state + {settings['cpu_step_budget_mb']} MiB")
    return [f"Nothing fitted in {', '.join(failed)}: one step of {tokens} needs more live tensor bytes than the "
            f"CPU's budget ({budget}: {human_bytes(limit)}, of which {human_bytes(state)} is the model and "
            f"optimizer state). Raise memory_budget_mb (the whole budget, in MiB: more than the state's "
            f"{(state or 0) / 2**20:,.0f}), lower granularity and start, or take a smaller model (the default, "
            f"model=tiny, compares the three in about a minute on a CPU)."]


def free_stem(stem: Path) -> Path:
    """`stem`, or `stem`_2, _3, ... : the first whose .json does not exist yet."""
    number, found = 1, stem
    while found.with_suffix(".json").exists():
        number += 1
        found = stem.with_name(f"{stem.name}_{number}")
    return found


def parse_args(argv: list[str], script: str = "max_context", attention: str = ",".join(DEFAULT_ATTENTION),
               description: str = __doc__, writes: bool = True):
    """max_context.py's options (profile_step.py, which prints its table and `writes` nothing,
    shares them): --attention, --out, --name, key=value."""
    parser = _common.argument_parser(description, epilog=f"Search keys and memory-feature sets: configs/{script}.yaml")
    parser.add_argument("--attention", type=attention_list, default=attention_list(attention),
                        help=f"comma-separated attention implementations (default {attention})")
    if writes:
        add_out_argument(parser, script)
        parser.add_argument("--name", type=_common.file_stem, default=None, help="file stem (default max_context_<device>)")
    parser.add_argument("overrides", nargs="*", help="key=value: train.py's overrides and the search's keys")
    return parser.parse_intermixed_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():   # flash on the CPU: the interpreter, chosen before the kernels are imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    run(compose_config(args.overrides, args.attention, args.out, args.name))


if __name__ == "__main__":
    run_cli(main)
