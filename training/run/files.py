"""Writing into a run folder without following links and without leaving partial files, and
reading back the JSON-lines files a run appends to.

A link planted in `run.dir` (`.lock`, `checkpoints/step_X.pt.tmp`, `metrics.jsonl.tmp` pointing
at another file) must not make the trainer overwrite its target. So every file here is written
under a temporary name created exclusively (`O_EXCL | O_NOFOLLOW`: a link, or anything else
already there, is removed first, never opened) and renamed over the real name (`os.replace`
replaces a link itself, not what it points to); append-only files are opened with `O_NOFOLLOW`;
and the run's own names that are folders or appended to are refused when they are links
(`refuse_links`). A failed write (a full disk, a file-size limit) removes its temporary file
and raises `OSError` with the system's reason.

`read_json_lines` reads `metrics.jsonl` and `lineage.jsonl`: a line that is not JSON (the last
one, cut short by a kill) is passed over; a JSON line that is not the object the run writes (a
hand edit) is a ValueError naming the file and the line, so whatever reads it fails in one line.
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Callable, Iterator

from data.tokenizer import TOKENIZER_FILE

# The names a run gives its files in run.dir, each said here once (docs/training.md, "The run folder").
LOCK = ".lock"                          # held by the live run (training.run.lock)
CHECKPOINTS = "checkpoints"             # step_XXXXXXXX.pt files and .dcp folders (training.run.store)
CONFIG = "config.yaml"                  # the resolved config
METRICS = "metrics.jsonl"               # one row per logged step (training.run.metrics)
WEIGHTS = "model.safetensors"           # the final weights (training.interop.weights)
TOKENIZER = TOKENIZER_FILE              # the run's copy of its tokenizer (data.tokenizer)
LINEAGE = "lineage.jsonl"               # the run's id and one row per start (training.run.lineage)
DATA_CHANGES = "data_changes.jsonl"     # each change of corpus data.allow_changed accepted
SUPERSEDED = "superseded"               # what a rewind or a restart set aside
# What a run writes in run.dir (Hydra's folder and log included); none of them may be a link.
RUN_NAMES = (LOCK, CHECKPOINTS, CONFIG, METRICS, WEIGHTS, TOKENIZER, LINEAGE, DATA_CHANGES, SUPERSEDED,
             ".hydra", "train.log", "wandb")
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def refuse_links(run_dir: str | Path) -> None:
    """ValueError naming the first of the run's own names in `run_dir` that is a symbolic link."""
    for name in RUN_NAMES:
        path = Path(run_dir) / name
        if path.is_symlink():
            raise ValueError(f"run.dir={run_dir}: {name} is a symbolic link (to {os.readlink(path)}); a run never "
                             f"writes through links in its folder: replace it with a plain {name}")


def temp_path(path: Path) -> Path:
    """Where a file (or a DCP checkpoint folder) is written before one rename makes it `path`."""
    return path.with_name(path.name + ".tmp")


def remove_temp_files(run_dir: str | Path) -> None:
    """The temporary files of the run's own names (`model.safetensors.tmp` as big as the weights,
    `metrics.jsonl.tmp`, ...) that a process killed mid-write left: removed (links too, never followed)."""
    for name in RUN_NAMES:
        tmp = temp_path(Path(run_dir) / name)
        if tmp.is_symlink() or tmp.is_file():
            tmp.unlink()


@contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """The temporary path to write `path`'s new contents at, for writers that take a file name
    (safetensors, tarfile, a tokenizer's own save): fsynced and renamed over `path` when the block
    ends, removed on any failure (the exception goes on; an OSError that names no file names
    `path`). A leftover or a link at the temporary name is removed first, never followed."""
    path = Path(path)
    tmp = temp_path(path)
    if tmp.is_symlink() or tmp.is_file():
        tmp.unlink()
    try:
        yield tmp
        _fsync(tmp, os.O_RDONLY | os.O_NOFOLLOW)
        os.replace(tmp, path)
    except BaseException as e:
        if isinstance(e, OSError) and e.filename is None:   # a failed write names no file: name the one meant
            e.filename = str(path)
        with suppress(OSError):   # (a read-only folder refuses even that)
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextmanager
def new_file(path: str | Path, mode: str = "wb") -> Iterator[IO]:
    """`path`'s temporary file, created exclusively, then renamed over `path` on success (see
    `replacing`); removed on any failure."""
    with replacing(path) as tmp, os.fdopen(os.open(tmp, _CREATE, 0o644), mode) as f:
        yield f


def write_file(path: str | Path, write: Callable[[IO], None], mode: str = "wb") -> Path:
    """Atomically replace `path` with what `write(file)` writes (see `new_file`)."""
    with new_file(path, mode) as f:
        write(f)
    return Path(path)


def write_text(path: str | Path, text: str) -> Path:
    return write_file(path, lambda f: f.write(text), "w")


def copy_in(source: str | Path, path: str | Path) -> Path:
    """`source`'s bytes as `path`, atomically (the run's own copy of its tokenizer.json)."""
    return write_file(path, lambda f: f.write(Path(source).read_bytes()))


def open_append(path: str | Path) -> IO:
    """`path` opened for appending text, created if absent; OSError (ELOOP) if it is a link."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644), "a")


def append_line(path: str | Path, line: str) -> None:
    with open_append(path) as f:
        f.write(line.rstrip("\n") + "\n")


def fsync_dir(path: Path) -> None:
    _fsync(path, os.O_RDONLY)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RecordingWriter:
    """A file wrapper that remembers the OSError its `write` raised: `torch.save` turns a failed
    write (disk full, file-size limit) into a RuntimeError about zip positions that names no cause."""

    def __init__(self, f: IO) -> None:
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


INT, NUMBER, TEXT = (int,), (int, float), (str,)


def read_json_lines(path: str | Path, fields: dict[str, tuple[type, ...]]) -> list[dict]:
    """The objects of a JSON-lines file, each holding `fields` (name -> accepted types; None is
    accepted where NoneType is listed). ValueError naming the file and the line for one that does not."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:   # a line cut short by a kill
            continue
        problem = _row_problem(row, fields)
        if problem:
            raise ValueError(f"{path}, line {number}: {problem} (a hand edit?); fix or remove that line")
        rows.append(row)
    return rows


def _row_problem(row, fields: dict[str, tuple[type, ...]]) -> str | None:
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an object"
    for name, types in fields.items():
        if name not in row:
            return f"no {name!r}"
        value = row[name]
        if isinstance(value, bool) or not isinstance(value, types):
            return f"{name!r} is {json.dumps(value)[:40]}, not {' or '.join(_TYPE_NAMES[t] for t in types)}"
    return None


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", type(None): "null"}
