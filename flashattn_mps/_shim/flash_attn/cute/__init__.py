"""FlashAttention-4's flash_attn.cute, served by flashattn_mps (see interface.py)."""

from .interface import MIRRORS, flash_attn_func, flash_attn_varlen_func

__version__ = f"{MIRRORS}+flashattn.mps"

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]
