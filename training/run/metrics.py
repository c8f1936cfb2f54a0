"""`metrics.jsonl`: one JSON row per logged step, appended and flushed as the run goes.

Every row has `step`, `loss` and `tokens` (and lr, tokens_per_s, grad_norm; mfu on CUDA, val_loss
on eval steps). On resume the rows after the checkpoint's step are dropped first, so the file of
a resumed run reads like that of a run never interrupted (a rewind keeps them in its
`superseded/` folder). Read back by the resume planner, the run records and the tools.
"""
from __future__ import annotations

import json
from pathlib import Path

from training.run.files import INT, NUMBER, open_append, read_json_lines, write_text

METRIC_FIELDS = {"step": INT, "loss": NUMBER, "tokens": INT}   # what every row has (and readers use)


class MetricsFile:
    """Append-only JSON lines, flushed per row so a killed run keeps what it logged."""

    def __init__(self, path: str | Path, resume_step: int | None) -> None:
        self.path = Path(path)
        rows = self.read(self.path) if resume_step is not None and self.path.exists() else []
        self.write(self.path, [r for r in rows if r["step"] <= resume_step] if resume_step is not None else [])
        self._file = open_append(self.path)

    @staticmethod
    def read(path: str | Path) -> list[dict]:
        """Rows of a metrics file; a last line cut short by a kill is ignored, a row that is not
        one of ours is a ValueError naming the file and the line."""
        return read_json_lines(path, METRIC_FIELDS)

    @staticmethod
    def write(path: str | Path, rows: list[dict]) -> None:
        """Replace a metrics file with `rows`, atomically."""
        write_text(path, "".join(json.dumps(r) + "\n" for r in rows))

    def log(self, row: dict) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
