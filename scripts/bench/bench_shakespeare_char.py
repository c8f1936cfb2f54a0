"""nanoGPT's shakespeare-char run beside ours on one GPU, in one call: same text, same recipe.

    python scripts/bench/bench_shakespeare_char.py run --text input.txt --nanogpt path/to/nanoGPT --work /tmp/sc \\
        --out $OUT --deadline 150
    python scripts/bench/bench_shakespeare_char.py report --pack $OUT/shakespeare_char_runs.tar.gz \\
        --out benchmarks/shakespeare_char
    python scripts/bench/bench_shakespeare_char.py run ... --smoke      # CPU plumbing check, not a benchmark

`run` starts, as concurrent processes on the one GPU:
- nanoGPT's own `train.py config/train_shakespeare_char.py` in the `--nanogpt` checkout (its
  data/shakespeare_char/{train,val}.bin made beforehand by its prepare.py from the same text);
- `train.py experiment=shakespeare-char data.paths=[<text>]` for each entry of RUNS, which differ
  from the recipe by a few overrides: nanoGPT's architecture, our default one, and ablations that
  each undo one change (moving windows, attention dropout, decayed embeddings).
A small model leaves a large GPU mostly waiting, so the runs share it; for their throughput each
of the timed runs gets the GPU alone for a few seconds once all have compiled (the others are
paused with SIGSTOP, then resumed), tokens/s counted from its own step log over that window.

The device time of one call is short, so runs have ranks: `must` runs (nanoGPT's, ours with its
architecture) always go on to the last step; when, at the current pace, they would not reach it
before `--deadline`, the lowest-ranked other run is stopped (it keeps its curve up to there and the
report says where it stopped). Our default-architecture run counts as `must` until its validation
loss has risen for three evaluations in a row past its minimum (its best is then known). Ablations
run without torch.compile: they step while the others compile. Every 15 s the logs and metrics go
into <out>/shakespeare_char_runs.tar.gz, so a call cut short still returns what ran.

`report` reads that file and writes <out>/shakespeare_char_<gpu>.{json,md,png}.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACK = "shakespeare_char_runs.tar.gz"
STEPS = 5000
TOKENS_PER_STEP = 64 * 256
DEFAULT_ARCH = ["model.pos_emb=rope", "model.norm=rmsnorm", "model.mlp=swiglu"]   # the experiment has nanoGPT's


@dataclass
class RunSpec:
    name: str
    label: str
    overrides: list[str] = field(default_factory=list)
    rank: str = "must"          # must | best (must until its best val is past) | ablation
    kill_order: int = 0         # ablations: the lowest is stopped first
    timed: bool = False         # gets a solo throughput window
    compiled: bool = True


RUNS = [
    RunSpec("nanogpt", "nanoGPT, its own code", timed=True),
    RunSpec("ours-nanogpt-arch", "ours, nanoGPT's architecture", [], timed=True),
    RunSpec("ours-default-arch", "ours, default architecture (RoPE, RMSNorm, SwiGLU)", DEFAULT_ARCH, rank="best",
            timed=True),
    RunSpec("fixed-windows", "nanoGPT's architecture, fixed windows (data.windows=fixed)",
            ["data.windows=fixed"], rank="ablation", kill_order=0, compiled=False),
    RunSpec("no-embedding-decay", "nanoGPT's architecture, embeddings not decayed (optim.decay_embeddings=false)",
            ["optim.decay_embeddings=false"], rank="ablation", kill_order=1, compiled=False),
    RunSpec("no-attention-dropout", "nanoGPT's architecture without attention dropout",
            ["model.attention_dropout=0"], rank="ablation", kill_order=2, compiled=False),
]
BY_NAME = {r.name: r for r in RUNS}

# Both implementations' step lines: nanoGPT prints "iter N: loss ..." every log_interval steps and
# "step N: train loss X, val loss Y" at each eval; train.py logs "step N/M | loss ...".
NANO_ITER = re.compile(r"iter (\d+): loss ([\d.]+)")
NANO_EVAL = re.compile(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)")
OURS_STEP = re.compile(r"step (\d+)/\d+ \| loss ([\d.]+).*?(?:val_loss ([\d.]+))?$")


# ----------------------------------------------------------------------------- processes

class Run:
    """One training process: its output, timestamped, in <work>/<name>/output.log, and its
    progress as (time, step) samples and (step, val loss) evaluations parsed from that output."""

    def __init__(self, spec: RunSpec, cmd: list[str], cwd: Path, env: dict, folder: Path):
        self.spec, self.folder = spec, folder
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "command.txt").write_text(" ".join(cmd) + "\n")
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1)
        self.samples: list[tuple[float, int]] = []
        self.evals: list[tuple[int, float]] = []
        self.stopped_at: int | None = None      # the step where the budget stopped it
        self.paused = False
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        with open(self.folder / "output.log", "w") as log:
            for line in self.proc.stdout:
                now = time.time()
                log.write(f"{now:.3f} {line}")
                log.flush()
                self._parse(now, line.rstrip())

    def _parse(self, now: float, line: str) -> None:
        if self.spec.name == "nanogpt":
            m = NANO_ITER.search(line)
            if m:
                self.samples.append((now, int(m.group(1))))
            m = NANO_EVAL.search(line)
            if m:
                self.evals.append((int(m.group(1)), float(m.group(3))))
            return
        m = OURS_STEP.search(line)
        if m:
            self.samples.append((now, int(m.group(1))))
            if m.group(3):
                self.evals.append((int(m.group(1)), float(m.group(3))))

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def step(self) -> int:
        return self.samples[-1][1] if self.samples else 0

    def seconds_per_step(self, window: float = 10.0) -> float | None:
        """Pace over the last `window` seconds of steps (None until there are enough)."""
        if len(self.samples) < 2:
            return None
        t_last, s_last = self.samples[-1]
        first = next(((t, s) for t, s in self.samples if t >= t_last - window), self.samples[0])
        if s_last - first[1] < 20 or t_last - first[0] < 2:
            return None
        return (t_last - first[0]) / (s_last - first[1])

    def best_is_past(self, rises: int = 3) -> bool:
        vals = [v for _, v in self.evals]
        if len(vals) <= rises:
            return False
        best = vals.index(min(vals))
        tail = vals[best:]
        return len(tail) > rises and all(b > a for a, b in zip(tail[-rises - 1:], tail[-rises:]))

    def signal(self, sig: int) -> None:
        if self.alive:
            os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        """Stop for the budget: resume it if paused, then SIGTERM (train.py saves and exits 143)."""
        if self.alive:
            self.stopped_at = self.step
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)


def nanogpt_command(args) -> list[str]:
    cmd = [sys.executable, "train.py", "config/train_shakespeare_char.py", f"--out_dir={args.work / 'nanogpt' / 'out'}",
           f"--eval_iters={args.nanogpt_eval_iters}", "--log_interval=10"]
    if args.smoke:
        cmd += ["--device=cpu", "--compile=False", "--dtype=float32", "--batch_size=4", "--block_size=64",
                "--n_layer=2", "--n_head=2", "--n_embd=64", f"--max_iters={args.steps}", f"--lr_decay_iters={args.steps}",
                "--eval_interval=10", "--warmup_iters=2"]
    return cmd


def ours_command(spec: RunSpec, args) -> list[str]:
    cmd = [sys.executable, str(REPO / "train.py"), "experiment=shakespeare-char", f"data.paths=[{args.text}]",
           f"run.dir={args.work / spec.name}", "logger=none", "trainer.progress=false", *spec.overrides]
    if not spec.compiled:
        cmd.append("trainer.compile=false")
    if args.smoke:
        cmd += ["device=cpu", "trainer.compile=false", "model.n_layer=2", "model.n_head=2", "model.n_kv_head=2",
                "model.d_model=64", "trainer.batch_size=4", "trainer.seq_len=64", "model.max_seq_len=64",
                f"trainer.max_steps={args.steps}", "trainer.eval_every=10", "optim.warmup_steps=2",
                "trainer.eval_batches=2", "trainer.ckpt_every=0"]
        cmd.append("attention=sdpa")   # CPU: the plumbing, through sdpa (the experiment's flash needs CUDA)
    from training.config import merge_overrides

    return [*cmd[:2], *merge_overrides(cmd[2:])]   # a key the smoke run sets again: once, its value


def solo_window(run: Run, others: list[Run], seconds: float, settle: float = 0.7) -> dict:
    """Pause every other run, let the GPU's queue drain, count `run`'s steps over `seconds`."""
    for o in others:
        o.signal(signal.SIGSTOP)
    try:
        time.sleep(settle)
        start = len(run.samples)
        time.sleep(seconds)
        window = run.samples[max(start - 1, 0):]
    finally:
        for o in others:
            o.signal(signal.SIGCONT)
    paces = sorted((t1 - t0) / (s1 - s0) for (t0, s0), (t1, s1) in zip(window, window[1:]) if s1 > s0)
    if len(paces) < 3:
        return {"run": run.spec.name, "error": "too few steps in the window"}
    # The median interval between step lines: an evaluation inside the window does not count.
    (t0, s0), (t1, s1) = window[0], window[-1]
    return {"run": run.spec.name, "steps": s1 - s0, "seconds": t1 - t0, "intervals": len(paces),
            "tokens_per_s": run.tokens_per_step / paces[len(paces) // 2],
            "tokens_per_s_mean": (s1 - s0) * run.tokens_per_step / (t1 - t0), "paused": [o.spec.name for o in others]}


def gpu_state() -> dict:
    """SM clock, power and load now (nvidia-smi), to tell sustained figures from burst ones."""
    query = "clocks.sm,power.draw,utilization.gpu,memory.used"
    try:
        line = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=5).stdout.strip().splitlines()[0]
        return dict(zip(("sm_mhz", "power_w", "util_pct", "memory_mib"), (float(v) for v in line.split(","))))
    except (OSError, IndexError, ValueError, subprocess.SubprocessError):
        return {}


def pack(args, runs: list[Run], events: dict) -> None:
    """The runs' logs, metrics and configs (no checkpoints) and the events, into one file under --out."""
    from training.run.files import replacing

    events = {**events, "runs": {r.spec.name: {"label": r.spec.label, "overrides": r.spec.overrides,
                                               "rank": r.spec.rank, "compiled": r.spec.compiled,
                                               "exit": r.proc.poll(), "stopped_at": r.stopped_at,
                                               "last_step": r.step} for r in runs}}
    args.out.mkdir(parents=True, exist_ok=True)
    with replacing(args.out / PACK) as tmp, tarfile.open(tmp, "w:gz") as tar:
        data = json.dumps(events, indent=2, default=str).encode()
        info = tarfile.TarInfo("events.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        for r in runs:
            for name in ("output.log", "command.txt", "metrics.jsonl", "config.yaml", "train_loss.json"):
                path = r.folder / name
                if path.is_file():
                    tar.add(path, arcname=f"{r.spec.name}/{name}")


def train_loss_command(run_dir: Path) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "train-loss", str(run_dir)]


