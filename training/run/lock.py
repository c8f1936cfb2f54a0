"""One live run per `run.dir`: an exclusive `flock` on `<run.dir>/.lock`.

Two runs sharing a folder would adopt each other's checkpoints, interleave `metrics.jsonl` and
delete each other's temp files. The kernel drops the lock when its holder exits in any way
(kill -9 included), so no stale lock is ever left to clean up; the file keeps the holder's pid
only so the refusal can name it.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from training.run.files import LOCK, refuse_links

def ensure_writable(folder: str | Path, what: str) -> Path:
    """Create `folder` if needed and prove a file can be written in it; one-line ValueError if not."""
    folder = Path(folder).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{what}={folder} is not a folder")
    probe = folder / f".write-test-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{what}={folder} is not writable ({e.strerror or e})") from None
    return folder


class RunDirLock:
    """Held from before the first checkpoint is looked at until the run ends."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = ensure_writable(run_dir, "run.dir")
        refuse_links(self.run_dir)  # the lock file included: never opened through a link
        self.path = self.run_dir / LOCK
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            raise ValueError(f"run.dir={self.run_dir} is in use by another run (pid {holder}): wait for it to "
                             f"finish or choose another run.dir") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> "RunDirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
