"""torchrun with train.py's exit statuses: `python -m training.launch [torchrun options] train.py ...`.

Plain `torchrun` trains the same way, but reports its own way: a SIGTERM or Ctrl-C to it exits 1
with a SignalException traceback (after the workers stopped and saved), and a worker's one-line
error comes wrapped in its multi-line failure report. This runs torchrun's own launcher
(`torch.distributed.run`) and maps how it ended to the statuses of a single `python train.py`:
143 / 130 when SIGTERM / SIGINT stopped it (the workers saved a checkpoint at one step
boundary), the failed worker's own status (2 for bad input, whose line rank 0 printed) instead
of the report, and torchrun's own log lines are left out (set LOGLEVEL=INFO or WARNING, torchrun's
knob, to see them). A second Ctrl-C ends the launcher at once (status 130); its workers, already
stopping, save and exit (they also stop, after saving, if the launcher is killed outright).
"""
from __future__ import annotations

import logging
import os
import signal
import sys

from training.process.exits import INTERRUPTED, stopped_by


def _quiet_torchrun() -> None:
    """torchrun logs a line per worker that failed or was signalled: the workers say it better."""
    if "LOGLEVEL" in os.environ:
        return
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith("torch.distributed") and isinstance(logger, logging.Logger):
            logger.setLevel(logging.CRITICAL)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    _quiet_torchrun()
    try:
        run(args)
    except SignalException as e:
        print(f"torchrun stopped by {signal.Signals(e.sigval).name}: the workers stop at a step boundary after "
              f"saving; rerun with resume=auto", file=sys.stderr)
        return stopped_by(int(e.sigval))
    except ChildFailedError as e:
        _, failure = e.get_first_failure()
        return failure.exitcode if failure.exitcode > 0 else stopped_by(-failure.exitcode)  # -N: killed by signal N
    except KeyboardInterrupt:  # a Ctrl-C before torchrun's own handlers were installed
        return INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
