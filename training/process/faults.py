"""Failures of the machine rather than the code: memory, disk, the process group, determinism.

`fault_line(exc)` is the one line train.py prints for them (exit status 2), naming what ran out
and the setting to turn; None for anything else, which stays a traceback (a bug to report).
"""
from __future__ import annotations

import errno
import os
import re

MEMORY_KNOBS = ("lower trainer.batch_size (raise trainer.grad_accum to keep the global batch) or trainer.seq_len, "
                "or set model.activation_checkpointing=full")
_CPU_OOM = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")
_NOT_DETERMINISTIC = "does not have a deterministic implementation"


SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)   # no room: a full disk, a quota, a file-size limit


def os_error_in(exc: BaseException) -> OSError | None:
    """The OSError behind `exc`: itself, a cause, or an `os error N` named in a library's message
    (safetensors reports `I/O error: File too large (os error 27)`)."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    found = re.search(r"os error (\d+)", str(exc))
    if found:
        code = int(found.group(1))
        return OSError(code, os.strerror(code))
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def fault_line(exc: BaseException) -> str | None:
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        what = _first_line(exc).removeprefix("CUDA out of memory").strip(" .").split(". ")[0] or "no detail"
        return f"CUDA out of memory ({what}): {MEMORY_KNOBS}"
    if isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and any(m in str(exc) for m in _CPU_OOM)):
        return f"out of host (CPU) memory ({_first_line(exc)[:160]}): {MEMORY_KNOBS}"
    if isinstance(exc, RuntimeError) and _NOT_DETERMINISTIC in str(exc):
        return (f"trainer.deterministic=true, but {_first_line(exc).split(_NOT_DETERMINISTIC)[0].strip()} has no "
                f"deterministic implementation on this device: use trainer.deterministic=false (or another attention)")
    dist_error = getattr(torch.distributed, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return (f"the process group failed ({type(exc).__name__}: {_first_line(exc)[:200]}): a rank died, or the "
                f"launcher's rendezvous is unreachable")
    error = os_error_in(exc) if isinstance(exc, OSError) else None
    if error is not None:
        return os_error_line(error)
    return None


def os_error_line(error: OSError) -> str:
    """`strerror: file` and, for a full disk or a read-only folder, what to do about it."""
    where = f": {error.filename}" if error.filename else ""
    line = f"{error.strerror or _first_line(error)}{where}"
    if error.errno in SPACE_ERRNOS:
        line += " (free some space, or raise the file-size limit, and rerun)"
    elif error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        line += " (the folder is not writable)"
    return line
