"""Ctrl-C and SIGTERM as requests to stop at the next step boundary, after a checkpoint.

The handler only sets a flag: stopping mid-step would save a half-applied update. A second
Ctrl-C stops at once (KeyboardInterrupt) for a user who does not want to wait. The process then
exits with the shell's convention for the signal: 130 for SIGINT, 143 for SIGTERM.
"""
from __future__ import annotations

import signal


class StopRequest:
    """Context manager installing the handlers; `signum` is the signal received, or None."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return 128 + self.signum if self.signum is not None else 0

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def __enter__(self) -> "StopRequest":
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
