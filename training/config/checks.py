"""The config's checks beyond its types: each number's declared range (the schema's field metadata)
and the checks across keys and groups. Every consumer calls them: the Trainer once the config is
final (`validate_config`), training.builders' `build_model` and `build_data` for the groups they
are given (`check_group`).
"""
from __future__ import annotations

import dataclasses
import math
import os
import typing
from enum import Enum

from omegaconf import DictConfig, OmegaConf

from training.config import schema


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
        kind = {float: "numbers", int: "integers"}.get(next(iter(typing.get_args(annotation)), str), "strings")
        return f"must be a list of {kind}"
    if typing.get_origin(annotation) in (dict, typing.Dict):
        return "must be a mapping"
    return "must be a string"


def bad_value(key: str, value, cls: type | None, name: str) -> str:
    """`key=value: what it must be`, from schema class `cls`'s field `name` where it has one."""
    found = _field(cls, name) if cls is not None else None
    reason = expectation(*found) if found else "has the wrong type"
    return f"{key}={value!r}: {reason}"


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
            raise ValueError(bad_value(key, exc.value, exc.object_type or cls, key.rsplit(".", 1)[-1])) from None
        raise ValueError(f"unknown config key '{key}'") from None
    _check_ranges(cls, typed, node, prefix)
    return typed


def _check_ranges(cls: type, typed, node, prefix: str) -> None:
    """Each field's declared range, for the keys `node` sets; a node of a nested class (a mix's
    `data.passkey`) is checked the same way."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in node:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            _check_ranges(hints[f.name], typed[f.name], node[f.name], f"{prefix}{f.name}.")
            continue
        bounds = f.metadata.get("range")
        if bounds is None:
            continue
        value, expected = typed[f.name], expectation(hints[f.name], f.metadata)
        _require(value is None or not isinstance(value, float) or math.isfinite(value), f"{prefix}{f.name}", value,
                 expected.replace("a number", "a finite number"))
        _require(value is None or _in_range(value, bounds), f"{prefix}{f.name}", value, expected)


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
    if m.attention_length_scale is not None and m.pos_emb != "rope":
        raise ValueError(f"model.attention_length_scale={m.attention_length_scale} needs model.pos_emb=rope (the "
                         "scale rides on the RoPE table's positions)")
    if m.pos_emb == "rope" and (m.d_model // m.n_head) % 2:
        raise ValueError(f"RoPE needs an even head dim, got d_model/n_head={m.d_model // m.n_head}")
    if m.rope_fraction != 1:
        pairs = m.d_model // m.n_head // 2
        _require(m.pos_emb == "rope", "model.rope_fraction", m.rope_fraction, "needs model.pos_emb=rope")
        _require(abs(m.rope_fraction * pairs - round(m.rope_fraction * pairs)) < 1e-9, "model.rope_fraction",
                 m.rope_fraction, f"must rotate a whole number of the {pairs} RoPE pairs of head dim {2 * pairs} "
                 f"(a multiple of 1/{pairs})")
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
    _require(cp == 1 or "gluon" not in kernel_words(cfg), "trainer.context_parallel", cp,
             "the ring's blocks run the Triton kernels (each block takes its share of the mask as key bounds, which "
             "the Gluon kernels do not): use attention.kernel=auto or triton, or trainer.context_parallel=1")
    _require(not cfg.trainer.deterministic or cfg.attention.deterministic, "trainer.deterministic", True,
             "needs attention.deterministic=true (the atomic backward adds dQ in a different order each run)")


# A probe prompt of n tokens runs past n by its answer and by the rounding of its filler to whole sentences
PROBE_MARGIN = 64


def _check_passkey_probe(cfg: DictConfig) -> None:
    """`trainer.passkey_probe`'s lengths fit the model, and the probe runs whole prompts, which the
    context-parallel ring does not take; refused before any training work is done."""
    probe = list(cfg.trainer.get("passkey_probe") or [])
    cp, most = cfg.trainer.context_parallel, cfg.model.max_seq_len - PROBE_MARGIN
    _require(cp == 1 or not probe, "trainer.context_parallel", cp,
             "the passkey probe runs whole prompts through the model on each rank: use trainer.passkey_probe=[] "
             "or trainer.context_parallel=1")
    _require(all(1 <= n <= most for n in probe), "trainer.passkey_probe", probe,
             f"lengths must be in [1, model.max_seq_len - {PROBE_MARGIN} = {most}] (a prompt runs a few tokens "
             f"past its length with its answer)")


def kernel_words(cfg: DictConfig) -> tuple[str, str]:
    """attention=flash's kernel words per direction: attention.forward_kernel and
    attention.backward_kernel where set, attention.kernel otherwise."""
    both = str(cfg.attention.get("kernel", "auto"))
    return tuple(str(cfg.attention.get(f"{d}_kernel") or both) for d in ("forward", "backward"))


def _check_run_folders(cfg: DictConfig) -> None:
    """An empty folder name would make the run write into the current folder."""
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
    _check_passkey_probe(cfg)
    if root == "train":
        _check_run_folders(cfg)
    top = {k: cfg[k] for k in cfg if k not in schema.GROUPS and not OmegaConf.is_missing(cfg, k)
           and not OmegaConf.is_interpolation(cfg, k)}  # an interpolated key is checked at its source
    check_fields(cls, top)
    _require(cfg.resume is None or cfg.resume != "", "resume", cfg.resume, "expected null, auto, continue or a checkpoint path")
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
