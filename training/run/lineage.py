"""A start written down: how a run starts in its folder (`Start`, planned by training.run.resume)
and what it leaves in `lineage.jsonl` and `superseded/`.

One run per `run.dir`. A run has an id (its lineage), recorded in every checkpoint it writes
and in `run.dir/lineage.jsonl`, one row per start (fresh, resumed, rewound or branched, with the
config changes it accepted). A rewind (or a restart from step 0) moves the run's later files
(checkpoints, metrics rows, the final weights) to `superseded/<time>-after-step_N/`: nothing is
deleted.

Setting files aside is journaled: `superseded/<time>/rewind.json` is written first and removed
last, and every step in between can be done again, so a start killed half-way (metrics cut,
checkpoints not yet moved) is finished by the next start, under the lock, before it looks at the
folder (`recover`).
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from training.run.files import (CHECKPOINTS, DATA_CHANGES, LINEAGE, METRICS, SUPERSEDED, TEXT, WEIGHTS, append_line,
                                read_json_lines, remove_temp_files, write_text)
from training.run.metrics import MetricsFile
from training.run.store import CheckpointError, CheckpointStore, peek_lineage, step_of

log = logging.getLogger(__name__)

LINEAGE_FIELDS = {"run_id": (*TEXT, type(None)), "event": TEXT}
REWIND_PLAN = "rewind.json"   # in a superseded/ folder while its files are being moved there


@dataclass
class Start:
    """How a run starts in its folder (training.run.resume.plan_start decides it); `record` writes it
    to lineage.jsonl once the run is accepted."""
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
    path = Path(run_dir) / LINEAGE
    if not path.is_file():
        return None
    ids = [row["run_id"] for row in read_json_lines(path, LINEAGE_FIELDS)]
    return ids[-1] if ids else None


def superseded_dir(run_dir: str | Path, start: Start) -> Path | None:
    """Where a rewind (or a restart from step 0) moves its run's later files (None when nothing is set aside)."""
    if not start.sets_aside:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return Path(run_dir) / SUPERSEDED / f"{stamp}-after-step_{start.step:08d}"


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
        append_line(run_dir / LINEAGE, json.dumps(row))
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
        log.warning("started over from step 0: the %s rows logged before are in %s", METRICS, aside)


def set_aside(run_dir: Path, aside: Path) -> None:
    """Carry out the plan in `aside`/rewind.json: the run's metrics rows past its step, its later
    checkpoints and the final weights into `aside`, then the lineage (and data change) rows, then
    the plan removed. Each step can be done again after a kill (idempotent), in this order: the
    rows are copied before they are cut, files are moved by one rename each, a row already appended
    is not appended twice."""
    plan = json.loads((aside / REWIND_PLAN).read_text())
    step, run_id = int(plan["step"]), plan["run_id"]
    metrics = run_dir / METRICS
    rows = MetricsFile.read(metrics) if metrics.is_file() else []
    if any(r["step"] > step for r in rows):
        MetricsFile.write(aside / METRICS, [r for r in rows if r["step"] > step])
        MetricsFile.write(metrics, [r for r in rows if r["step"] <= step])
    later = [p for p in CheckpointStore(run_dir).list() if step_of(p) > step and _is_of(p, run_id)]
    if later:
        (aside / CHECKPOINTS).mkdir(exist_ok=True)
    for path in later:
        path.replace(aside / CHECKPOINTS / path.name)
    if (run_dir / WEIGHTS).exists():
        (run_dir / WEIGHTS).replace(aside / WEIGHTS)
    lineage = run_dir / LINEAGE
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
    for plan in sorted((run_dir / SUPERSEDED).glob(f"*/{REWIND_PLAN}")):
        log.warning("finishing the setting aside of %s that an interrupted start left half done", plan.parent)
        set_aside(run_dir, plan.parent)
    remove_temp_files(run_dir)
