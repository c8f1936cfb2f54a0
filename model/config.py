"""The model's own config: the keys of configs/model/*.yaml, resolved and validated.

`GPTConfig.from_cfg` is where a bad model config is caught, before any weights are
allocated, with one line naming the key and the reason.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from omegaconf import DictConfig, OmegaConf

CHOICES = {
    "pos_emb": ("rope", "learned"),
    "norm": ("rmsnorm", "layernorm"),
    "mlp": ("swiglu", "gelu"),
    "activation_checkpointing": ("none", "full", "selective"),
}
VOCAB_MULTIPLE = 64  # tensor-core-friendly head width when the tokenizer sets the size


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class GPTConfig:
    name: str = "custom"
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 4
    d_model: int = 128
    d_ff: Optional[int] = None          # None: 4*d_model (gelu) or 8/3*d_model rounded to 64 (swiglu)
    vocab_size: Optional[int] = None    # None: the tokenizer's size rounded up to 64
    max_seq_len: int = 1024
    pos_emb: str = "rope"
    rope_theta: float = 10000.0
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    mlp: str = "swiglu"
    tie_embeddings: bool = True
    bias: bool = False
    dropout: float = 0.0
    init_std: float = 0.02
    activation_checkpointing: str = "none"
    loss_chunk_size: int = 0
    reset_positions: bool = False       # positions restart at 0 at each document of a packed window
    block_chunk_size: int = 0           # >0: a block's per-token stages run over chunks of this many tokens
    offload_activations: bool = False   # full checkpointing's block inputs wait in host memory
    init_from: Optional[str] = None     # a Hugging Face folder to start from (training/hf.py reads it)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @classmethod
    def from_cfg(cls, cfg_model, vocab_size: int) -> "GPTConfig":
        """Build from the `model` config node (DictConfig or dict) and the tokenizer's size.

        Fills in `vocab_size` and `d_ff` when null and validates everything.
        """
        values = OmegaConf.to_container(cfg_model, resolve=True) if isinstance(cfg_model, DictConfig) else dict(cfg_model)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown model config key(s): {', '.join(unknown)}")
        _check_types(values)
        config = cls(**values)
        if vocab_size < 1:
            raise ValueError(f"tokenizer vocab_size must be positive, got {vocab_size}")
        if config.vocab_size is None:
            config = dataclasses.replace(config, vocab_size=_round_up(vocab_size, VOCAB_MULTIPLE))
        elif vocab_size > config.vocab_size:
            raise ValueError(
                f"model.vocab_size={config.vocab_size} is smaller than the tokenizer's {vocab_size} tokens"
            )
        if config.d_ff is None:
            d_ff = 4 * config.d_model if config.mlp == "gelu" else _round_up(8 * config.d_model // 3, 64)
            config = dataclasses.replace(config, d_ff=d_ff)
        config.validate()
        return config

    def validate(self) -> None:
        for key, allowed in CHOICES.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"model.{key}={getattr(self, key)!r}; valid: {', '.join(allowed)}")
        for key in ("n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "vocab_size", "max_seq_len"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key}={getattr(self, key)} must be positive")
        if self.d_model % self.n_head:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"model.n_head={self.n_head} is not divisible by model.n_kv_head={self.n_kv_head}")
        if self.pos_emb == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head dim, got d_model/n_head={self.head_dim}")
        if not self.norm_eps > 0:
            raise ValueError(f"model.norm_eps={self.norm_eps} must be positive")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout} must be in [0, 1)")
        if self.loss_chunk_size < 0:
            raise ValueError(f"model.loss_chunk_size={self.loss_chunk_size} must be >= 0 (0 disables chunking)")
        if self.block_chunk_size < 0:
            raise ValueError(f"model.block_chunk_size={self.block_chunk_size} must be >= 0 (0 disables chunking)")
        if self.block_chunk_size and self.activation_checkpointing == "none":
            raise ValueError(f"model.block_chunk_size={self.block_chunk_size} needs model.activation_checkpointing="
                             "full or selective (without checkpointing every chunk's activations are kept anyway)")
        if self.block_chunk_size and self.dropout:
            raise ValueError(f"model.block_chunk_size={self.block_chunk_size} with model.dropout={self.dropout}: "
                             "chunks would draw other dropout masks than the whole sequence; use dropout=0")
        if self.offload_activations and self.activation_checkpointing != "full":
            raise ValueError("model.offload_activations=true needs model.activation_checkpointing=full (it moves "
                             f"the block inputs that full checkpointing keeps), got {self.activation_checkpointing!r}")


_TYPES = {  # annotation -> (check, what the error says)
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "Optional[int]": (lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)), "an integer or null"),
    "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "Optional[str]": (lambda v: v is None or isinstance(v, str), "a string or null"),
}


def _check_types(values: dict) -> None:
    """One line naming the first key whose value has the wrong type (`model.n_layer=2.5`)."""
    for f in dataclasses.fields(GPTConfig):
        if f.name in values:
            check, what = _TYPES[str(f.type)]
            if not check(values[f.name]):
                raise ValueError(f"model.{f.name}={values[f.name]!r}: must be {what}")
