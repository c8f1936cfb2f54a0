"""The config's schema: one typed dataclass per config group, registered with Hydra's ConfigStore.

Hydra merges every YAML file of configs/ into these classes when it composes the config, so an
unknown key, a value of the wrong type or a value outside a choice (`trainer.precision=fp8`)
fails at composition, before anything runs. The YAML files stay the presets users pick
(`model=gpt2-small`); the range of each number is declared here as field metadata and checked
by `training.config.checks.check_group` (one place). The model group's class is the model's own
`GPTConfig` (model/config.py), with the field helpers every group uses. Imports nothing heavy:
`train.py --help` loads it.

Where a group's options have different keys (data sources, tokenizers, loggers) each option has
its own class, named in its YAML file's defaults list (`/schema/data/stdlib@_here_`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from kernels.choices import CHOICES
from model.config import GPTConfig, ranged
from model.config import choice as _choice


Precision = _choice("Precision", "auto", "bf16", "fp32")
Device = _choice("Device", "auto", "cpu", "cuda")
Parallel = _choice("Parallel", "ddp", "fsdp")          # training/parallel/data_parallel.py implements them
Optimizer = _choice("Optimizer", "adamw")
Schedule = _choice("Schedule", "cosine", "constant")
WandbMode = _choice("WandbMode", "online", "offline", "disabled")
Download = _choice("Download", "full", "lazy")
Windows = _choice("Windows", "moving", "fixed")          # data.sampler.WINDOWS
PasskeyKind = _choice("PasskeyKind", "single", "dense")  # data.sources.passkey.KINDS
Kernel = _choice("Kernel", *CHOICES)                    # our kernel's words (kernels/plan.py)


def _list(*values: Any, expect: str | None = None) -> Any:
    """A list field; `expect` words its error where the type alone would not say enough."""
    return field(default_factory=lambda: list(values), metadata={"expect": expect} if expect else {})


# ----------------------------------------------------------------------------- groups

ModelConfig = GPTConfig   # the model's own dataclass (model/config.py), the one declaration of its keys


@dataclass
class AttentionConfig:
    name: str = "auto"                                 # the YAML file: auto | flash | sdpa | naive
    window: Optional[int] = ranged(None, ge=1)
    deterministic: bool = True
    kernel: Kernel = Kernel.auto                       # attention=flash's kernels, both directions
    forward_kernel: Optional[Kernel] = None            # the forward's alone (null: attention.kernel)
    backward_kernel: Optional[Kernel] = None           # the backward's alone (null: attention.kernel)
    plan: Optional[str] = None                         # what the run's kernels are (set by the run)


@dataclass
class DataConfig:
    name: str = MISSING
    val_fraction: float = ranged(0.05, ge=0, lt=1)
    cache_dir: str = '${oc.env:FLASHTRAIN_CACHE,"~/.cache/flashtrain"}'
    verify_cache: bool = True
    allow_changed: bool = False
    document_mask: bool = False
    windows: Windows = Windows.moving


@dataclass
class StdlibData(DataConfig):
    max_bytes: Optional[int] = ranged(None, ge=1)
    include_tests: bool = True
    min_doc_bytes: Optional[int] = ranged(None, ge=1)


@dataclass
class FilesData(DataConfig):
    paths: Any = MISSING                               # a path or a list of paths (files or folders)
    text_field: str = "text"
    text_extensions: List[str] = _list(".txt", ".md", ".rst")
    max_bad_fraction: float = ranged(0.01, ge=0, le=1)


@dataclass
class HfData(DataConfig):
    dataset: str = MISSING
    config: Optional[str] = None
    split: str = "train"
    text_field: str = "text"
    data_files: Any = None                             # null, a file or a list of files
    revision: Optional[str] = None
    download: Download = Download.full                 # full: prepare the split first; lazy: stream it
    max_docs: Optional[int] = ranged(None, ge=1)
    max_bad_fraction: float = ranged(0.01, ge=0, le=1)


MAX_KEY_DIGITS = 18   # passkeys are drawn as int64 (data/passkey.py); scripts/eval_passkey.py's bound too


@dataclass
class PasskeyDocs:
    """The passkey documents' keys: data=passkey's, and data=stdlib-passkey's `passkey` node."""
    num_docs: int = ranged(2000, ge=2)
    length: int = ranged(1024, ge=1)
    depths: Optional[List[float]] = None
    key_digits: int = ranged(5, ge=1, le=MAX_KEY_DIGITS)
    seed: int = 0
    kind: PasskeyKind = PasskeyKind.single        # single: one key in filler; dense: many named keys (data/retrieval.py)
    pairs: Optional[int] = ranged(None, ge=1)     # kind=dense: keys (each asked for later) per document
    pieces: Optional[List[int]] = None            # kind=dense: documents each `length`-token unit is cut into, cycling
    piece_pairs: Optional[List[int]] = None       # with pieces: keys per document for each entry of pieces (else pairs)
    ask_last: bool = False                        # kind=dense, one key a document: the question ends it, as in the eval


