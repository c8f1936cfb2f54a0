"""Ctrl-C and SIGTERM as requests to stop at the next step boundary, after a checkpoint.

The handler only sets a flag: stopping mid-step would save a half-applied update. The process
then exits with the shell's convention for the signal, 128 + its number (training/process/exits.py).

Alone (`python train.py`), a second Ctrl-C stops at once (KeyboardInterrupt, which train.py
turns into one line and status 130) for a user who does not want to wait. Under torchrun the
worker is not the one the user talks to: a terminal's Ctrl-C reaches it twice (from the
terminal and again from the launcher), so repeats are the same request, and the launcher
decides when to stop waiting. A worker whose launcher died (killed with SIGKILL: nothing
forwarded) notices at the next step boundary (its parent process changed) and stops there after
saving, as for SIGHUP (status 129), instead of training on as an orphan.
"""
from __future__ import annotations

import atexit
import os
import signal
import sys

from training.process.exits import FINISHED, INTERRUPTED, stopped_by


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


# The launcher's pid, taken when training starts importing (before any step, so a launcher
# that dies early is noticed too).
LAUNCHER_PID = os.getppid() if launched_by_torchrun() else None


class StopRequest:
    """Context manager installing the handlers; `signum` is the signal received, or None."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self._signum: int | None = None
        self._previous: dict = {}
        self._launcher = LAUNCHER_PID

    def _handle(self, signum, frame) -> None:
        if self._launcher is None and self._signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self._signum is None:
            self._signum = signum

    @property
    def signum(self) -> int | None:
        if self._signum is None and self._launcher is not None and os.getppid() != self._launcher:
            self._signum = signal.SIGHUP  # the launcher is gone
        return self._signum

    @property
    def exit_code(self) -> int:
        return stopped_by(self.signum) if self.signum is not None else FINISHED

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def __enter__(self) -> "StopRequest":
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def reclaim(self) -> None:
        """Install the handlers again, at each step boundary. Native code may have replaced them:
        LLVM puts its own on SIGINT and SIGTERM the first time Triton compiles a kernel in the
        process, and Python's record of the handler does not see it. On an H100 a SIGTERM after
        that ended the process without its checkpoint (benchmarks/resume/sigterm_h100/). LLVM
        installs them once a process, so from the boundary after the first compile on the signal
        is ours again; a signal during that first step is still LLVM's. Two system calls a step."""
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def stop_reason(signum: int) -> str:
    """What made the run stop, for its last message."""
    if signum == signal.SIGHUP and launched_by_torchrun():
        return "the launcher (torchrun) is gone"
    return f"{signal.Signals(signum).name} received"


def exit_at_once_on_ctrl_c() -> None:
    """Once a run has ended and said how: a further Ctrl-C (during the interpreter's shutdown,
    in torch's or wandb's atexit handlers) ends the process at once with status 130, what any
    interrupted run exits with. Not a traceback from inside those handlers, and not death by the
    signal either, which would report the run's status as -2 instead of 130."""
    def exit_130(signum, frame) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, RuntimeError):   # closed, or interrupted mid-write
                pass
        os._exit(INTERRUPTED)
    signal.signal(signal.SIGINT, exit_130)


def ignore_ctrl_c_as_python_exits() -> None:
    """Register the process's last exit handler: from there on Ctrl-C is ignored, and the process
    ends with the status it was exiting with. As Python finalizes, after the exit handlers, it
    resets every signal that has a Python handler (`exit_at_once_on_ctrl_c`'s too) to its default
    action, and a Ctrl-C in those last milliseconds would kill the process by the signal (status
    -2) whatever it had to report; an ignored signal it leaves ignored. Call this before torch or
    wandb is imported: exit handlers run last-registered first, so theirs still run under
    `exit_at_once_on_ctrl_c`."""
    atexit.register(signal.signal, signal.SIGINT, signal.SIG_IGN)
