"""Config composition (train.py, scripts, tests) and the config's checks, in one place.

Types, unknown keys and choices are checked by Hydra against the schema (training/schema.py) as
the config is composed; `config_error_line` turns its errors into one line naming the key. What a
type cannot say (ranges, declared in the schema's field metadata, and the checks across keys and
groups) is `check_group` / `validate_config` here, which every consumer calls: the Trainer once the
config is final, training.builders' `build_model` and `build_data` for the groups they are given.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import time
import typing
from contextlib import contextmanager
from enum import Enum
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from training import schema

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
PARALLEL = tuple(p.value for p in schema.Parallel)   # training.distributed implements them


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


def hydra_callbacks(overrides: list[str]) -> list[str]:
    """The names under `hydra.callbacks` in the config `python train.py <overrides>` composes (for
    a multirun, in each swept value's config). Hydra instantiates those `_target_`s before the
    task runs: code from a config file, which train.py refuses unless explicitly allowed."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    base = [o.input_line if not o.is_sweep_override() else f"{o.get_key_element()}={next(o.sweep_string_iterator())}"
            for o in parsed]
    variants = [base] + [base[:i] + [f"{o.get_key_element()}={value}"] + base[i + 1:]
                         for i, o in enumerate(parsed) if o.is_sweep_override() and o.is_discrete_sweep()
                         for value in list(o.sweep_string_iterator())[1:]]
    names: list[str] = []
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            for variant in variants:
                callbacks = hydra_compose(config_name="train", overrides=variant, return_hydra_config=True).hydra.callbacks
                names += [name for name in (callbacks or {}) if name not in names]
    finally:
        GlobalHydra.instance().clear()
    return names


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
    return 2


# ----------------------------------------------------------------------------- one-line errors

def _field(cls: type, name: str):
    """(type, metadata) of field `name` of schema class `cls`, or None."""
    if not dataclasses.is_dataclass(cls):
        return None
    for f in dataclasses.fields(cls):
        if f.name == name:
            return typing.get_type_hints(cls)[name], f.metadata
    return None


def expectation(annotation, metadata) -> str:
    """What a value of this schema field must be, as the error line says it."""
    if "expect" in metadata:
        return metadata["expect"]
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Union and type(None) in args:
        inner = expectation(next(a for a in args if a is not type(None)), metadata)
        return inner.replace("must be ", "must be null or ", 1).replace("expected one of ", "expected null or one of ", 1)
    bounds = metadata.get("range", {})
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return f"expected one of {', '.join(m.value for m in annotation)}"
    if annotation is bool:
        return "must be true or false"
    if annotation is int:
        if "ge" in bounds and "le" in bounds:
            return f"must be an integer in [{bounds['ge']}, {bounds['le']}]"
        if bounds.get("ge") == 1:
            return "must be a positive integer"
        return f"must be an integer >= {bounds['ge']}" if "ge" in bounds else "must be an integer"
    if annotation is float:
        lo = ("[", bounds["ge"]) if "ge" in bounds else ("(", bounds["gt"]) if "gt" in bounds else None
        hi = ("]", bounds["le"]) if "le" in bounds else (")", bounds["lt"]) if "lt" in bounds else None
        if lo and hi:
            return f"must be a number in {lo[0]}{lo[1]:g}, {hi[1]:g}{hi[0]}"
        if lo:
            return f"must be a number {'>=' if lo[0] == '[' else '>'} {lo[1]:g}"
        return "must be a number"
    if typing.get_origin(annotation) in (list, typing.List):
        return f"must be a list of {'numbers' if typing.get_args(annotation) == (float,) else 'strings'}"
    if typing.get_origin(annotation) in (dict, typing.Dict):
        return "must be a mapping"
    return "must be a string"


def _bad_value(key: str, value, cls: type | None, name: str) -> str:
    found = _field(cls, name) if cls is not None else None
    reason = expectation(*found) if found else "has the wrong type"
    return f"{key}={value!r}: {reason}"


