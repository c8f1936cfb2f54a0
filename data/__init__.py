"""Data for flashtrain: sources -> tokenizer -> memory-mapped token cache -> window samplers.

    from training.builders import build_data   # the schema's checks, then data.build.build_data
    bundle = build_data(cfg, seq_len=cfg.trainer.seq_len, seed=cfg.seed, rank=0, world_size=1)
    x, y = bundle.train.next_batch(8)
"""
from data.build import DataBundle, build_data

__all__ = ["DataBundle", "build_data"]