def run(args) -> None:
    from _common import environment
    import torch

    names = [n for n in args.runs.split(",") if n]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ValueError(f"--runs: unknown run {unknown[0]!r}; known: {', '.join(BY_NAME)}")
    for bin_name in ("train.bin", "val.bin"):
        if "nanogpt" in names and not (args.nanogpt / "data" / "shakespeare_char" / bin_name).is_file():
            raise FileNotFoundError(f"{args.nanogpt}/data/shakespeare_char/{bin_name}: run its prepare.py first")
    if not args.text.is_file():
        raise FileNotFoundError(f"--text {args.text}: no such file")
    device = torch.device("cpu" if args.smoke else "cuda")
    events = {"environment": environment(device), "deadline_s": args.deadline, "solo": [], "stops": [], "gpu": [],
              "smoke": args.smoke, "steps": args.steps, "tokens_per_step": 4 * 64 if args.smoke else TOKENS_PER_STEP,
              "nanogpt_eval_iters": args.nanogpt_eval_iters}
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="disabled")
    if args.smoke:
        env["OMP_NUM_THREADS"] = "1"
    env.setdefault("FLASHTRAIN_CACHE", str(args.work / "cache"))
    start = time.time()
    runs = []
    for name in names:
        spec = BY_NAME[name]
        if name == "nanogpt":   # its own model.py, not our model package, on its path
            path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != REPO]
            r = Run(spec, nanogpt_command(args), args.nanogpt, dict(env, PYTHONPATH=os.pathsep.join(path)),
                    args.work / name)
        else:  # an uncompiled ablation skips the kernel's tile search too: it is not timed
            r = Run(spec, ours_command(spec, args), REPO, env if spec.compiled else dict(env, FLASHTRAIN_AUTOTUNE="0"),
                    args.work / name)
        r.tokens_per_step = events["tokens_per_step"]
        runs.append(r)
    deadline = start + args.deadline
    last_stop, last_pack, timed_done, evals = start, 0.0, False, {}
    while any(r.alive for r in runs):
        now = time.time()
        alive = [r for r in runs if r.alive]
        for r in runs:   # eval-mode train loss of each of ours that finished, while the others still run
            if r.proc.poll() == 0 and r.spec.name != "nanogpt" and r.spec.name not in evals:
                evals[r.spec.name] = subprocess.Popen(train_loss_command(r.folder), env=env,
                                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if now > deadline:
            for r in alive:
                r.stop()
                events["stops"].append({"run": r.spec.name, "step": r.stopped_at, "t": now - start, "why": "deadline"})
            break
        timed = [r for r in alive if r.spec.timed]
        if not timed_done and timed and all(r.seconds_per_step() is not None and len(r.samples) > 5 for r in timed):
            for r in timed:
                events["solo"].append({**solo_window(r, [o for o in alive if o is not r], args.solo_seconds),
                                       "gpu": gpu_state(), "t": time.time() - start})
            timed_done, last_stop = True, time.time()   # paces resettle before the next stop
            continue
        musts = [r for r in alive if r.spec.rank == "must" or (r.spec.rank == "best" and not r.best_is_past())]
        stoppable = sorted([r for r in alive if r not in musts],
                           key=lambda r: (r.spec.rank != "best", r.spec.kill_order))
        paces = [r.seconds_per_step() for r in musts]
        if stoppable and musts and None not in paces and now - last_stop > args.cooldown:
            finish = max(now + (args.steps - r.step) * p for r, p in zip(musts, paces))
            if finish > deadline - args.margin:
                victim = stoppable[0]
                victim.stop()
                events["stops"].append({"run": victim.spec.name, "step": victim.stopped_at, "t": now - start,
                                        "why": f"the must-finish runs would end {finish - start:.0f} s in"})
                last_stop = now
        if now - last_pack > 15:
            events["gpu"].append({"t": now - start, **gpu_state()})
            pack(args, runs, events)
            last_pack = now
        time.sleep(0.5)
    for r in runs:
        try:
            r.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            r.signal(signal.SIGKILL)
        r.reader.join(timeout=5)
    for r in runs:
        if r.proc.poll() == 0 and r.spec.name != "nanogpt" and r.spec.name not in evals:
            evals[r.spec.name] = subprocess.Popen(train_loss_command(r.folder), env=env,
                                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for p in evals.values():
        try:
            p.wait(timeout=max(5, deadline + args.eval_grace - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
    events["seconds"] = time.time() - start
    pack(args, runs, events)
    for r in runs:
        print(f"{r.spec.name}: exit {r.proc.poll()}, last step {r.step}, stopped at {r.stopped_at}, "
              f"best val {min((v for _, v in r.evals), default=float('nan')):.4f}")
    for s in events["solo"]:
        print("solo", s)


# ----------------------------------------------------------------------------- train loss in eval mode

def train_loss(run_dir: Path, batches: int = 50) -> None:
    """The finished run's loss on `batches` x 64 training windows spread evenly over the train split,
    in eval mode (no dropout), as nanoGPT's estimate_loss reports its train loss."""
    import _common  # noqa: F401
    import torch

    from training.builders import build_data
    from data.sampler import ValidationWindows
    from training.builders import load_model_for_eval
    from training.loop.evaluate import evaluate_loss

    model, cfg, _ = load_model_for_eval(run_dir / "model.safetensors", attention="sdpa")
    device = next(model.parameters()).device
    train = build_data(cfg, seq_len=cfg.trainer.seq_len, seed=cfg.seed).train
    windows = ValidationWindows(train.stream, cfg.trainer.seq_len, train.eot_id)
    loss = evaluate_loss(model, windows.batches(cfg.trainer.batch_size, batches), device, cfg.trainer.precision)
    (run_dir / "train_loss.json").write_text(json.dumps({"train_loss_eval_mode": loss, "batches": batches}) + "\n")


# ----------------------------------------------------------------------------- report

def read_pack(path: Path) -> tuple[dict, dict]:
    """(events, {run: {file name: text}}) from the file `run` wrote."""
    files: dict[str, dict[str, str]] = {}
    with tarfile.open(path) as tar:
        events = json.loads(tar.extractfile("events.json").read())
        for member in tar.getmembers():
            if "/" in member.name:
                run_name, name = member.name.split("/", 1)
                files.setdefault(run_name, {})[name] = tar.extractfile(member).read().decode()
    return events, files


def run_result(name: str, info: dict, files: dict, steps: int, solo: dict) -> dict:
    """One run's curve and figures from its own logs (nanoGPT's output, our metrics.jsonl)."""
    if name == "nanogpt":
        evals = [(int(m.group(1)), float(m.group(3)), float(m.group(2)))
                 for m in NANO_EVAL.finditer(files.get("output.log", ""))]
        curve = [(s, v) for s, v, _ in evals if s > 0]
        train_at_end = next((t for s, _, t in evals if s == steps), None)
        train_mode = None
    else:
        rows = [json.loads(line) for line in files.get("metrics.jsonl", "").splitlines() if line.strip()]
        curve = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        train_mode = next((r["loss"] for r in rows if r["step"] == steps), None)
        train_at_end = json.loads(files["train_loss.json"])["train_loss_eval_mode"] if "train_loss.json" in files else None
    best = min(curve, key=lambda sv: sv[1]) if curve else (None, None)
    return {"name": name, **info, "settings": settings_of(files.get("config.yaml")), "val_curve": curve, "best_val": best[1], "best_step": best[0],
            "val_at_end": next((v for s, v in curve if s == steps), None),
            "last_eval_step": curve[-1][0] if curve else None, "last_val": curve[-1][1] if curve else None,
            "train_loss_at_end_eval_mode": train_at_end, "train_loss_at_end_training_mode": train_mode,
            "tokens_per_s_solo": solo.get(name, {}).get("tokens_per_s")}


# nanoGPT's model.py and train.py read beside ours, line by line: what our earlier defaults
# did differently, and what the experiment does now. The ablation rows of the report measure the differences kept
# as settings; the others are the same in both or too small to matter at this size.
COMPARISON = [
    ("training windows", "random start per window, every batch", "fixed cut at multiples of 256 (3,921 windows)",
     "`data.windows=moving` (default): offset per epoch; ablation `fixed-windows`"),
    ("attention dropout", "0.2 on the attention probabilities (SDPA dropout_p)", "none",
     "`model.attention_dropout=0.2` in our kernel (attention=flash); ablation `no-attention-dropout`"),
    ("weight-decay groups", "every 2-D tensor, tied token table and position table included",
     "matrices only, embeddings exempt", "`optim.decay_embeddings=true` (default); ablation `no-embedding-decay`"),
    ("embedding / residual dropout", "on tok+pos, after each c_proj (attention, MLP)", "same", "same"),
    ("init", "N(0, 0.02); c_proj 0.02/sqrt(2 n_layer); biases 0", "same", "same"),
    ("bias, LayerNorm eps", "no biases (train.py), eps 1e-5", "same with model.bias=false, norm_eps 1e-5", "same"),
    ("GELU", "exact (erf)", "tanh approximation", "kept: activations differ by ~1e-3, not measured"),
    ("vocabulary", "65 characters", "256 bytes + EOT (257 ids), head padded to 320", "kept: the byte ids of an ASCII text"),
    ("lr schedule", "(it+1)/(warmup+1) warmup, cosine to min_lr at lr_decay_iters = max_iters", "same formula", "same"),
    ("AdamW, clipping", "eps 1e-8, fused on CUDA; clip_grad_norm 1.0", "same", "same (betas 0.9/0.99 in the experiment)"),
    ("loss under grad_accum", "loss / accum per micro-batch", "same", "same (accum 1 in this recipe)"),
    ("precision", "bf16 autocast, tf32 matmuls", "bf16 autocast", "same"),
    ("evaluation", "eval_iters random batches per split, eval mode", "fixed windows evenly spread, eval mode",
     "7 x 64 windows: the whole held-out split"),
]
REFERENCE = "ours-nanogpt-arch"   # the run the ablations each change one setting of


def ablation_table(results: list[dict], markdown_table) -> str:
    """Validation loss of each ablation at the steps it reached, beside the reference run's."""
    ref = next((r for r in results if r["name"] == REFERENCE), None)
    ablations = [r for r in results if r["rank"] == "ablation" and r["val_curve"]]
    if ref is None or not ablations:
        return ""
    reached = max(r["last_eval_step"] for r in ablations)
    steps = [s for s, _ in ref["val_curve"] if 1000 <= s <= reached]
    val = lambda r, s: dict(r["val_curve"]).get(s)  # noqa: E731
    rows = [[ref["label"], *(fmt(val(ref, s)) for s in steps)]]
    for r in ablations:
        rows.append([r["label"], *("-" if val(r, s) is None else f"{val(r, s):.3f} ({val(r, s) - val(ref, s):+.3f})"
                                   for s in steps)])
    return ("## Ablations: one setting of ours undone, validation loss (difference to the first row)\n\n"
            + markdown_table(["run", *(f"step {s}" for s in steps)], rows) + "\n")


def settings_of(config_yaml: str | None) -> str | None:
    """What a run of ours trained with, from the config.yaml it saved (whatever the experiment
    file said at the time): architecture, attention and its dropout, windows, decay groups."""
    if not config_yaml:
        return None
    from omegaconf import OmegaConf

    c = OmegaConf.create(config_yaml)
    return (f"{c.model.pos_emb} positions, {c.model.norm}, {c.model.mlp}; attention={c.attention.name}, "
            f"attention_dropout={c.model.get('attention_dropout', 0.0)}; data.windows={c.data.get('windows')}; "
            f"optim.decay_embeddings={c.optim.get('decay_embeddings')}; compile={c.trainer.compile}")


def fmt(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report(args) -> None:
    from _common import draw_safely, markdown_table, name_slug, new_figure, save_figure, write_json, write_text

    events, files = read_pack(args.pack)
    steps, env = events["steps"], events["environment"]
    # The machine's own folders say nothing about the result: name the inputs by what they are.
    env = {**env, "command": re.sub(r"--nanogpt \S+", "--nanogpt nanoGPT",
                                    re.sub(r"--text \S+", "--text input.txt", env["command"]))}
    solo = {s["run"]: s for s in events["solo"] if "tokens_per_s" in s}
    results = [run_result(name, info, files.get(name, {}), steps, solo) for name, info in events["runs"].items()]
    slug = "cpu_smoke" if env["device_type"] != "cuda" else name_slug(env["device"])
    stem = args.out / f"shakespeare_char_{slug}"
    write_json(stem.with_suffix(".json"), {"environment": env, "steps": steps, "deadline_s": events["deadline_s"],
                                           "seconds": events.get("seconds"), "stops": events["stops"],
                                           "solo": events["solo"], "runs": results})

    def status(r: dict) -> str:
        if r["exit"] == 0:
            return "finished"
        return f"stopped at step {r['stopped_at']} (device time)" if r["stopped_at"] is not None else f"exit {r['exit']}"

    rows = [[r["label"], f"{fmt(r['best_val'], 4)} ({r['best_step']})", fmt(r["val_at_end"], 4),
             fmt(r["last_val"], 4) + f" ({r['last_eval_step']})", fmt(r["train_loss_at_end_eval_mode"]),
             fmt(r["train_loss_at_end_training_mode"]),
             "-" if r["tokens_per_s_solo"] is None else f"{r['tokens_per_s_solo'] / 1e6:.2f}M",
             status(r)] for r in results]
    headers = ["run", "best val (step)", f"val at {steps}", "last val (step)", f"train at {steps}, eval mode",
               f"train at {steps}, training mode", "tokens/s alone", "status"]
    overrides = "\n".join(f"- {r['label']}: `{' '.join(r['overrides']) or '(none)'}`; trained with {r['settings']}"
                          for r in results if r["name"] != "nanogpt")
    solo_rows = [[s["run"], f"{s['tokens_per_s'] / 1e6:.2f}M", f"{s['tokens_per_s_mean'] / 1e6:.2f}M",
                  f"{s['steps']} in {s['seconds']:.2f} s", f"{s['gpu'].get('sm_mhz', '-')} MHz, "
                  f"{s['gpu'].get('power_w', '-')} W"] for s in events["solo"] if "tokens_per_s" in s]
    text = (f"# shakespeare-char: nanoGPT's own run and ours, same GPU, same call\n\n"
            f"{env['date']}, {env['device']}, torch {env['torch']}, triton {env['triton']}, "
            f"commit {env['git_commit']}. `{env['command']}`\n\n"
            f"Tiny-shakespeare (karpathy/char-rnn's input.txt, 1,115,394 characters), the last 111,540 held out "
            f"in both; 6 layers, 6 heads, d_model 384, dropout 0.2, context 256, batch 64, {steps} steps, lr 1e-3 "
            f"cosine to 1e-4, warmup 100, betas 0.9/0.99, weight decay 0.1, clip 1.0, bf16 autocast. nanoGPT "
            f"evaluates {events.get('nanogpt_eval_iters', 'its')} random batches per split every 250 steps; ours "
            f"the whole held-out split (7 batches of 64 windows) every 250 steps. The runs shared the GPU "
            f"(separate processes); tokens/s is each timed run alone on it for a few seconds, the others paused.\n\n"
            + markdown_table(headers, rows) + "\n"
            f"Our runs: `python train.py experiment=shakespeare-char data.paths=[input.txt]` (the experiment file of "
            f"the commit above) with these overrides; what each trained with is read from its saved config.yaml:"
            f"\n\n{overrides}\n\n"
            f"Runs the device time did not let finish were stopped by the script (`scripts/bench/bench_shakespeare_char.py`: "
            f"the must-finish runs go first); their curves up to there are in the JSON and the plot.\n\n"
            + ablation_table(results, markdown_table)
            + "## Throughput, each timed run alone on the GPU (the others paused)\n\n"
            + markdown_table(["run", "tokens/s (median interval)", "tokens/s (mean over the window)", "steps",
                              "GPU during the window"], solo_rows)
            + "\nThe median of the intervals between step lines leaves out an evaluation that falls in the "
              "window (nanoGPT's takes 2 x eval_iters forward passes); both implementations are timed the same "
              "way, in the same call, so their ratio is the comparison.\n\n"
            + "## nanoGPT's code against ours\n\n"
            + markdown_table(["", "nanoGPT", "ours, earlier defaults", "ours now"], COMPARISON))
    write_text(stem.with_suffix(".md"), text)

    def draw() -> None:
        fig, axes = new_figure(1, 1, figsize=(8, 5))
        ax = axes[0][0]
        for r in results:
            if r["val_curve"]:
                s, v = zip(*r["val_curve"])
                ax.plot(s, v, marker="o" if r["name"] == "nanogpt" else ".", ms=3, label=r["label"],
                        lw=2.2 if r["name"] in ("nanogpt", "ours-nanogpt-arch", "ours-default-arch") else 1.0)
        ax.axhline(1.4697, color="grey", ls=":", lw=1, label="nanoGPT README: 1.4697")
        ax.set_ylim(1.4, 2.1)
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss")
        ax.set_title(f"shakespeare-char on {env['device']}: validation loss")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        save_figure(fig, stem.with_suffix(".png"))

    draw_safely(__import__("_common").console(), draw)
    print(text)


# ----------------------------------------------------------------------------- cli

def parse_args(argv: list[str]) -> argparse.Namespace:
    from _common import argument_parser   # one-line errors (its subcommands' parsers are of its class)

    parser = argument_parser(__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train nanoGPT and our runs side by side, pack their logs")
    r.add_argument("--text", type=Path, required=True, help="tiny-shakespeare's input.txt")
    r.add_argument("--nanogpt", type=Path, required=True, help="a karpathy/nanoGPT checkout, data prepared")
    r.add_argument("--work", type=Path, required=True, help="folder for the runs' folders")
    r.add_argument("--out", type=Path, required=True, help="folder for the pack of logs")
    r.add_argument("--runs", default=",".join(BY_NAME), help=f"comma-separated, of {', '.join(BY_NAME)}")
    r.add_argument("--deadline", type=float, default=150, help="seconds until every run still going is stopped")
    r.add_argument("--margin", type=float, default=8, help="seconds kept free before the deadline")
    r.add_argument("--cooldown", type=float, default=12, help="seconds between two stops (the pace resettles)")
    r.add_argument("--solo-seconds", type=float, default=2.5, help="length of each solo throughput window")
    r.add_argument("--eval-grace", type=float, default=25, help="seconds past the deadline for train-loss evals")
    r.add_argument("--nanogpt-eval-iters", type=int, default=40, help="nanoGPT's eval_iters (its default: 200)")
    r.add_argument("--smoke", action="store_true", help="tiny models on the CPU: the plumbing, not a benchmark")
    r.add_argument("--steps", type=int, default=None, help="steps (default 5000; --smoke: 30)")
    t = sub.add_parser("train-loss", help="(internal) eval-mode train loss of a finished run")
    t.add_argument("run_dir", type=Path)
    p = sub.add_parser("report", help="json, markdown and plot from a pack")
    p.add_argument("--pack", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "run":
        args.steps = args.steps or (30 if args.smoke else STEPS)
        if args.steps != STEPS and not args.smoke:
            raise ValueError("--steps other than 5000 is for --smoke: the benchmark is the recipe's 5000 steps")
        args.text, args.nanogpt, args.work = args.text.resolve(), args.nanogpt.resolve(), args.work.resolve()
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.command == "run":
        run(args)
    elif args.command == "train-loss":
        train_loss(args.run_dir)
    else:
        report(args)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # scripts/, for _common (which puts the repo root first)
    import _common  # noqa: F401  (puts the repo root on sys.path)
    from _common import run_cli

    run_cli(main)