def config_error_line(exc: BaseException) -> str:
    """One line for a Hydra/OmegaConf composition error: the key and what it must be, an unknown
    key, or a group typo with Hydra's list of valid options."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    cause = exc if isinstance(exc, (ValidationError, ConfigKeyError, ConfigAttributeError)) \
        else exc.__cause__ or exc.__context__
    preset = re.match(r"In '([^']+)': \w+ raised while composing config", str(exc))
    where = f" in configs/{preset.group(1)}.yaml" if preset else ""   # a YAML preset, not the command line
    unknown = re.match(r"Could not override '([^']+)'\.\s+To append to your config use", str(exc))
    if unknown:  # Hydra's hint to append with `+` would make a key no code reads
        return f"unknown config key '{unknown.group(1)}' (`python train.py --cfg job` prints every valid key)"
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and getattr(cause, "full_key", None):
        return f"unknown config key '{cause.full_key}'{where} (`python train.py --cfg job` prints every valid key)"
    if isinstance(cause, ValidationError) and getattr(cause, "full_key", None):
        return _bad_value(cause.full_key, cause.value, cause.object_type, cause.full_key.rsplit(".", 1)[-1]) + where
    text = str(exc).split("Config search path:")[0]
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


# ----------------------------------------------------------------------------- checks

def _require(ok: bool, key: str, value, reason: str) -> None:
    if not ok:
        raise ValueError(f"{key}={value!r}: {reason}")


def _in_range(value, bounds: dict) -> bool:
    return (value >= bounds.get("ge", value) and value <= bounds.get("le", value)
            and ("gt" not in bounds or value > bounds["gt"]) and ("lt" not in bounds or value < bounds["lt"]))


def check_fields(cls: type, node, prefix: str = "") -> DictConfig:
    """`node` (a DictConfig or dict) against schema class `cls`: unknown keys and types (as
    composition checks them), then each field's declared range. Returns the typed node."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        typed = OmegaConf.merge(OmegaConf.structured(cls), node)
    except OmegaConfBaseException as exc:
        from omegaconf.errors import ValidationError

        key = f"{prefix}{getattr(exc, 'full_key', '') or ''}"
        if isinstance(exc, ValidationError):
            raise ValueError(_bad_value(key, exc.value, exc.object_type or cls, key.rsplit(".", 1)[-1])) from None
        raise ValueError(f"unknown config key '{key}'") from None
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        bounds = f.metadata.get("range")
        if bounds is None or f.name not in node:
            continue
        value, expected = typed[f.name], expectation(hints[f.name], f.metadata)
        _require(value is None or not isinstance(value, float) or math.isfinite(value), f"{prefix}{f.name}", value,
                 expected.replace("a number", "a finite number"))
        _require(value is None or _in_range(value, bounds), f"{prefix}{f.name}", value, expected)
    return typed


def check_group(group: str, node) -> dict:
    """Check one group's node (types, ranges, the checks across its keys); returns its values
    as a plain dict, schema defaults filled in."""
    options = schema.OPTIONS.get(group)
    if options and node.get("name") not in options:  # the option's YAML file names it; a bare override may not
        raise ValueError(f"{group}.name={node.get('name')!r}: expected one of {', '.join(options)}")
    typed = check_fields(schema.schema_of(group, node), node, f"{group}.")
    if group == "model":
        _check_model(typed)
    elif group == "optim":
        _require(typed.min_lr <= typed.lr, "optim.min_lr", typed.min_lr, f"must lie in [0, optim.lr={typed.lr}]")
        betas = list(typed.betas)
        _require(len(betas) == 2 and all(0 <= b < 1 for b in betas), "optim.betas", betas,
                 schema.BETAS)
        _require(typed.fused in ("auto", True, False), "optim.fused", typed.fused, "expected auto, true or false")
    return OmegaConf.to_container(typed, resolve=False, enum_to_str=True)


