"""The model's own config: the keys of configs/model/*.yaml, resolved.

`GPTConfig.from_cfg` takes a node the config schema has checked (training.builders.build_model
does that before any weights are allocated, so a bad value is one line naming the key) and fills
in what the tokenizer decides.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from omegaconf import DictConfig, OmegaConf

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
    dropout: float = 0.0                # embeddings' sum and each residual branch's output
    attention_dropout: float = 0.0      # attention probabilities (SDPA's dropout_p): needs attention=sdpa
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
