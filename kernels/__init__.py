"""Exact attention kernels: the Triton FlashAttention, the Gluon Hopper kernels, the plain-PyTorch
reference. kernels/README.md gives the reading order.

The names below load on first use, so that importing a small module of this package (the config
schema reads `kernels.choices`) does not import torch and triton.
"""
from importlib import import_module

_WHERE = {"flash_attention": "kernels.flash_op", "flash_attention_backward": "kernels.flash_op",
          "attention_reference": "kernels.reference", "attention_reference_backward": "kernels.reference"}

__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    return getattr(import_module(_WHERE[name]), name)
