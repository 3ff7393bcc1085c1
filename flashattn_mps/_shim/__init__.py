"""The `flash_attn` shim: modules named as flash-attention's (flash_attn for flash-attn 2.8,
flash_attn_interface for FlashAttention-3, flash_attn.cute for FlashAttention-4), each a thin
layer over flashattn_mps's functions, served under those names by the import hook in finder.py
(flashattn_mps.install_flash_attn_shim, or FLASHATTN_MPS_FLASH_ATTN_SHIM=1 through the .pth file
the package build installs)."""
