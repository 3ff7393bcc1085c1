"""FlashAttention-4's flash_attn.cute, served by flashattn_mps (see interface.py)."""

import flashattn_mps as _flashattn_mps

from .interface import MIRRORS, flash_attn_func, flash_attn_varlen_func

__version__ = f"{MIRRORS}+flashattn.mps.{_flashattn_mps.__version__}"

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]
