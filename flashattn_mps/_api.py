"""The public attention function: validation with clear messages, then one call into the C core."""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import _C, _sources

_DTYPE_CODES = {
    torch.float32: _C.DTYPE_FLOAT32,
    torch.float16: _C.DTYPE_FLOAT16,
    torch.bfloat16: _C.DTYPE_BFLOAT16,
}
_DESCRIPTOR_DTYPES = {**_DTYPE_CODES, torch.bool: _C.DTYPE_BOOL}  # bool only for masks
_DEVICE_CODES = {"cpu": _C.DEVICE_CPU, "mps": _C.DEVICE_MPS}
_metal_stream_mode = None  # decided on the first MPS call


def _prepare_mps() -> None:
    """Encode on PyTorch's MPS stream where that is safe; before PyTorch PR #164093 a new encoder on
    torch's command buffer can collide with its coalesced encoder, so older torch gets the backend's
    own queue after a torch.mps.synchronize() (the backend then waits for its work). The PR was
    merged in September 2025; torch 2.10 is the first release it is certain to be in, so 2.9 takes
    the safe path too."""
    global _metal_stream_mode
    if _metal_stream_mode is None:
        major, minor = (int(part) for part in torch.__version__.split(".")[:2])
        _metal_stream_mode = _C.metal_set_stream_mode(1 if (major, minor) >= (2, 10) else 0)
    if _metal_stream_mode == 0:
        torch.mps.synchronize()


_KERNELS = {
    "auto": _C.KERNEL_AUTO,
    "simple": _C.KERNEL_SIMPLE,
    "forward": _C.KERNEL_FORWARD,
    "decode": _C.KERNEL_DECODE,
}


def describe(t: torch.Tensor) -> tuple:
    """The C core's view of a tensor: (storage, storage bytes, byte offset, dtype, sizes, strides).

    The storage handle is the host address for CPU tensors and the id<MTLBuffer> for MPS tensors
    (PyTorch's MPS allocator hands out the buffer object as the storage's data pointer)."""
    storage = t.untyped_storage()
    return (
        storage.data_ptr(),
        storage.nbytes(),
        t.storage_offset() * t.element_size(),
        _DESCRIPTOR_DTYPES[t.dtype],
        tuple(t.shape),
        tuple(t.stride()),
    )


