"""Exact attention kernels: the Triton FlashAttention and its plain-PyTorch reference."""
from kernels.flash_op import flash_attention
from kernels.reference import attention_reference

__all__ = ["flash_attention", "attention_reference"]
