"""Exact attention kernels: the Triton FlashAttention and its plain-PyTorch reference."""
from kernels.flash_op import flash_attention, flash_attention_backward
from kernels.reference import attention_reference, attention_reference_backward

__all__ = ["flash_attention", "flash_attention_backward", "attention_reference", "attention_reference_backward"]
