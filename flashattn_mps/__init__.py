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
from ._quantized import QuantizedKV, quantize_kv
from ._sdpa import explain, patch, scaled_dot_product_attention, unpatch
from ._varlen import explain_varlen_plan, flash_attn_varlen_func

__version__ = "0.1.0"
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
    "quantize_kv",
    "QuantizedKV",
    "MetalCompileError",
    "MetalDispatchError",
    "__version__",
]
