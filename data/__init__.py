"""Data for flashtrain: sources -> tokenizer -> memory-mapped token cache -> window samplers.

    bundle = build_data(cfg, seq_len=cfg.trainer.seq_len, seed=cfg.seed, rank=0, world_size=1)
    x, y = bundle.train.next_batch(8)

Callers outside training/ build through training.builders' `build_data`, which runs the schema's
checks of the data group first and then this package's.
"""
from data.build import DataBundle, build_data

__all__ = ["DataBundle", "build_data"]