def _check_model(m) -> None:
    if m.d_model % m.n_head:
        raise ValueError(f"model.d_model={m.d_model} is not divisible by model.n_head={m.n_head}")
    if m.n_head % m.n_kv_head:
        raise ValueError(f"model.n_head={m.n_head} is not divisible by model.n_kv_head={m.n_kv_head}")
    if m.pos_emb == "rope" and (m.d_model // m.n_head) % 2:
        raise ValueError(f"RoPE needs an even head dim, got d_model/n_head={m.d_model // m.n_head}")
    if m.block_chunk_size and m.activation_checkpointing == "none":
        raise ValueError(f"model.block_chunk_size={m.block_chunk_size} needs model.activation_checkpointing="
                         "full or selective (without checkpointing every chunk's activations are kept anyway)")
    if m.block_chunk_size and m.dropout:
        raise ValueError(f"model.block_chunk_size={m.block_chunk_size} with model.dropout={m.dropout}: "
                         "chunks would draw other dropout masks than the whole sequence; use dropout=0")
    if m.offload_activations and m.activation_checkpointing != "full":
        raise ValueError("model.offload_activations=true needs model.activation_checkpointing=full (it moves "
                         f"the block inputs that full checkpointing keeps), got '{m.activation_checkpointing}'")


def _check_masks(cfg: DictConfig) -> None:
    """What `model.reset_positions`, `data.document_mask` and `attention.window` combine with, and
    what the context-parallel ring does not take (it takes the document mask and the window)."""
    _require(not cfg.model.reset_positions or cfg.data.document_mask, "model.reset_positions", True,
             "needs data.document_mask=true (positions restart at the document starts the mask uses)")
    cp = cfg.trainer.context_parallel
    _require(cp == 1 or not cfg.model.get("attention_dropout"), "trainer.context_parallel", cp,
             "the ring computes attention without dropout: use model.attention_dropout=0 or trainer.context_parallel=1")
    _require(cp == 1 or cfg.attention.deterministic, "trainer.context_parallel", cp,
             "the ring runs our kernel's deterministic backward only: use attention.deterministic=true "
             "or trainer.context_parallel=1")
    _require(cp == 1 or cfg.attention.get("kernel", "auto") == "auto", "trainer.context_parallel", cp,
             f"the ring's blocks pick their forward kernel per call (auto); attention.kernel="
             f"{cfg.attention.get('kernel')} would be ignored: use attention.kernel=auto or trainer.context_parallel=1")
    _require(not cfg.trainer.deterministic or cfg.attention.deterministic, "trainer.deterministic", True,
             "needs attention.deterministic=true (the atomic backward adds dQ in a different order each run)")


def _check_run_folders(cfg: DictConfig) -> None:
    """An empty folder name would make the run write into the current folder."""
    import os

    if "run" in cfg and not OmegaConf.is_interpolation(cfg.run, "dir"):
        _require(str(cfg.run.get("dir")).strip() != "", "run.dir", cfg.run.get("dir"), "expected a folder for the run")
    if OmegaConf.is_interpolation(cfg.data, "cache_dir"):
        return
    empty_env = " (FLASHTRAIN_CACHE is set to an empty string)" if os.environ.get("FLASHTRAIN_CACHE") == "" else ""
    _require(str(cfg.data.get("cache_dir")).strip() != "", "data.cache_dir", cfg.data.get("cache_dir"),
             f"expected a folder for the token cache{empty_env}")


def validate_config(cfg: DictConfig, root: str = "train") -> None:
    """Every group of a composed config, its top-level keys, and the checks across groups; raises
    ValueError naming the first bad value. `root` names the config (train, max_context, ...)."""
    cls = schema.ROOTS[root]
    groups = [g for g in schema.GROUPS if g in cfg]
    for group in groups:
        check_group(group, cfg[group])
    _check_masks(cfg)
    if root == "train":
        _check_run_folders(cfg)
    top = {k: cfg[k] for k in cfg if k not in schema.GROUPS and not OmegaConf.is_missing(cfg, k)
           and not OmegaConf.is_interpolation(cfg, k)}  # an interpolated key is checked at its source
    check_fields(cls, top)
    _require(cfg.resume is None or cfg.resume != "", "resume", cfg.resume, "expected null, auto or a checkpoint path")
    seq_len, model = cfg.trainer.seq_len, cfg.model
    max_len = model.get("max_seq_len")
    _require(seq_len <= max_len, "trainer.seq_len", seq_len,
             f"exceeds model.max_seq_len={max_len} of model '{model.get('name')}'")
    # A learned table larger than the training length: its extra rows are never trained, and the
    # tiny preset's RoPE-sized max_seq_len would make it 134M parameters. One imported with
    # model.init_from (GPT-2's) was trained whole and is kept at its size.
    _require(model.get("pos_emb") != "learned" or model.get("init_from") or max_len <= seq_len, "model.max_seq_len",
             max_len,
             f"with model.pos_emb=learned this is the size of the position table, larger than "
             f"trainer.seq_len={seq_len} needs (rows past it are never trained): pass model.max_seq_len={seq_len}")
