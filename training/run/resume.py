"""What `resume=` means for a run folder: which checkpoint to load, which run the folder holds,
and which differences from the checkpoint's training config are accepted.

One run per `run.dir`. A run has an id (its lineage), recorded in every checkpoint it writes
and in `run.dir/lineage.jsonl`, one row per start (fresh, resumed, rewound or branched, with the
config changes it accepted). Pruning and `resume=auto` look only at that run's checkpoints:
another run's file dropped into the folder is never deleted, never counted as kept, never
resumed from.

- `resume=null` (fresh): refused where the folder already holds a run (checkpoints,
  `metrics.jsonl` rows, `model.safetensors`).
- `resume=auto`: the newest usable checkpoint of the folder's run. None at all (the run stopped
  before its first save): start over from step 0, its `metrics.jsonl` rows moved to
  `superseded/<time>/`. Unusable ones only, or final weights without checkpoints: refuse
  (starting over would replace what they are evidence of).
- `resume=<file>`: a checkpoint of the folder's own run rewinds it: its checkpoints past that
  step, their metrics rows and the final `model.safetensors` are moved to `superseded/<time>/`
  (nothing is deleted). A checkpoint of another run starts a branch: allowed only into a folder
  that holds no run yet; the branch gets its own id and records where it came from.

Setting files aside is journaled: `superseded/<time>/rewind.json` is written first and removed
last, and every step in between can be done again, so a start killed half-way (metrics cut,
checkpoints not yet moved) is finished by the next start, under the lock, before it looks at the
folder (`recover`).

Continuing a run (auto, or a rewind) compares the training config (`trainer`, `optim`, `data`)
with the checkpoint's: a difference that changes the numbers the run computes is refused in one
line listing the keys unless named in `allow_changes=[key, group, ...]`; accepted changes go
into lineage.jsonl. A branch may change them (that is what a branch is for): they are recorded
and logged. Keys that change only how the run is observed or executed (`FREE_ON_RESUME`) may
always change; those no run can continue under another value of (`CHECKED_ELSEWHERE`: the seed,
the sequence length, ...) are refused by the check that reads them.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from training.run.store import (ANY_RUN, DATA_CHANGES, CheckpointError, check_model_config, check_unchanged,
                                 checkpoint_dir, latest_checkpoint, lineage_id, list_checkpoints, load_checkpoint,
                                 peek_lineage, step_of)
from training.run.dcp import is_sharded_checkpoint
from training.interop.weights import WEIGHTS_NAME
from training.loop.loggers import MetricsFile
from training.run.files import TEXT, append_line, read_json_lines, remove_temp_files, write_text

log = logging.getLogger(__name__)

LINEAGE_FILE = "lineage.jsonl"
LINEAGE_FIELDS = {"run_id": (*TEXT, type(None)), "event": TEXT}
METRICS_FILE = "metrics.jsonl"
SUPERSEDED_DIR = "superseded"
TRAINING_GROUPS = ("trainer", "optim", "data")
# Keys outside the `model` group that change what the model computes: a resume must keep them.
COMPUTE_KEYS = ("data.document_mask", "attention.window")
# Keys that change how a run is observed, stored or executed, not the numbers it computes.
FREE_ON_RESUME = {
    "trainer": ("progress", "log_every", "eval_every", "eval_batches", "ckpt_every", "keep_ckpts", "compile",
                "peak_flops", "dist_timeout_s", "parallel", "context_parallel", "deterministic", "cpu_threads"),
    "optim": ("fused",),
    "data": ("cache_dir", "verify_cache", "allow_changed"),
}
# Keys a run can never continue under another value of, each refused by the check that knows what
# it means (old checkpoints included), so not compared here and not open to allow_changes.
CHECKED_ELSEWHERE = {"seed": "the data sampler", "trainer.seq_len": "the data sampler",
                     "data.windows": "the data sampler", "optim.decay_embeddings": "the optimizer's parameter groups",
                     "data.document_mask": "the model"}


@dataclass
class Start:
    """How a run starts in its folder; `record` writes it to lineage.jsonl once the run is accepted."""
    run_id: str | None                         # None: a run from before lineages were recorded
    event: str                                 # start | restart | resume | rewind | branch
    checkpoint: Path | None = None
    state: dict | None = None
    parent: dict | None = None                 # a branch's origin: {"id", "step", "checkpoint"}
    superseded: list[Path] = field(default_factory=list)   # a rewind's later checkpoints, moved aside
    sets_aside: bool = False                                # later files (checkpoints, rows, weights) go aside
    changes: dict = field(default_factory=dict)             # accepted config differences: key -> [old, new]
    step: int = 0                                           # the checkpoint's step

    def __post_init__(self) -> None:
        if self.state is not None:
            self.step = int(self.state["step"])

    @property
    def lineage(self) -> dict:
        """What every checkpoint of this run records."""
        return {"id": self.run_id, "parent": self.parent}


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def recorded_run_id(run_dir: str | Path) -> str | None:
    """The run lineage.jsonl names (its last row), or None when the folder has none."""
    path = Path(run_dir) / LINEAGE_FILE
    if not path.is_file():
        return None
    ids = [row["run_id"] for row in read_json_lines(path, LINEAGE_FIELDS)]
    return ids[-1] if ids else None


def checkpoint_to_load(source: Path) -> tuple[Path, dict]:
    """(path, state) of a checkpoint (a file or a DCP folder), or of a run folder's newest usable checkpoint written by
    the run its lineage.jsonl names (any run's in a folder without one): what the scripts that
    read a trained run (evals, export) take as their argument."""
    if not source.is_dir() or is_sharded_checkpoint(source):   # a file, or one FSDP run's DCP folder
        return source, load_checkpoint(source)
    found = latest_checkpoint(checkpoint_dir(source), recorded_run_id(source) or ANY_RUN)
    if found is None:
        raise ValueError(f"{source} holds no usable checkpoint under checkpoints/")
    return found


def metric_steps(run_dir: str | Path) -> list[int]:
    path = Path(run_dir) / METRICS_FILE
    return [r["step"] for r in MetricsFile.read(path)] if path.is_file() else []


def run_evidence(run_dir: str | Path) -> str:
    """What in `run_dir` shows a run was there ('' for none): checkpoints, metric rows, weights."""
    found = []
    if list_checkpoints(checkpoint_dir(run_dir)):
        found.append("checkpoints/")
    steps = metric_steps(run_dir)
    if steps:
        found.append(f"{METRICS_FILE} up to step {max(steps)}")
    if (Path(run_dir) / WEIGHTS_NAME).exists():
        found.append(WEIGHTS_NAME)
    return ", ".join(found)


def _runs_by_file(ckpt_dir: Path) -> tuple[dict[Path, str | None], list[Path]]:
    """({readable checkpoint: the run id it names}, unreadable checkpoints, warned about), oldest
    first. Read without hashing: only the checkpoint a run resumes from is verified in full."""
    readable, unreadable = {}, []
    for path in list_checkpoints(ckpt_dir):
        try:
            readable[path] = peek_lineage(path)
        except CheckpointError as e:
            log.warning("skipping %s", e)
            unreadable.append(path)
    return readable, unreadable


def _folder_run(run_dir: Path, usable: dict[Path, str | None]) -> str | None:
    """The folder's own run: the one lineage.jsonl names, else the one run its checkpoints are of
    (None for a folder from before lineages were recorded, or an empty one)."""
    recorded = recorded_run_id(run_dir)
    if recorded is not None:
        return recorded
    runs = set(usable.values())
    if len(runs) > 1:
        names = ", ".join(sorted(f"{p.name} (run {r or 'unrecorded'})" for p, r in usable.items()))
        raise CheckpointError(f"run.dir={run_dir} holds checkpoints of {len(runs)} runs and no {LINEAGE_FILE} saying "
                              f"which is its own ({names}): pass resume=<one of them>, or move the others out")
    return next(iter(runs), None)


def _refuse_foreign_in_the_way(run_dir: Path, usable: dict, run_id: str | None, start: int, max_steps: int) -> None:
    """Warn about other runs' checkpoints; refuse when this run would write over one of them."""
    foreign = {p: r for p, r in usable.items() if r != run_id}
    for path, other in foreign.items():
        log.warning("%s belongs to another run (%s): kept, not counted, not resumed from", path, other or "unrecorded")
    in_the_way = [p for p in foreign if start < step_of(p) <= max_steps]
    if in_the_way:
        raise CheckpointError(f"run.dir={run_dir}: {in_the_way[0]} belongs to another run "
                              f"({foreign[in_the_way[0]] or 'unrecorded'}) and this run would write over it at step "
                              f"{step_of(in_the_way[0])}: move it out of {checkpoint_dir(run_dir)}")


def plan_start(cfg: DictConfig, run_dir: str | Path) -> Start:
    """The run's start in `run_dir` from `cfg.resume`; CheckpointError / ValueError (one line) when
    the folder or the checkpoint does not allow it. Reads only: nothing is written here."""
    run_dir, resume = Path(run_dir), cfg.get("resume")
    ckpt_dir, max_steps = checkpoint_dir(run_dir), int(cfg.trainer.max_steps)
    check_allow_changes(cfg)
    for read in (metric_steps, recorded_run_id):   # a hand-edited row of either file: one line now, before any work
        read(run_dir)
    if resume is None:
        if list_checkpoints(ckpt_dir):
            raise ValueError(f"run.dir={run_dir} already holds checkpoints: pass resume=auto to continue "
                             f"that run, or choose another run.dir")
        evidence = run_evidence(run_dir)
        if evidence:
            raise ValueError(f"run.dir={run_dir} already holds a run ({evidence}): pass resume=auto to continue it, "
                             f"or choose another run.dir")
        return Start(new_run_id(), "start")
    if resume != "auto" and Path(resume).is_dir() and not is_sharded_checkpoint(resume):
        raise CheckpointError(f"resume={resume} is a folder: pass a checkpoint (<run.dir>/checkpoints/"
                              f"step_XXXXXXXX.pt or .dcp), or run.dir={resume} resume=auto to continue that run")
    usable, unusable = _runs_by_file(ckpt_dir)
    own = _folder_run(run_dir, usable)
    if resume == "auto":
        start = _plan_auto(run_dir, usable, unusable, own)
    else:
        start = _plan_path(run_dir, Path(resume), usable, own)
    if start.state is not None and start.event != "branch":
        _refuse_foreign_in_the_way(run_dir, usable, own, start.step, max_steps)
    if start.state is not None:  # what the model computes first, then how it is trained
        saved = start.state["config"]
        check_model_config(start.checkpoint, saved.get("model", {}), OmegaConf.to_container(cfg.model))
        check_unchanged(start.checkpoint, saved, cfg, COMPUTE_KEYS)
        start.changes = accepted_changes(start, cfg, run_dir)
    return start


def _plan_auto(run_dir: Path, usable: dict, unusable: list, own: str | None) -> Start:
    ckpt_dir = checkpoint_dir(run_dir)
    mine = [p for p, r in usable.items() if r == own]
    for path in reversed(mine):  # newest first; one that fails its checksum is skipped
        try:
            state = load_checkpoint(path)
        except CheckpointError as e:
            log.warning("skipping %s", e)
            unusable.append(path)
            continue
        # own is None for a run from before lineages were recorded: it goes on as that unrecorded run.
        return Start(own, "resume", path, state, (state.get("lineage") or {}).get("parent"))
    if unusable:
        raise CheckpointError(f"resume=auto: none of the {len(unusable)} checkpoint(s) in {ckpt_dir} is "
                              f"usable (see the warnings above); move them aside to start over from step 0")
    if usable:
        raise CheckpointError(f"resume=auto: every checkpoint in {ckpt_dir} belongs to another run than "
                              f"run.dir={run_dir}'s own ({own or 'unrecorded'}): move them out, or branch from one "
                              f"with resume=<its path> into an empty run.dir")
    if (run_dir / WEIGHTS_NAME).exists():   # a finished run whose checkpoints were removed
        raise CheckpointError(f"resume=auto: run.dir={run_dir} holds {run_evidence(run_dir)} but no checkpoint: "
                              f"starting over would replace them; move them aside (or choose another run.dir) to "
                              f"start from step 0")
    steps = metric_steps(run_dir)
    if steps:   # stopped before its first checkpoint: nothing to continue from, nothing lost by starting over
        log.warning("resume=auto: no checkpoint in %s (the run stopped before its first was saved): starting over "
                    "from step 0", ckpt_dir)
    else:
        log.info("resume=auto: no checkpoint in %s, starting from step 0", ckpt_dir)
    return Start(own or new_run_id(), "restart" if own or steps else "start", sets_aside=bool(steps))


def _plan_path(run_dir: Path, path: Path, usable: dict, own: str | None) -> Start:
    state = load_checkpoint(path)
    source = lineage_id(state)
    evidence = run_evidence(run_dir)
    in_own_folder = path.resolve().parent == checkpoint_dir(run_dir).resolve()
    if not evidence:
        parent = {"id": source, "step": int(state["step"]), "checkpoint": str(path.resolve())}
        return Start(new_run_id(), "branch", path, state, parent)
    if (source is not None and source == own) or (source is None and own is None and in_own_folder):
        later = [p for p, r in usable.items() if r == own and step_of(p) > int(state["step"])]
        return Start(own, "rewind" if later else "resume", path, state,
                     (state.get("lineage") or {}).get("parent"), superseded=later, sets_aside=bool(later))
    raise CheckpointError(f"resume={path}: that checkpoint belongs to run {source or 'unrecorded'}, but run.dir="
                          f"{run_dir} holds run {own or 'unrecorded'} ({evidence}): one folder holds one run; "
                          f"branch into an empty run.dir, or continue this one with resume=auto")


# ----------------------------------------------------------------------------- training config

def check_allow_changes(cfg: DictConfig) -> None:
    for entry in cfg.get("allow_changes") or []:
        if entry in CHECKED_ELSEWHERE:
            raise ValueError(f"allow_changes: {entry} cannot change within a run ({CHECKED_ELSEWHERE[entry]} depends "
                             f"on it): start a new run.dir")
        if str(entry).split(".")[0] not in TRAINING_GROUPS:
            raise ValueError(f"allow_changes: {entry!r} is not a training setting (expected trainer, optim, data or "
                             f"one of their keys, e.g. trainer.max_steps)")


def training_differences(saved_cfg: dict, cfg: DictConfig) -> dict[str, list]:
    """{"group.key": [checkpoint's value, this run's]} over the training groups, leaving out
    FREE_ON_RESUME and CHECKED_ELSEWHERE. A key the checkpoint's config lacks (added since) is not
    compared: what runs before it did is the concern of the check that reads it (the data
    sampler's state, the optimizer's parameter groups), not the schema's default."""
    diffs = {}
    for group in TRAINING_GROUPS:
        old, new = saved_cfg.get(group, {}), OmegaConf.to_container(cfg[group], resolve=True)
        for key in sorted(set(old) & set(new)):
            name = f"{group}.{key}"
            if key not in FREE_ON_RESUME.get(group, ()) and name not in CHECKED_ELSEWHERE and old[key] != new[key]:
                diffs[name] = [old[key], new[key]]
    return diffs


def _allowed(key: str, allow: list[str]) -> bool:
    return any(key == a or key.startswith(f"{a}.") for a in allow)


def accepted_changes(start: Start, cfg: DictConfig, run_dir: Path) -> dict[str, list]:
    """The differences from the checkpoint's training config this start accepts; CheckpointError
    listing the others. A branch accepts them all (logged)."""
    diffs = training_differences(start.state["config"], cfg)
    if start.event == "branch":
        if diffs:
            log.warning("branch from %s with other training settings: %s", start.checkpoint, _describe(diffs))
        return diffs
    allow = [str(a) for a in cfg.get("allow_changes") or []]
    if cfg.data.get("allow_changed"):
        allow.append("data")  # continuing on other data: the data keys say which
    refused = {k: v for k, v in diffs.items() if not _allowed(k, allow)}
    if refused:
        allow_them = (f"pass allow_changes=[{','.join(refused)}] to continue with the new values (recorded in "
                      f"{run_dir / LINEAGE_FILE})")
        preset = left_out_preset(start.state["config"], cfg, refused)
        advice = (f"the run was made with experiment={preset}, which this command leaves out: add "
                  f"experiment={preset} (as the run's `resume with:` line does), or {allow_them}" if preset
                  else f"{allow_them}, or the checkpoint's values")
        raise CheckpointError(f"checkpoint {start.checkpoint} was trained with other training settings: "
                              f"{_describe(refused)}; {advice}")
    if diffs:
        log.warning("continuing with changed training settings (allow_changes): %s", _describe(diffs))
    return diffs


def left_out_preset(saved_cfg: dict, cfg: DictConfig, refused: dict[str, list]) -> str | None:
    """The preset (configs/experiment/) the checkpoint's run was made with, when this command left
    it out: the one its run.name names (each preset names its runs after itself), when this run's
    name differs and the preset sets the refused keys it sets to the checkpoint's values."""
    from training.config import CONFIG_DIR
    from training.run.records import flatten

    name = (saved_cfg.get("run") or {}).get("name")
    path = CONFIG_DIR / "experiment" / f"{name}.yaml"
    if not name or name == cfg.run.get("name") or not path.is_file():
        return None
    preset = flatten(OmegaConf.to_container(OmegaConf.load(path)))
    set_there = [key for key in refused if key in preset]
    return name if set_there and all(preset[key] == refused[key][0] for key in set_there) else None


def _describe(diffs: dict) -> str:
    return "; ".join(f"{k}={old!r} in checkpoint, {new!r} now" for k, (old, new) in diffs.items())


# ----------------------------------------------------------------------------- writing it down

def superseded_dir(run_dir: str | Path, start: Start) -> Path | None:
    """Where a rewind (or a restart from step 0) moves its run's later files (None when nothing is set aside)."""
    if not start.sets_aside:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return Path(run_dir) / SUPERSEDED_DIR / f"{stamp}-after-step_{start.step:08d}"


REWIND_PLAN = "rewind.json"   # in a superseded/ folder while its files are being moved there


def record(run_dir: str | Path, start: Start, aside: Path | None, data_change: dict | None = None) -> None:
    """Append the start to lineage.jsonl (and a data change to data_changes.jsonl); with `aside`,
    first move the run's files past the start's step there (set_aside). Called once the run is
    accepted, on the process that writes."""
    run_dir = Path(run_dir)
    row = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "run_id": start.run_id,
           "event": start.event, "step": start.step, "checkpoint": str(start.checkpoint) if start.checkpoint else None}
    if start.parent and start.event == "branch":
        row["parent"] = start.parent
    if start.changes:
        row["changes"] = start.changes
    if aside is None:
        append_line(run_dir / LINEAGE_FILE, json.dumps(row))
        if data_change is not None:
            append_line(run_dir / DATA_CHANGES, json.dumps(data_change))
        return
    row["superseded"] = str(aside.relative_to(run_dir))
    aside.mkdir(parents=True, exist_ok=True)
    write_text(aside / REWIND_PLAN, json.dumps({"step": start.step, "run_id": start.run_id, "lineage": row,
                                                "data_change": data_change}))
    set_aside(run_dir, aside)
    if start.event == "rewind":
        log.warning("rewound to step %d: the later checkpoints, metrics and weights are in %s", start.step, aside)
    else:
        log.warning("started over from step 0: the %s rows logged before are in %s", METRICS_FILE, aside)


