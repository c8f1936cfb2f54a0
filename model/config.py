"""The model's config: the keys of configs/model/*.yaml, declared once.

`GPTConfig` is both the schema of the `model` config group (training.config.schema registers it with
Hydra, which types every YAML file and override against it; each number's range is field
metadata, checked by training.config.checks.check_group) and the model's own resolved config.
`GPTConfig.from_cfg` takes a node that check has passed (training.builders.build_model runs it
before any weights are allocated, so a bad value is one line naming the key) and fills in what
the tokenizer decides. The field helpers below (`Choice`, `ranged`) serve every group's schema;
they live here, in the lowest layer that declares config, so that the model imports nothing of
training. Imports nothing heavy: `train.py --help` loads it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

VOCAB_MULTIPLE = 64  # tensor-core-friendly head width when the tokenizer sets the size


class Choice(str, Enum):
    """A config value from a fixed set; compares equal to (and prints as) its plain string."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


def choice(name: str, *values: str) -> type[Choice]:
    return Choice(name, [(v, v) for v in values])


def ranged(default: Any = MISSING, *, ge: float | None = None, gt: float | None = None,
           lt: float | None = None, le: float | None = None) -> Any:
    """A field whose value must lie in a range (null passes where the type is Optional)."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("lt", lt), ("le", le)) if v is not None}
    return field(default=default, metadata={"range": bounds})


PosEmb = choice("PosEmb", "rope", "learned")
Norm = choice("Norm", "rmsnorm", "layernorm")
Mlp = choice("Mlp", "swiglu", "gelu")
Checkpointing = choice("Checkpointing", "none", "full", "selective")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class GPTConfig:
    name: str = "tiny"
    n_layer: int = ranged(4, ge=1)
    n_head: int = ranged(4, ge=1)
    n_kv_head: int = ranged(4, ge=1)
    d_model: int = ranged(128, ge=1)
    d_ff: Optional[int] = ranged(None, ge=1)          # null: 4*d_model (gelu) or 8/3*d_model rounded to 64 (swiglu)
    vocab_size: Optional[int] = ranged(None, ge=1)    # null: the tokenizer's size rounded up to 64
    max_seq_len: int = ranged(1024, ge=1)
    pos_emb: PosEmb = PosEmb.rope
    rope_theta: float = ranged(10000.0, gt=0)
    rope_fraction: float = ranged(1.0, ge=0, le=1)    # the fastest share of RoPE's pairs that rotate; the rest stay still (p-RoPE)
    norm: Norm = Norm.rmsnorm
    norm_eps: float = ranged(1e-5, gt=0)
    mlp: Mlp = Mlp.swiglu
    tie_embeddings: bool = True
    bias: bool = False
    dropout: float = ranged(0.0, ge=0, lt=1)          # embeddings' sum and each residual branch's output
    attention_dropout: float = ranged(0.0, ge=0, lt=1)  # attention probabilities (SDPA's dropout_p), in training
    attention_softcap: Optional[float] = ranged(None, gt=0)  # c: every score s -> c tanh(s / c) (Gemma 2); flash, naive
    attention_sinks: bool = False                     # a learned logit per head in each softmax's denominator (gpt-oss)
    # L: each query scaled by s_h log(n), n the keys it sees, s_h learned per head from 1 / log(L) (Scalable-Softmax)
    attention_length_scale: Optional[int] = ranged(None, ge=2)
    init_std: float = ranged(0.02, gt=0)
    init_from: Optional[str] = None                   # a Hugging Face folder to start from (training/interop/huggingface.py reads it)
    activation_checkpointing: Checkpointing = Checkpointing.none
    loss_chunk_size: int = ranged(0, ge=0)
    offload_activations: bool = False                 # full checkpointing's block inputs wait in host memory
    block_chunk_size: int = ranged(0, ge=0)           # >0: a block's per-token stages run over chunks of this many
    reset_positions: bool = False                     # positions restart at 0 at each document of a packed window

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def rotated_pairs(self) -> int | None:
        """How many of each head's RoPE pairs rotate (the fastest), None for all of them."""
        return None if self.rope_fraction == 1 else round(self.rope_fraction * self.head_dim / 2)

    @classmethod
    def from_cfg(cls, cfg_model, vocab_size: int) -> "GPTConfig":
        """Build from the `model` config node (DictConfig or dict) and the tokenizer's size.

        Fills in `vocab_size` and `d_ff` when null.
        """
        values = OmegaConf.to_container(cfg_model, resolve=True) if isinstance(cfg_model, DictConfig) else dict(cfg_model)
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
        return config