@dataclass
class PasskeyData(DataConfig, PasskeyDocs):
    pass


@dataclass
class StdlibPasskeyData(StdlibData):
    passkey: PasskeyDocs = field(default_factory=PasskeyDocs)


@dataclass
class TokenizerConfig:
    name: str = MISSING


@dataclass
class BytesTokenizer(TokenizerConfig):
    pass


@dataclass
class BpeTokenizer(TokenizerConfig):
    vocab_size: int = ranged(8192, ge=258)             # the 256 bytes + <|endoftext|> + at least one merge
    min_frequency: int = ranged(2, ge=1)
    train_max_bytes: Optional[int] = ranged(10_000_000, ge=1)
    split_digits: bool = False                           # every digit its own token (data/tokenizer.py)


@dataclass
class PretrainedTokenizer(TokenizerConfig):
    path: str = MISSING
    eot_token: str = "<|endoftext|>"


BETAS = "expected two values in [0, 1), e.g. [0.9,0.95]"
SEED_MAX = 2**63 - 1   # what torch.manual_seed and the samplers take


@dataclass
class OptimConfig:
    name: Optimizer = Optimizer.adamw
    lr: float = ranged(1e-3, gt=0)
    min_lr: float = ranged(1e-4, ge=0)                 # and <= lr (training.config.checks)
    betas: List[float] = _list(0.9, 0.95, expect=BETAS)
    eps: float = ranged(1e-8, gt=0)
    weight_decay: float = ranged(0.1, ge=0)
    decay_embeddings: bool = True
    warmup_steps: int = ranged(20, ge=0)
    schedule: Schedule = Schedule.cosine
    grad_clip: float = ranged(1.0, ge=0)               # 0 disables
    fused: Any = "auto"                                # auto | true | false


@dataclass
class TrainerConfig:
    max_steps: int = ranged(300, ge=1)
    seq_len: int = ranged(256, ge=1)
    batch_size: int = ranged(8, ge=1)
    grad_accum: int = ranged(1, ge=1)
    eval_every: int = ranged(100, ge=0)
    eval_batches: int = ranged(8, ge=1)
    ckpt_every: int = ranged(100, ge=0)
    keep_ckpts: int = ranged(2, ge=1)
    log_every: int = ranged(10, ge=1)
    compile: bool = False
    precision: Precision = Precision.auto
    progress: bool = True
    peak_flops: Optional[float] = ranged(None, gt=0)
    parallel: Parallel = Parallel.ddp
    dist_timeout_s: float = ranged(600.0, gt=0)
    context_parallel: int = ranged(1, ge=1)
    deterministic: bool = False        # true: every CUDA kernel of the step deterministic (bit-identical resume)
    cpu_threads: Optional[int] = ranged(None, ge=1)   # null: chosen at start (training.process.device.cpu_threads)
    passkey_probe: List[int] = _list()    # prompt lengths whose passkey accuracy each evaluation logs
    passkey_trials: int = ranged(4, ge=1)  # keys per depth (0, 0.5, 1) and length of the probe


@dataclass
class LoggerConfig:
    name: str = MISSING


@dataclass
class NoLogger(LoggerConfig):
    pass


