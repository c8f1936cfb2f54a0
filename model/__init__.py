"""The GPT model: `build_model(cfg.model, vocab_size, attention)` -> `GPT`.

The names below load on first use, so that `model.config` (the config schema's model group,
read by `train.py --help`) imports no torch.
"""
from importlib import import_module

_WHERE = {"GPT": "model.gpt", "build_model": "model.gpt", "GPTConfig": "model.config", "KVCache": "model.kv_cache"}

__all__ = ["GPT", "GPTConfig", "KVCache", "build_model"]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'model' has no attribute {name!r}")
    return getattr(import_module(_WHERE[name]), name)
