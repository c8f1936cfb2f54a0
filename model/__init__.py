"""The GPT model: `build_model(cfg.model, vocab_size, attention)` -> `GPT`."""
from model.config import GPTConfig
from model.gpt import GPT, build_model

__all__ = ["GPT", "GPTConfig", "build_model"]