@dataclass
class WandbLogger(LoggerConfig):
    project: Optional[str] = None      # null: wandb's WANDB_PROJECT, else flashtrain
    entity: Optional[str] = None
    mode: Optional[WandbMode] = None   # null: wandb's WANDB_MODE, else offline
    tags: List[str] = _list()
    init_timeout_s: float = ranged(60.0, gt=0)   # online: how long to wait for W&B before failing in one line


@dataclass
class RunConfig:
    dir: str = "${hydra:runtime.output_dir}"
    name: Optional[str] = None
    latest: Optional[str] = "outputs/latest"   # a link to the newest run in its default folder (null: none)


# ----------------------------------------------------------------------------- whole configs

@dataclass
class TrainConfig:
    """configs/train.yaml: what `python train.py` runs."""
    model: ModelConfig = MISSING
    attention: AttentionConfig = MISSING
    data: DataConfig = MISSING
    tokenizer: TokenizerConfig = MISSING
    optim: OptimConfig = MISSING
    trainer: TrainerConfig = MISSING
    logger: LoggerConfig = MISSING
    seed: int = ranged(1337, ge=0, le=SEED_MAX)
    device: Device = Device.auto
    resume: Optional[str] = None       # null | auto | continue | path/to/checkpoint
    allow_changes: List[str] = _list()  # training keys a resume may change (training.run.resume)
    run: RunConfig = MISSING


@dataclass
class MaxContextConfig(TrainConfig):
    """configs/max_context.yaml: the training config plus scripts/max_context.py's search."""
    features: List[str] = _list("plain")
    skip: List[str] = _list()
    batch_size: int = ranged(1, ge=1)
    start: Optional[int] = ranged(None, ge=1)         # null: the device's default (scripts/max_context.py)
    granularity: Optional[int] = ranged(None, ge=1)
    cap: Optional[int] = ranged(None, ge=1)
    memory_budget_mb: Optional[float] = ranged(None, gt=0)
    extend: bool = False
    partial_step: bool = False
    feature_sets: Dict[str, Dict[str, Any]] = field(default_factory=dict)


@dataclass
class ProfileStepConfig(MaxContextConfig):
    """configs/profile_step.yaml: one step of max_context's at `length` tokens, profiled."""
    length: int = ranged(65536, ge=1)


# Per-option classes of the groups whose options differ in keys, by the option's `name`.
OPTIONS: dict[str, dict[str, type]] = {
    "data": {"stdlib": StdlibData, "files": FilesData, "hf": HfData, "passkey": PasskeyData,
             "stdlib-passkey": StdlibPasskeyData},
    "tokenizer": {"bytes": BytesTokenizer, "bpe": BpeTokenizer, "pretrained": PretrainedTokenizer},
    "logger": {"none": NoLogger, "wandb": WandbLogger},
}
GROUPS: dict[str, type] = {"model": ModelConfig, "attention": AttentionConfig, "data": DataConfig,
                           "tokenizer": TokenizerConfig, "optim": OptimConfig, "trainer": TrainerConfig,
                           "logger": LoggerConfig}
ROOTS: dict[str, type] = {"train": TrainConfig, "max_context": MaxContextConfig, "profile_step": ProfileStepConfig}


def default_of(key: str) -> Any:
    """The schema's default of a "group.key" name (e.g. `attention.window`)."""
    group, name = key.split(".")
    return {f.name: f.default for f in fields(GROUPS[group])}[name]


def schema_of(group: str, node: Any) -> type:
    """The class a group's node follows: its option's own class where the options differ."""
    options = OPTIONS.get(group, {})
    name = node.get("name") if hasattr(node, "get") else None
    return options.get(str(name), GROUPS[group]) if options else GROUPS[group]


def register(root: str = "train") -> None:
    """Put the schema into Hydra's ConfigStore: `schema: train` in configs/train.yaml's defaults
    types the whole config, `/schema/<group>_<option>@_here_` types one option's file. The
    scripts' roots (max_context, profile_step) are registered by `training.config.compose` when
    asked for: every entry in the store is copied each time `train.py --help` lists a group."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(group="schema", name=root, node=ROOTS[root])
    if root == "train":
        for group, options in OPTIONS.items():
            for name, node in options.items():
                store.store(group="schema", name=f"{group}_{name}", node=node)


register()
