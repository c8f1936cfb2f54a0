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
    per value its jobs take (sweep_variants), each with the override that makes it (None: the
    first). Composed once for both checks train.py makes before Hydra starts."""
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


def sweep_variants(overrides: list[str]) -> list[tuple[list[str], str | None]]:
    """The overrides with every sweep (`key=a,b,c`) at its first value, then each other value of
    each sweep with the rest at their first: every value a multirun's jobs take, in as many configs
    as there are values (not their product). Each with the override that makes it (None: the first)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    base = [o.input_line if not o.is_sweep_override() else f"{o.get_key_element()}={next(o.sweep_string_iterator())}"
            for o in parsed]
    return [(base, None)] + [(base[:i] + [swept] + base[i + 1:], swept)
                             for i, o in enumerate(parsed) if o.is_sweep_override() and o.is_discrete_sweep()
                             for swept in (f"{o.get_key_element()}={value}" for value in list(o.sweep_string_iterator())[1:])]


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
