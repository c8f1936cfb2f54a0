"""The GPT model: `build_model(cfg.model, vocab_size, attention)` -> `GPT`."""
from model.config import GPTConfig
from model.gpt import GPT, build_model
from model.kv_cache import KVCache

__all__ = ["GPT", "GPTConfig", "KVCache", "build_model"]
