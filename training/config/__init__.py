"""The config: what `python train.py <overrides>` composes, and whether it may run.

Owns the schema (schema.py: one typed class per group, registered with Hydra), its checks beyond
types (checks.py: ranges, checks across keys and groups), the one-line wording of Hydra's errors
(errors.py) and, here, composition itself: `compose` gives train.py's config to scripts and
tests, and the helpers on a command line's overrides. Imports nothing else of training but the
exit-status table (the schema reads the kernel words from kernels/choices.py and the model's keys
from model/config.py);
everything above builds from what it composes. Imports nothing heavy: `train.py --help` loads it.

Types, unknown keys and choices are checked by Hydra against the schema as the config is
composed; errors.py turns its errors into one line naming the key.
"""
from __future__ import annotations

import itertools
import math
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from training.config import schema

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def compose(overrides: list[str] | None = None, config_name: str = "train") -> DictConfig:
    """The same config `python train.py <overrides>` would see, through Hydra's compose API.

    `run.dir` interpolates Hydra's runtime output dir, which only exists under `@hydra.main`:
    pass `run.dir=...` when the config is used to run something.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()  # tests and scripts may compose repeatedly
    if config_name != "train":  # a script's config: its schema extends train's (max_context < profile_step)
        for root in schema.ROOTS:
            schema.register(root)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return plain(hydra_compose(config_name=config_name, overrides=list(overrides or [])))


def plain(cfg: DictConfig) -> DictConfig:
    """The composed (typed) config as plain values: choices become their strings, so the config
    saved in run.dir and in checkpoints holds nothing but YAML's types. Interpolations are kept."""
    values = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False, enum_to_str=True))
    OmegaConf.set_struct(values, True)
    return values


def composed_variants(overrides: list[str]) -> list[tuple[str | None, DictConfig]]:
    """The config `python train.py <overrides>` composes, with its `hydra` node; for a multirun, one
    per job (or per value, in a large sweep: sweep_variants), each with the swept values that make
    it (None: the first). Composed once for both checks train.py makes before Hydra starts."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            return [(swept, hydra_compose(config_name="train", return_hydra_config=True,
                                          overrides=variant + ([] if any(override_key(o) == "run.dir" for o in variant)
                                                               else ["run.dir=unused"])))   # run.dir needs no runtime
                    for variant, swept in sweep_variants(overrides)]
    finally:
        GlobalHydra.instance().clear()


def hydra_callbacks(configs: list[tuple[str | None, DictConfig]]) -> list[str]:
    """The names under `hydra.callbacks` in composed configs (composed_variants). Hydra instantiates
    those `_target_`s before the task runs: code from a config file, which train.py refuses unless
    explicitly allowed."""
    names: list[str] = []
    for _, cfg in configs:
        names += [name for name in (cfg.hydra.callbacks or {}) if name not in names]
    return names


# A multirun of at most this many jobs has each job's config composed and checked before the first
# runs (~0.1 s each); a larger one has each value checked once, with the other sweeps at their first.
CHECKED_JOBS = 32


def sweep_variants(overrides: list[str]) -> list[tuple[list[str], str | None]]:
    """The overrides of every job a multirun makes (the product of its sweeps, `key=a,b,c`), each
    with the swept values that make it (None: every sweep at its first value), so that a bad
    combination is refused with the bad values. Past CHECKED_JOBS jobs: every sweep at its first
    value, then each other value of each sweep with the rest at their first, as many configs as
    there are values."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices = [_values(o) for o in OverridesParser.create().parse_overrides(overrides)]
    base = [options[0] for options in choices]
    if math.prod(len(options) for options in choices) <= CHECKED_JOBS:
        jobs = [list(job) for job in itertools.product(*choices)]
        return [(job, " ".join(o for o, first in zip(job, base) if o != first) or None) for job in jobs]
    return [(base, None)] + [(base[:i] + [swept] + base[i + 1:], swept)
                             for i, options in enumerate(choices) for swept in options[1:]]


def _values(override) -> list[str]:
    """The `key=value` overrides a parsed override stands for: each value of a sweep (`key=a,b,c`),
    the first of a range or interval sweep, the override itself where it sweeps nothing."""
    if not override.is_sweep_override():
        return [override.input_line]
    values = (f"{override.get_key_element()}={value}" for value in override.sweep_string_iterator())
    return list(values) if override.is_discrete_sweep() else [next(values)]


def check_sweep(configs: list[tuple[str | None, DictConfig]]) -> str | None:
    """The first bad value among a multirun's jobs (composed_variants), as its one error line, or
    None: so that a sweep is refused before its first job trains, not when the bad job starts."""
    from training.config.checks import validate_config

    for swept, cfg in configs:
        job = plain(cfg)
        with open_dict(job):
            del job["hydra"]
        try:
            validate_config(job)
        except ValueError as e:
            return f"{e} (the sweep's {'job with ' + swept if swept else 'first job'}; no job has run)"
    return None


def override_key(override: str) -> str | None:
    """The key an override sets (`key=`, `+key=` and `++key=` name the same); None for a flag."""
    if override.startswith("-") or "=" not in override:
        return None
    return override.split("=", 1)[0].lstrip("+~")


def repeated_override(overrides: list[str]) -> str | None:
    """The error line for a key given twice on a command line (Hydra would take the last one and say
    nothing), or None."""
    seen: dict[str, str] = {}
    for override in overrides:
        key = override_key(override)
        if key is None:
            continue
        value = override.split("=", 1)[1]
        if key in seen:
            return f"{key} is given twice ({seen[key]}, then {value}): pass it once"
        seen[key] = value
    return None


def merge_overrides(*layers: list[str]) -> list[str]:
    """One command line from layers of overrides, a later layer's key replacing an earlier one's
    (a tool's defaults, then the user's): each key once, as train.py requires."""
    merged: dict[str | None, str] = {}
    flags: list[str] = []
    for override in (o for layer in layers for o in layer):
        key = override_key(override)
        if key is None:
            flags.append(override)
        else:
            merged.pop(key, None)   # the later one, in its own place
            merged[key] = override
    return [*merged.values(), *flags]
