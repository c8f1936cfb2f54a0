"""Counting documents a source could not read cleanly, instead of training on them silently.

Text files with bytes that are not UTF-8 (decoded with U+FFFD replacements) and records without
the text field (skipped) are counted while the token cache is built; a warning names how many and
the first few, and past `data.max_bad_fraction` of all documents the build fails, so a corpus
that is mostly unreadable never turns into a run.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)
SHOWN = 3  # names quoted in the message


class BadDocuments:
    def __init__(self, what: str, max_fraction: float = 0.01):
        self.what, self.max_fraction = what, float(max_fraction)
        self.total, self.bad = 0, []

    def add(self, is_bad: bool, name: str) -> None:
        self.total += 1
        if is_bad:
            self.bad.append(name)

    def check(self) -> None:
        """After the last document: warn about any bad ones, fail past the threshold."""
        if not self.bad:
            return
        shown = ", ".join(self.bad[:SHOWN]) + (", ..." if len(self.bad) > SHOWN else "")
        message = f"{len(self.bad)} of {self.total} documents are {self.what} ({shown})"
        if len(self.bad) > self.max_fraction * self.total:
            raise ValueError(f"{message}: more than data.max_bad_fraction={self.max_fraction:g}; fix the corpus "
                             f"or raise data.max_bad_fraction")
        log.warning("%s; kept going (data.max_bad_fraction=%g)", message, self.max_fraction)
