"""flash-attn 2.8's `flash_attn` module, served by flashattn_mps (the shim: see
flashattn_mps.install_flash_attn_shim). Its functions keep flash-attn's signatures and return
conventions and run flashattn_mps's kernels."""

import flashattn_mps as _flashattn_mps

from .flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

MIRRORS = "2.8.4"  # the flash-attn release whose API this module keeps
# A PEP 440 version that compares as that release, its local part saying what it is.
__version__ = f"{MIRRORS}+flashattn.mps.{_flashattn_mps.__version__}"
IS_FLASHATTN_MPS_SHIM = True

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
