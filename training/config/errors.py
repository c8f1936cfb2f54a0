"""One-line errors: Hydra's and OmegaConf's composition errors as one line naming the key, and the
line every rank of a launch reports before exiting 2.

The line is read from the exceptions themselves (their types, their `__cause__`/`__context__`,
and the Hydra objects the traceback's frames were handling), never from Hydra's message text,
which changes when Hydra rewords it.
"""
from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager

from training.config.checks import bad_value
from training.process.exits import BAD_INPUT

VALID_KEYS_HINT = "(`python train.py --cfg job` prints every valid key)"
# Hydra's override grammar takes ~, spaces and most punctuation only inside quotes.
QUOTING_HINT = "a value holding ~, spaces or other special characters goes in quotes, e.g. 'data.paths=[\"~/corpus\"]'"


def is_main_process() -> bool:
    """Rank 0 of a torchrun launch, or a lone process: the one that reports what all ranks see."""
    return os.environ.get("RANK", "0") == "0"


RANK0_REPORT_WAIT_S = 30.0   # how long another rank leaves rank 0 to report a shared error


def report_error(line: str, every_rank: bool = False) -> int:
    """One error line on stderr; returns exit status 2. What all ranks see alike (the config, the
    run folder) rank 0 reports. Another rank of a torchrun launch first waits: torchrun stops every
    worker at the first one that exits, so exiting at once could end rank 0 before it printed (a
    launch that failed with no line, seen under load). Once rank 0 has exited with its line,
    torchrun ends this one; only if that does not come does this rank print the line itself."""
    if not (every_rank or is_main_process()):
        time.sleep(RANK0_REPORT_WAIT_S)
    print(f"error: {line.splitlines()[0] if line else line}", file=sys.stderr)
    return BAD_INPUT


def _handled_while_raising(exc: BaseException, kind: type):
    """The innermost object of type `kind` among the locals of the frames `exc` was raised
    through, or None. Hydra keeps no structured record on its composition errors, but its frames
    hold what it was composing when the error came: the preset's `ResultDefault` (a YAML file of
    the defaults list) or the command line's `Override`."""
    found, tb = None, exc.__traceback__
    while tb is not None:
        found = next((v for v in list(tb.tb_frame.f_locals.values()) if isinstance(v, kind)), found)
        tb = tb.tb_next
    return found


def config_error_line(exc: BaseException) -> str:
    """One line for a Hydra/OmegaConf composition error: the key and what it must be, an unknown
    key, or a group typo with Hydra's list of valid options."""
    from hydra.core.default_element import ResultDefault
    from hydra.core.override_parser.types import Override
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    cause = exc if isinstance(exc, (ValidationError, ConfigKeyError, ConfigAttributeError)) \
        else exc.__cause__ or exc.__context__
    preset = _handled_while_raising(exc, ResultDefault)   # a YAML preset, not the command line
    where = f" in configs/{preset.config_path}.yaml" if preset is not None and preset.config_path else ""
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        # an override's key as typed (OmegaConf's full_key stops at its first unknown part); Hydra's
        # hint to append with `+` is left out: it would make a key no code reads
        override = _handled_while_raising(exc, Override) if exc.__cause__ is cause else None
        key = override.key_or_group if override is not None else getattr(cause, "full_key", None)
        if key:
            return f"unknown config key '{key}'{where if override is None else ''} {VALID_KEYS_HINT}"
    if isinstance(cause, ValidationError) and getattr(cause, "full_key", None):
        return bad_value(cause.full_key, cause.value, cause.object_type, cause.full_key.rsplit(".", 1)[-1]) + where
    # The rest (a group typo with its options, override syntax, + and ~ misuse) carry nothing but
    # their message: it is joined into one line, Hydra's tab-indented option lists as a list.
    from hydra.errors import OverrideParseException

    text = str(exc).split("Config search path:")[0]
    if isinstance(exc, OverrideParseException):
        text = text.split("See https://")[0].rstrip(" ;\n") + "\n" + QUOTING_HINT
    line = ""
    for raw in text.splitlines():
        item = raw.strip()
        if not item:
            continue
        if raw.startswith("\t"):  # Hydra lists the options of a group one per tab-indented line
            line += (" " if line.endswith(":") else ", ") + item
        else:
            line += ("; " if line else "") + item
    return line or type(exc).__name__


def is_config_error(exc: BaseException) -> bool:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return isinstance(exc, (HydraException, OmegaConfBaseException))


@contextmanager
def exit_on_config_error():
    """Around `@hydra.main`: composition errors (unknown key, wrong type or choice, group typo,
    bad override syntax) happen before the task function runs; report them in one line and exit 2
    like any bad input.

    Hydra prints those itself (several lines, exit 1) unless HYDRA_FULL_ERROR=1 makes it raise;
    a user who set HYDRA_FULL_ERROR=1 gets Hydra's full traceback as usual.
    """
    user_wants_traceback = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    except Exception as exc:  # noqa: BLE001 (only config errors are caught; the rest re-raised)
        if user_wants_traceback or not is_config_error(exc):
            raise
        sys.exit(report_error(config_error_line(exc)))  # every rank of a torchrun launch composes the same config