def set_aside(run_dir: Path, aside: Path) -> None:
    """Carry out the plan in `aside`/rewind.json: the run's metrics rows past its step, its later
    checkpoints and the final weights into `aside`, then the lineage (and data change) rows, then
    the plan removed. Each step can be done again after a kill (idempotent), in this order: the
    rows are copied before they are cut, files are moved by one rename each, a row already appended
    is not appended twice."""
    plan = json.loads((aside / REWIND_PLAN).read_text())
    step, run_id = int(plan["step"]), plan["run_id"]
    metrics = run_dir / METRICS_FILE
    rows = MetricsFile.read(metrics) if metrics.is_file() else []
    if any(r["step"] > step for r in rows):
        MetricsFile.write(aside / METRICS_FILE, [r for r in rows if r["step"] > step])
        MetricsFile.write(metrics, [r for r in rows if r["step"] <= step])
    later = [p for p in list_checkpoints(checkpoint_dir(run_dir)) if step_of(p) > step and _is_of(p, run_id)]
    if later:
        (aside / "checkpoints").mkdir(exist_ok=True)
    for path in later:
        path.replace(aside / "checkpoints" / path.name)
    if (run_dir / WEIGHTS_NAME).exists():
        (run_dir / WEIGHTS_NAME).replace(aside / WEIGHTS_NAME)
    lineage = run_dir / LINEAGE_FILE
    recorded = read_json_lines(lineage, LINEAGE_FIELDS) if lineage.is_file() else []
    if not any(r.get("superseded") == plan["lineage"]["superseded"] for r in recorded):
        append_line(lineage, json.dumps(plan["lineage"]))
    change, changes = plan.get("data_change"), run_dir / DATA_CHANGES
    if change is not None and change not in (read_json_lines(changes, {}) if changes.is_file() else []):
        append_line(changes, json.dumps(change))
    (aside / REWIND_PLAN).unlink()


def _is_of(path: Path, run_id: str | None) -> bool:
    try:
        return peek_lineage(path) == run_id
    except CheckpointError:   # unreadable: whoever wrote it, it stays where it is
        return False


def recover(run_dir: str | Path) -> None:
    """What a start or a save killed half-way left in `run_dir`, put right before a new start looks
    at the folder (under its lock, on the process that writes): a rewind or restart whose files were
    being set aside is finished, and the temporary files of the run's own names are removed."""
    run_dir = Path(run_dir)
    for plan in sorted((run_dir / SUPERSEDED_DIR).glob(f"*/{REWIND_PLAN}")):
        log.warning("finishing the setting aside of %s that an interrupted start left half done", plan.parent)
        set_aside(run_dir, plan.parent)
    remove_temp_files(run_dir)
