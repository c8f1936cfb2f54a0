"""Run folders read back: what a run reached, and how several runs differ.

Reads only a run folder's contract, `config.yaml` and `metrics.jsonl`, so it works on finished,
interrupted and still running runs alike. Used by the end-of-run summary (training/run/report.py),
the table train.py prints when a sweep (`-m`) ends, and scripts/compare_runs.py.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from training.run.files import CONFIG, METRICS
from training.run.metrics import MetricsFile

# Keys a comparison leaves out: they differ between any two runs (run.dir), or change nothing the
# table or the curves show, neither the numbers a run computes nor its speed (how it was started,
# where its cache is, how often it checkpoints, whether it draws a progress bar).
IGNORED_KEYS = ("run.dir", "run.latest", "resume", "allow_changes", "trainer.progress", "trainer.ckpt_every",
                "trainer.keep_ckpts", "trainer.dist_timeout_s", "data.cache_dir", "data.verify_cache",
                "data.allow_changed", "logger.init_timeout_s")


@dataclass
class RunRecord:
    path: Path
    config: dict          # flat "group.key" -> value, as the run resolved it
    rows: list[dict]      # metrics.jsonl, one row per logged step

    @property
    def steps(self) -> int:
        return self.rows[-1]["step"] if self.rows else 0

    @property
    def tokens(self) -> int:
        return self.rows[-1]["tokens"] if self.rows else 0

    @property
    def final_loss(self) -> float | None:
        return self.rows[-1]["loss"] if self.rows else None

    def val_rows(self) -> list[dict]:
        return [r for r in self.rows if r.get("val_loss") is not None and math.isfinite(r["val_loss"])]

    @property
    def final_val(self) -> float | None:
        rows = self.val_rows()
        return rows[-1]["val_loss"] if rows else None

    @property
    def best_val(self) -> tuple[float, int] | None:
        """(lowest validation loss, its step)."""
        rows = self.val_rows()
        if not rows:
            return None
        best = min(rows, key=lambda r: r["val_loss"])
        return best["val_loss"], best["step"]

    @property
    def peak_memory(self) -> int | None:
        """The largest GPU memory peak the rows logged (bytes; None for a CPU run)."""
        peaks = [r["peak_memory_bytes"] for r in self.rows if r.get("peak_memory_bytes") is not None]
        return max(peaks) if peaks else None

    @property
    def tokens_per_s(self) -> float | None:
        """Median over the logged rows after the first (which includes compilation and warm-up)."""
        rates = [r["tokens_per_s"] for r in self.rows[1:] or self.rows if r.get("tokens_per_s")]
        return statistics.median(rates) if rates else None


def flatten(node: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in node.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def is_run(path: Path) -> bool:
    return (path / METRICS).is_file() or (path / CONFIG).is_file()


def read_run(path: str | Path) -> RunRecord:
    """One run folder; ValueError naming it when it holds neither config.yaml nor metrics.jsonl."""
    path = Path(path)
    if not is_run(path):
        raise ValueError(f"{path} is not a run folder (no config.yaml or metrics.jsonl)")
    config_file, metrics_file = path / CONFIG, path / METRICS
    config = flatten(read_config(config_file)) if config_file.is_file() else {}
    rows = MetricsFile.read(metrics_file) if metrics_file.is_file() else []
    return RunRecord(path, config, rows)


def read_config(path: Path) -> dict:
    """A run's config.yaml as a dict; ValueError naming the file when it is not a YAML mapping."""
    try:
        config = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as e:  # noqa: BLE001 (yaml's and OmegaConf's errors: one line naming the file)
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{path} is not a run's config (YAML mapping): {reason}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a run's config (YAML mapping): it holds a {type(config).__name__}")
    return config


def _job_order(path: Path):
    return (0, int(path.name), "") if path.name.isdigit() else (1, 0, path.name)


def find_runs(paths: list[str | Path]) -> list[RunRecord]:
    """Each path a run folder, or a folder of run folders (a sweep: multirun/<date>/<time>, its jobs
    in job order). ValueError naming a path that is neither."""
    runs = []
    for path in map(Path, paths):
        if not path.is_dir():
            raise ValueError(f"{path}: no such run folder")
        if is_run(path):
            runs.append(read_run(path))
            continue
        jobs = sorted((p for p in path.iterdir() if p.is_dir() and is_run(p)), key=_job_order)
        if not jobs:
            raise ValueError(f"{path} is neither a run folder (config.yaml, metrics.jsonl) nor a folder of runs")
        runs.extend(read_run(p) for p in jobs)
    return runs


def differing_keys(runs: list[RunRecord]) -> list[str]:
    """Config keys whose value is not the same in every run (a key a run lacks counts as different)."""
    keys = dict.fromkeys(k for run in runs for k in run.config if k not in IGNORED_KEYS)
    missing = object()
    return [k for k in keys if len({repr(run.config.get(k, missing)) for run in runs}) > 1]


def short(value, width: int = 32) -> str:
    text = "-" if value is None else str(value)
    return text if len(text) <= width else text[:width - 1] + "…"


def key_label(key: str) -> str:
    """'attention.name' -> 'attention', 'trainer.seq_len' -> 'seq_len': short enough for a legend."""
    group, _, leaf = key.rpartition(".")
    return group if leaf == "name" and group else leaf


LABEL_KEYS = 3   # differing keys a legend entry names; the table names them all


def run_label(run: RunRecord, keys: list[str], most: int = LABEL_KEYS) -> str:
    """The run's folder name and its values of the first `most` keys that differ: a plot legend entry
    (runs differing in many keys, as two recipes do, would otherwise get a legend wider than the
    figure; the table lists them all)."""
    values = ", ".join(f"{key_label(k)}={short(run.config.get(k), 20)}" for k in keys[:most])
    if len(keys) > most:
        values += f", +{len(keys) - most} more"
    return f"{run.path.name}: {values}" if values else run.path.name


def comparison(runs: list[RunRecord], root: Path | None = None) -> tuple[list[str], list[list[str]]]:
    """(headers, rows): each run's differing config values, steps, tokens, final and best losses,
    tokens/s, and the GPU memory peak where a run logged one. Run names are relative to `root`
    where given."""
    keys = differing_keys(runs)
    memory = any(run.peak_memory is not None for run in runs)
    headers = ["run", *keys, "steps", "tokens", "train loss", "val loss", "best val (step)", "tokens/s",
               *(["peak memory"] if memory else [])]
    rows = []
    for run in runs:
        name = str(run.path.relative_to(root)) if root and run.path.is_relative_to(root) else str(run.path)
        best = run.best_val
        rows.append([name, *(short(run.config.get(k)) for k in keys), f"{run.steps:,}", f"{run.tokens:,}",
                     _loss(run.final_loss), _loss(run.final_val), f"{best[0]:.4f} ({best[1]:,})" if best else "-",
                     f"{run.tokens_per_s:,.0f}" if run.tokens_per_s else "-",
                     *([f"{run.peak_memory / 2**30:.1f} GiB" if run.peak_memory is not None else "-"] if memory else [])])
    return headers, rows


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def text_table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain aligned table for a log (no terminal codes)."""
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])
