"""FlashAttention for PyTorch on Apple silicon.

`flash_attention(q, k, v, causal=False, scale=None)` computes what
`torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
enable_gqa=True)` computes, without ever forming the L x S score matrix. MPS tensors run on Metal;
CPU tensors run the same Metal kernels on the CPU Metal device (see `flashattn_mps.metal_cpu`).
`flash_attn_func` is flash-attn 2's function of that name ((B, L, H, D) layout, bottom-right causal,
sliding windows) over the same kernels.
"""

from . import _autograd  # noqa: F401  registers the torch.library ops that make flash_attention differentiable
from ._api import explain_plan, flash_attention
from ._C import MetalCompileError, MetalDispatchError
from ._flash_attn import flash_attn_func
from ._kvcache import explain_kvcache_plan, flash_attn_with_kvcache
from ._options import FlashAttnInputError, FlashAttnTypeError
from ._quantized import QuantizedKV, quantize_kv
from ._sdpa import explain, patch, scaled_dot_product_attention, unpatch
from ._shim import finder as _shim_finder
from ._varlen import explain_varlen_plan, flash_attn_varlen_func
from ._warmup import warmup

__version__ = "0.1.0"


def install_flash_attn_shim() -> None:
    """Lets `import flash_attn` (flash-attn 2.8's API), `import flash_attn_interface`
    (FlashAttention-3's) and `import flash_attn.cute` (FlashAttention-4's) load flashattn_mps's
    shim, unless a real module of that name exists on sys.path when it is imported (then the real
    one is imported, and a warning says so once). FLASHATTN_MPS_FLASH_ATTN_SHIM=1 does this at
    interpreter start (the .pth file the package installs), for unmodified scripts."""
    _shim_finder.install()


def uninstall_flash_attn_shim() -> None:
    """Undoes install_flash_attn_shim: removes the import hook and forgets the shim's modules
    (code that already holds them keeps working; the next import finds no flash_attn)."""
    _shim_finder.uninstall()


_shim_finder.install_from_environment()
__all__ = [
    "flash_attention",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "scaled_dot_product_attention",
    "explain",
    "explain_plan",
    "explain_varlen_plan",
    "explain_kvcache_plan",
    "patch",
    "unpatch",
    "warmup",
    "quantize_kv",
    "QuantizedKV",
    "MetalCompileError",
    "MetalDispatchError",
    "FlashAttnInputError",
    "FlashAttnTypeError",
    "__version__",
    "install_flash_attn_shim",
    "uninstall_flash_attn_shim",
]
