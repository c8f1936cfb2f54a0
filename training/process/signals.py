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
import logging
import os
import signal
import sys

from training.process.exits import FINISHED, INTERRUPTED, stopped_by

log = logging.getLogger(__name__)


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
        let_llvm_register_first()
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def reclaim(self) -> None:
        """Install the handlers again, at each step boundary: other native code may replace them
        behind Python's back, as LLVM does (`let_llvm_register_first`). Two system calls a step."""
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def let_llvm_register_first() -> None:
    """Have LLVM put its signal handlers in now, so that ours, installed after, stay on top.

    LLVM (inside Triton's compiler) installs its own SIGINT and SIGTERM handlers the first time a
    process runs a compiler pass pipeline, which is the first time it compiles a Triton kernel:
    during a run's first step, behind Python's back. Its handler resets to the default action as it
    runs (SA_RESETHAND), so a second SIGTERM right behind the first (`timeout` signals the process,
    then its group) can meet the default action and end the process at once, the likeliest reading
    of a run an H100 lost without its checkpoint (benchmarks/resume/sigterm_h100/). LLVM registers
    once a process, so one empty pipeline here (~2 ms) spends that registration before ours go in:
    a compile later leaves them in place. Without triton nothing registers; should its compiler's
    API change, a warning says so, and `reclaim` at each step boundary still takes the signals back
    after the step that compiled."""
    try:
        from triton._C.libtriton import ir
    except ImportError:   # no Triton compiler here: nothing will put LLVM's handlers in
        return
    try:
        context = ir.context()
        ir.load_dialects(context)
        pipeline, module = ir.pass_manager(context), ir.builder(context).create_module()
        try:
            pipeline.run(module, "flashtrain-signals")   # triton 3.9 names the pipeline run; older releases do not
        except TypeError:
            pipeline.run(module)
    except Exception as exc:  # noqa: BLE001 (best effort: reclaim() covers every step after the first)
        log.warning("could not run an empty Triton pipeline before installing the stop handlers (%s): a SIGTERM "
                    "during the step that first compiles a kernel may end the run without its checkpoint", exc)


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
