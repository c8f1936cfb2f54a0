"""The exit statuses of `train.py` (and of `python -m training.launch`, which exits as it does):
the one place that says what each means. `python train.py --help` prints this table (the help
text in configs/train.yaml reads it through the `exit_statuses` resolver that train.py
registers), and the README's table is this one (tests/test_exit_status.py compares them); the
details of what status 2 covers are in docs/training.md, "Stopping and exit statuses".

Imports nothing: train.py reads it before Hydra and torch.
"""
from __future__ import annotations

import signal
import textwrap

FINISHED = 0
DIVERGED = 1      # the loss or gradient became NaN/inf
BAD_INPUT = 2     # bad input or environment, or the machine's fault: one line on stderr
LAUNCHER_GONE = 128 + signal.SIGHUP      # 129
INTERRUPTED = 128 + signal.SIGINT        # 130
TERMINATED = 128 + signal.SIGTERM        # 143

# (statuses, what they mean), as the README's table has them.
EXIT_STATUSES: list[tuple[tuple[int, ...], str]] = [
    ((FINISHED,), "finished (or nothing left to do)"),
    ((DIVERGED,), "the loss or gradient became NaN/inf: stopped without writing a checkpoint after it; the message "
                  "names the last good checkpoint"),
    ((BAD_INPUT,), "bad input or environment, in one line on stderr, before any step (a bad config key or value, a "
                   "missing path, a corrupt or mismatched checkpoint, a folder of another run); during training a "
                   "full disk, out of memory, or an op without a deterministic kernel under "
                   "`trainer.deterministic=true`"),
    ((LAUNCHER_GONE,), "under torchrun: the launcher died; the workers stopped at the next step boundary after saving "
                       "a checkpoint"),
    ((INTERRUPTED, TERMINATED), "Ctrl-C, SIGTERM: stopped at a step boundary after saving a checkpoint; rerun with "
                                "`resume=auto` (130 also after a second Ctrl-C, without saving)"),
]


def stopped_by(signum: int) -> int:
    """The status of a run a signal stopped: the shell's convention, 128 + its number."""
    return 128 + signum


def markdown_table() -> str:
    """The README's table."""
    rows = [f"| {', '.join(map(str, codes))} | {meaning} |" for codes, meaning in EXIT_STATUSES]
    return "\n".join(["| status | meaning |", "| --- | --- |", *rows])


def help_text(width: int = 100) -> str:
    """The table for `--help`: plain text, each status's meaning wrapped beside it."""
    return "\n".join(textwrap.fill(meaning.replace("`", ""), width, initial_indent=f"  {'/'.join(map(str, codes)):<9}",
                                   subsequent_indent=" " * 11) for codes, meaning in EXIT_STATUSES)
