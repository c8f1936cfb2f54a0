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

import errno
import json
import os
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Callable, Iterator

# What a run writes in run.dir (Hydra's folder and log included); none of them may be a link.
RUN_NAMES = (".lock", "checkpoints", "config.yaml", "metrics.jsonl", "model.safetensors", "tokenizer.json",
             "lineage.jsonl", "data_changes.jsonl", "superseded", ".hydra", "train.log", "wandb")
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def refuse_links(run_dir: str | Path) -> None:
    """ValueError naming the first of the run's own names in `run_dir` that is a symbolic link."""
    for name in RUN_NAMES:
        path = Path(run_dir) / name
        if path.is_symlink():
            raise ValueError(f"run.dir={run_dir}: {name} is a symbolic link (to {os.readlink(path)}); a run never "
                             f"writes through links in its folder: replace it with a plain {name}")


def temp_path(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def remove_temp_files(run_dir: str | Path) -> None:
    """The temporary files of the run's own names (`model.safetensors.tmp` as big as the weights,
    `metrics.jsonl.tmp`, ...) that a process killed mid-write left: removed (links too, never followed)."""
    for name in RUN_NAMES:
        tmp = temp_path(Path(run_dir) / name)
        if tmp.is_symlink() or tmp.is_file():
            tmp.unlink()


@contextmanager
def new_file(path: str | Path, mode: str = "wb") -> Iterator[IO]:
    """`path`'s temporary file, created exclusively, fsynced and renamed over `path` on success;
    removed on any failure (the exception goes on)."""
    path = Path(path)
    tmp = temp_path(path)
    if tmp.is_symlink() or tmp.is_file():
        tmp.unlink()  # a leftover or a planted link: removed, never followed
    try:
        with os.fdopen(os.open(tmp, _CREATE, 0o644), mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if isinstance(e, OSError) and e.filename is None:   # a failed write names no file: name the one meant
            e.filename = str(path)
        with suppress(OSError):   # (a read-only folder refuses even that)
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_file(path: str | Path, write: Callable[[IO], None], mode: str = "wb") -> Path:
    """Atomically replace `path` with what `write(file)` writes (see `new_file`)."""
    with new_file(path, mode) as f:
        write(f)
    return Path(path)


def write_text(path: str | Path, text: str) -> Path:
    return write_file(path, lambda f: f.write(text), "w")


def open_append(path: str | Path) -> IO:
    """`path` opened for appending text, created if absent; OSError (ELOOP) if it is a link."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644), "a")


def append_line(path: str | Path, line: str) -> None:
    with open_append(path) as f:
        f.write(line.rstrip("\n") + "\n")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
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


def os_error_in(exc: BaseException) -> OSError | None:
    """The OSError behind `exc`: itself, a cause, or an `os error N` named in a library's message
    (safetensors reports `I/O error: File too large (os error 27)`)."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    import re

    found = re.search(r"os error (\d+)", str(exc))
    if found:
        code = int(found.group(1))
        return OSError(code, os.strerror(code))
    return None


SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


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