def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale, attn_mask=None) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flash_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type not in _DEVICE_CODES:
            raise ValueError(
                f"flash_attention: {name} is on device '{t.device}'; supported devices are mps (Metal) "
                "and cpu (the CPU Metal device)"
            )
    if not (q.device == k.device == v.device):
        raise ValueError(f"flash_attention: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _DTYPE_CODES:
            raise TypeError(
                f"flash_attention: {name} has dtype {t.dtype}; supported are float32, float16 and bfloat16"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"flash_attention: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dim() not in (3, 4) or k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(
            "flash_attention: q, k, v must all be 4-D (B, H, L, E) or all 3-D (H, L, E), got "
            f"q {_shape(q)}, k {_shape(k)}, v {_shape(v)}"
        )
    shapes = f"q {_shape(q)}, k {_shape(k)}, v {_shape(v)}"
    if q.dim() == 4 and not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"flash_attention: batch sizes differ: {shapes}")
    if k.shape[-3] != v.shape[-3] or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"flash_attention: k and v must have the same heads and sequence length: {shapes}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"flash_attention: q and k must have the same head dim: {shapes}")
    if k.shape[-3] == 0 or q.shape[-3] % k.shape[-3] != 0:
        raise ValueError(
            f"flash_attention: the number of query heads ({q.shape[-3]}) must be a multiple of the number "
            f"of key/value heads ({k.shape[-3]}): {shapes}"
        )
    for name, t in (("q", q), ("v", v)):
        if t.shape[-1] > 256:
            raise ValueError(f"flash_attention: head dims up to 256 are supported, {name} has {t.shape[-1]}: {shapes}")
    if not isinstance(causal, bool):
        raise TypeError(f"flash_attention: causal must be a bool, got {type(causal).__name__}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"flash_attention: scale must be a float or None, got {type(scale).__name__}")
    if attn_mask is not None and causal:
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")


def supported_mask_dtype(mask_dtype: torch.dtype, query_dtype: torch.dtype) -> bool:
    """SDPA's rule: bool, float32, or the query's dtype."""
    return mask_dtype in (torch.bool, torch.float32, query_dtype)


def _validate_mask(attn_mask, q: torch.Tensor, k: torch.Tensor):
    """The mask as a (B, Hq, L, S) view (broadcast dims get stride 0; nothing is expanded in memory)."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"flash_attention: attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.device != q.device:
        raise ValueError(f"flash_attention: attn_mask is on {attn_mask.device}, q on {q.device}")
    if not supported_mask_dtype(attn_mask.dtype, q.dtype):
        raise TypeError(
            f"flash_attention: attn_mask has dtype {attn_mask.dtype}; masks are bool (True takes part), "
            f"float32 or the query's dtype ({q.dtype}), added to the scaled scores"
        )
    target = (*q.shape[:-1], k.shape[-2])
    try:
        view = attn_mask.expand(target)
    except RuntimeError:
        raise ValueError(
            f"flash_attention: attn_mask {tuple(attn_mask.shape)} does not broadcast to (B, Hq, L, S) = {target}"
        ) from None
    if attn_mask.requires_grad and torch.is_grad_enabled():
        raise ValueError("flash_attention: attn_mask requires grad, but masks are not differentiated")
    return view


def _validate_options(kernel, return_lse) -> None:
    if not isinstance(return_lse, bool):
        raise TypeError(f"flash_attention: return_lse must be a bool, got {type(return_lse).__name__}")
    if kernel not in _KERNELS:
        raise ValueError(f"flash_attention: kernel must be one of {sorted(_KERNELS)}, got {kernel!r}")


def _needs_torch_op(q, k, v) -> bool:
    """Autograd (some input requires grad) and torch.compile's tracing (fake tensors have no storage
    to describe) both go through the torch.library ops of flashattn_mps._autograd."""
    wants_grad = torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k, v))
    return wants_grad or torch.compiler.is_compiling()


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: Optional[float] = None,
    *,
    attn_mask: Optional[torch.Tensor] = None,
    kernel: str = "auto",
    return_lse: bool = False,
):
    """Scaled dot-product attention, exactly as
    `torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
    enable_gqa=True)`, without materialising the L x S score matrix.

    Args:
        q: (B, Hq, L, E) or (Hq, L, E); any strides and storage offset (nothing is copied).
        k: (B, Hkv, S, E) or (Hkv, S, E); Hq must be a multiple of Hkv (GQA/MQA): query head h
            attends with key/value head h // (Hq // Hkv).
        v: (B, Hkv, S, Ev) or (Hkv, S, Ev); Ev may differ from E. E, Ev <= 256.
        causal: SDPA's top-left mask tril(ones(L, S)): query i sees keys 0..i.
        scale: multiplies q.k; default 1/sqrt(E).
        attn_mask: None, or a mask broadcastable to (B, Hq, L, S) ((Hq, L, S) for 3-D inputs): bool
            (True takes part) or float32 / q's dtype added to the scaled scores, as SDPA's. Read
            through its strides inside the kernels, never expanded in memory; a row with no visible
            key gives zeros (and zero gradients). Not combinable with causal=True (SDPA refuses it too).
        kernel: "auto" (the planner's choice: "decode" for L <= 8, else "forward"), "forward" (the
            FlashAttention-2 prefill kernel), "decode" (the vector kernel for few query rows, keys
            split over threadgroups when long) or "simple" (the one-row-per-SIMD-group reference
            kernel), for tests and benchmarks.
        return_lse: also return the float32 log-sum-exp of each row's scaled scores,
            (B, Hq, L) or (Hq, L): log(sum_j exp(scale * q_i . k_j)), -inf for a row with no key.

    q, k, v must share a dtype (float32, float16, bfloat16) and a device: "mps" runs Metal, "cpu"
    runs the same kernels on the CPU Metal device. Softmax statistics and accumulation are float32.
    Returns a new contiguous (B, Hq, L, Ev) (or (Hq, L, Ev)) tensor of q's dtype, and the
    log-sum-exp when return_lse is set.

    Differentiable with respect to q, k and v through a fused backward that never forms L x S either
    (flashattn_mps._autograd: torch.library ops, so torch.compile traces through it); the
    log-sum-exp carries no gradient and double backward raises.
    """
    if _needs_torch_op(q, k, v):
        _validate(q, k, v, causal, scale, attn_mask)
        _validate_options(kernel, return_lse)
        if kernel != "auto":
            raise ValueError(
                f"flash_attention: kernel={kernel!r} selects a forward kernel for tests and benchmarks of "
                "the forward; differentiable or compiled calls take kernel='auto'"
            )
        out, lse = torch.ops.flashattn_mps.attention_forward(q, k, v, attn_mask, causal, _scale_value(q.shape[-1], scale))
        return (out, lse) if return_lse else out
    args, mask, out, lse = _core_arguments(q, k, v, causal, scale, kernel, return_lse, attn_mask)
    unbatched = q.dim() == 3
    if out.numel() > 0 or (lse is not None and lse.numel() > 0):
        _sources.ensure_registered()
        if q.device.type == "mps":
            _prepare_mps()
        workspace = _workspace(args, mask, q.device)
        _C.forward(*args, None if workspace is None else describe(workspace), mask=_describe_optional(mask))
    if unbatched:
        out = out.squeeze(0)
        lse = None if lse is None else lse.squeeze(0)
    return (out, lse) if return_lse else out


def explain_plan(q, k, v, causal: bool = False, scale: Optional[float] = None, *, attn_mask=None,
                 kernel: str = "auto") -> dict:
    """What `flash_attention(q, k, v, causal, scale, kernel=kernel)` would launch, without running it:
    {"dispatches": [{"source", "function", "macros", "constants", "grid", "threadgroup", "cost"}, ...],
    "split_count", "workspace_bytes", "empty"}. split_count > 1 means the keys are split over
    threadgroups and a second dispatch merges the partial results. "constants" are the function
    constants by index. "cost" turns a timing into utilisation and bandwidth: "threadgroup_bytes"
    per threadgroup, "registers" (32-bit, per thread) the configuration budgets, "flops" the kernel
    issues (padding included) and "useful_flops" (2 (E + Ev) per visible query-key pair), and
    "min_bytes_read" / "min_bytes_written" (each input element once, the outputs); an attn_mask's
    hidden keys count as visible (csrc/fa_plan.c says how each figure is counted)."""
    args, mask, _, _ = _core_arguments(q, k, v, causal, scale, kernel, False, attn_mask)
    return _C.plan_forward(*args, mask=_describe_optional(mask))


def _describe_optional(t: Optional[torch.Tensor]):
    return None if t is None else describe(t)


def _core_arguments(q, k, v, causal, scale, kernel, return_lse, attn_mask=None):
    """Validates a call and returns the C core's arguments for it (device, descriptors of q, k, v,
    out, lse, scale, causal, kernel), the (B, Hq, L, S) mask view (or None; the caller keeps it
    alive while the core reads it) and the new out and lse tensors (batched even for 3-D inputs)."""
    _validate(q, k, v, causal, scale, attn_mask)
    _validate_options(kernel, return_lse)
    mask = None if attn_mask is None else _validate_mask(attn_mask, q, k)
    if q.dim() == 3:  # views, not copies
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        mask = None if mask is None else mask.unsqueeze(0)
    out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device) if return_lse else None
    args = (
        _DEVICE_CODES[q.device.type],
        describe(q),
        describe(k),
        describe(v),
        describe(out),
        None if lse is None else describe(lse),
        _scale_value(q.shape[-1], scale),
        causal,
        _KERNELS[kernel],
    )
    return args, mask, out, lse


def _workspace(args: tuple, mask, device: torch.device) -> Optional[torch.Tensor]:
    """The scratch memory a call needs (split-K partial results), as float32 on its device, or None:
    the C core allocates nothing itself."""
    nbytes = _C.forward_workspace_bytes(*args, mask=_describe_optional(mask))
    return torch.empty((nbytes + 3) // 4, dtype=torch.float32, device=device) if nbytes > 0 else None


def _scale_value(head_dim: int, scale) -> float:
    """SDPA's default 1/sqrt(E); with E == 0 every score is 0 and the core ignores the scale."""
    if scale is not None:
        return float(scale)
    return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 0.0
