"""The public attention function: one C call per attention call on a lean path; messages are built
only when something is wrong.

The hot path checks only what the C core cannot see (Python types, devices, torch's lazy negation,
autograd and tracing), allocates the outputs and hands the tensors themselves to `_C.forward`, which
reads their storage and runs the cached plan (csrc/fa_plan_cache.c). When the core refuses a call,
`_validate` runs to name the problem in Python's terms before the core's message is passed on."""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import _C, _c_legacy, _metal_mode, _sources

_DTYPE_CODES = {
    torch.float32: _C.DTYPE_FLOAT32,
    torch.float16: _C.DTYPE_FLOAT16,
    torch.bfloat16: _C.DTYPE_BFLOAT16,
}
_DESCRIPTOR_DTYPES = {**_DTYPE_CODES, torch.bool: _C.DTYPE_BOOL,  # bool only for masks
                      torch.int32: _C.DTYPE_INT32}  # int32 only for sequence tables (_varlen.py)
_C.set_tensor_dtypes(_DESCRIPTOR_DTYPES)
_DEVICE_CODES = {"cpu": _C.DEVICE_CPU, "mps": _C.DEVICE_MPS}


def _prepare_mps() -> None:
    """Before a Metal call: the stream mode is chosen on first use (flashattn_mps._metal_mode)."""
    _metal_mode.prepare()


_KERNELS = {
    "auto": _C.KERNEL_AUTO,
    "simple": _C.KERNEL_SIMPLE,
    "forward": _C.KERNEL_FORWARD,
    "decode": _C.KERNEL_DECODE,
}


def _cpu_workspace(nbytes: int) -> torch.Tensor:
    return torch.empty((nbytes + 3) // 4, dtype=torch.float32)


def _mps_workspace(nbytes: int) -> torch.Tensor:
    return torch.empty((nbytes + 3) // 4, dtype=torch.float32, device="mps")


# The core asks for scratch memory (split-K partial results) only when a plan needs it: it
# allocates nothing itself.
_WORKSPACES = {_C.DEVICE_CPU: _cpu_workspace, _C.DEVICE_MPS: _mps_workspace}


def describe(t: torch.Tensor) -> tuple:
    """The C core's view of a tensor: (storage, storage bytes, byte offset, dtype, sizes, strides).

    The storage handle is the host address for CPU tensors and the id<MTLBuffer> for MPS tensors
    (PyTorch's MPS allocator hands out the buffer object as the storage's data pointer). `_C`
    reads a torch.Tensor argument the same way itself; descriptors are for calling it by hand."""
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


def _type_name(value) -> str:
    """"str", "numpy.bool", "list": the type as a user would write it."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _given(value) -> str:
    """"numpy.bool True", "str '0.5'", "list []": what a caller passed, for messages."""
    shown = repr(value) if isinstance(value, str) else str(value)
    return f"{_type_name(value)} {shown if len(shown) <= 60 else shown[:57] + '...'}"


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale, attn_mask=None) -> None:
    """Raises the first problem of a call, in Python's terms; returns when it finds none."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flash_attention: {name} must be a torch.Tensor, got {_type_name(t)}")
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
    def shapes():  # only for messages: torch.compile cannot trace str() of symbolic shapes
        return f"q {_shape(q)}, k {_shape(k)}, v {_shape(v)}"

    if q.dim() == 4 and not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"flash_attention: batch sizes differ: {shapes()}")
    if k.shape[-3] != v.shape[-3] or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"flash_attention: k and v must have the same heads and sequence length: {shapes()}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"flash_attention: q and k must have the same head dim: {shapes()}")
    if k.shape[-3] == 0 or q.shape[-3] % k.shape[-3] != 0:
        raise ValueError(
            f"flash_attention: the number of query heads ({q.shape[-3]}) must be a multiple of the number "
            f"of key/value heads ({k.shape[-3]}): {shapes()}"
        )
    for name, t in (("q", q), ("v", v)):
        if t.shape[-1] > _C.MAX_HEAD_DIM:
            raise ValueError(
                f"flash_attention: head dims up to {_C.MAX_HEAD_DIM} are supported, {name} has {t.shape[-1]}: {shapes()}"
            )
    _check_causal_and_scale(causal, scale)
    if attn_mask is not None and causal:
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")


def _check_causal_and_scale(causal, scale) -> float:
    """Raises for a causal that is not a bool or a scale that is not a number; returns the scale as
    a float (None stays None)."""
    if causal is not True and causal is not False:
        raise TypeError(f"flash_attention: causal must be a bool (True or False), got {_given(causal)}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(
            f"flash_attention: scale must be a float or None (an int is taken as a float), got {_given(scale)}"
        )
    return None if scale is None else float(scale)


def _check_window(window_size, who: str) -> tuple:
    """window_size as (left, right) ints, each -1 (unbounded) or >= 0."""
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"{who}: window_size must be a pair of ints (left, right), got {_given(window_size)}")
    left, right = window_size
    if left < -1 or right < -1:
        raise ValueError(f"{who}: window_size sides must be -1 (unbounded) or >= 0, got ({left}, {right})")
    return int(left), int(right)


def _validate_alibi(slopes, q: torch.Tensor) -> torch.Tensor:
    """ALiBi slopes of flash_attention's q (B, Hq, L, E) or (Hq, L, E), as _alibi_view gives them."""
    batch, heads = (q.shape[0], q.shape[1]) if q.dim() == 4 else (1, q.shape[0])
    return _alibi_view(slopes, batch, heads, q.device, "flash_attention")


def _alibi_view(slopes, batch: int, heads: int, device, who: str):
    """ALiBi slopes (None, or float32 (Hq,) or (B, Hq) on `device`) as the (B, Hq) view the core
    reads (a batch stride of 0 for (Hq,) slopes), or None."""
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor):
        raise TypeError(f"{who}: alibi_slopes must be a torch.Tensor or None, got {_type_name(slopes)}")
    if slopes.dtype != torch.float32 or slopes.device != device:
        raise TypeError(
            f"{who}: alibi_slopes must be float32 on q's device ({device}), got {slopes.dtype} on {slopes.device}"
        )
    if slopes.shape not in ((heads,), (batch, heads)):
        raise ValueError(
            f"{who}: alibi_slopes must be (Hq,) = ({heads},) or (B, Hq) = ({batch}, {heads}), got "
            f"{tuple(slopes.shape)}"
        )
    slopes = slopes.detach()
    return (slopes.resolve_neg() if slopes.is_neg() else slopes).expand(batch, heads)


def _check_bool(value, name: str, who: str) -> bool:
    if value is not True and value is not False:
        raise TypeError(f"{who}: {name} must be a bool, got {_given(value)}")
    return value


def _validate_sinks(sinks, q: torch.Tensor, who: str = "flash_attention") -> torch.Tensor:
    """Attention sinks as the (Hq,) float32 tensor the core reads: float32 as given, or q's dtype
    converted to float32 (a copy of Hq numbers, differentiable, so gradients reach the given tensor).
    q is seen with heads third from last, as (..., Hq, L, E)."""
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"{who}: sinks must be a torch.Tensor or None, got {_type_name(sinks)}")
    if sinks.dtype not in (torch.float32, q.dtype) or sinks.device != q.device:
        raise TypeError(
            f"{who}: sinks must be float32 or q's dtype ({q.dtype}) on q's device ({q.device}), got "
            f"{sinks.dtype} on {sinks.device}"
        )
    heads = q.shape[-3]
    if sinks.shape != (heads,):
        raise ValueError(
            f"{who}: sinks must be (Hq,) = ({heads},), one logit per query head, got {tuple(sinks.shape)} "
            f"for q {_shape(q)}"
        )
    sinks = sinks.float()
    return sinks.resolve_neg() if sinks.is_neg() else sinks


def _sinks_need_grad(sinks) -> bool:
    """Sinks that want a gradient take the autograd path even when q, k and v do not."""
    return isinstance(sinks, torch.Tensor) and sinks.requires_grad and _is_grad_enabled()


def _check_softcap(softcap, who: str) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"{who}: softcap must be a float, got {_given(softcap)}")
    if not (0.0 <= softcap < math.inf):
        raise ValueError(f"{who}: softcap must be 0.0 (none) or positive and finite, got {softcap}")
    return float(softcap)


def _check_dropout(dropout_p, who: str) -> float:
    """dropout_p as a float in [0, 1]."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"{who}: dropout_p must be a float, got {_given(dropout_p)}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{who}: dropout_p must be in [0, 1], got {dropout_p}")
    return float(dropout_p)


def dropout_rng_state(device: torch.device) -> torch.Tensor:
    """Dropout's generator state for one call: four random int32 words (Philox seed and counter
    offset, metal/fa_dropout.h) drawn from torch's default generator of `device` (the MPS one on
    "mps", the CPU one on "cpu"), so torch.manual_seed makes calls reproducible and consecutive calls
    drop differently. Drawn on the device, so no host synchronisation is needed to use them; the
    backward takes the same tensor and regenerates the forward's mask."""
    return torch.randint(-(2**31), 2**31, (4,), dtype=torch.int32, device=device)


def _rng_words(rng_state):
    """The core's view of a generator state: the int32 words as a float32 descriptor (bits unchanged)."""
    return None if rng_state is None else rng_state.view(torch.float32)


def _band_of(causal, window_size, window_align=None):
    """flash_attention's causal (False, True, "bottom_right"), window_size and window_align (None,
    "top_left", "bottom_right") as the core's causal flag and band: None (SDPA's top-left causal, no
    window) or (bottom_right, left, right)."""
    bottom_right = isinstance(causal, str) and causal == "bottom_right"
    if isinstance(causal, str) and not bottom_right:
        raise ValueError(f"flash_attention: causal must be True, False or 'bottom_right', got {_given(causal)}")
    if window_align is not None:
        if window_align not in ("top_left", "bottom_right"):
            raise ValueError(
                f"flash_attention: window_align must be None, 'top_left' or 'bottom_right', got {_given(window_align)}"
            )
        if causal is not False and (window_align == "bottom_right") != bottom_right:
            raise ValueError(
                f"flash_attention: window_align={window_align!r} contradicts causal={causal!r}, which anchors the "
                "window itself (True: top-left, 'bottom_right': bottom-right); window_align is for causal=False"
            )
        bottom_right = window_align == "bottom_right"
    left, right = (-1, -1) if window_size is None else _check_window(window_size, "flash_attention")
    if window_size is None and not bottom_right:
        return causal, None
    return (causal is not False), (int(bottom_right), left, right)


def supported_mask_dtype(mask_dtype: torch.dtype, query_dtype: torch.dtype) -> bool:
    """SDPA's rule: bool, float32, or the query's dtype."""
    return mask_dtype in (torch.bool, torch.float32, query_dtype)


def _validate_mask(attn_mask, q: torch.Tensor, k: torch.Tensor):
    """The mask as a (B, Hq, L, S) view (broadcast dims get stride 0; nothing is expanded in memory)."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"flash_attention: attn_mask must be a torch.Tensor or None, got {_type_name(attn_mask)}")
    if attn_mask.device != q.device:
        raise ValueError(f"flash_attention: attn_mask is on {attn_mask.device}, q on {q.device}")
    if not supported_mask_dtype(attn_mask.dtype, q.dtype):
        raise TypeError(
            f"flash_attention: attn_mask has dtype {attn_mask.dtype}; masks are bool (True takes part), "
            f"float32 or the query's dtype ({q.dtype}), added to the scaled scores"
        )
    if attn_mask.requires_grad and torch.is_grad_enabled():
        raise ValueError("flash_attention: attn_mask requires grad, but masks are not differentiated")
    target = (*q.shape[:-1], k.shape[-2])
    if attn_mask.shape == target:
        return attn_mask.resolve_neg() if attn_mask.is_neg() else attn_mask
    try:
        view = attn_mask.expand(target)
    except RuntimeError:
        raise ValueError(
            f"flash_attention: attn_mask {tuple(attn_mask.shape)} does not broadcast to (B, Hq, L, S) = {target}"
        ) from None
    return view.resolve_neg() if view.is_neg() else view


def _check_options(kernel, return_lse) -> int:
    """The kernel's code; raises for an unknown kernel or a return_lse that is not a bool."""
    if return_lse is not True and return_lse is not False:
        raise TypeError(f"flash_attention: return_lse must be a bool (True or False), got {_given(return_lse)}")
    if not isinstance(kernel, str):
        raise TypeError(f"flash_attention: kernel must be one of {sorted(_KERNELS)}, got {_given(kernel)}")
    if kernel not in _KERNELS:
        raise ValueError(f"flash_attention: kernel must be one of {sorted(_KERNELS)}, got {_given(kernel)}")
    return _KERNELS[kernel]


# flashattn_mps._autograd.attention_through_torch, set when that module (which imports this one) loads.
_attention_through_torch = None


# Bound once: the hot path pays no attribute lookups for them (dynamo knows them by identity).
_is_compiling = torch.compiler.is_compiling
_is_grad_enabled = torch.is_grad_enabled
_is_jit_tracing = torch.jit.is_tracing
_dispatch_modes = torch._C._len_torch_dispatch_stack
_CONTIGUOUS = torch.contiguous_format


def _routes_through_torch(q, k, v) -> bool:
    """Autograd (some input requires grad) and tracing (torch.compile, export, make_fx, fake
    tensors: any torch dispatch mode; torch.jit.trace, which records only dispatched ops) leave the
    direct path: see attend."""
    if _is_compiling() or _is_jit_tracing():
        return True
    return (_is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)) or _dispatch_modes() > 0


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal=False,
    scale: Optional[float] = None,
    *,
    attn_mask: Optional[torch.Tensor] = None,
    kernel: str = "auto",
    return_lse: bool = False,
    window_size=None,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    window_align: Optional[str] = None,
):
    """Scaled dot-product attention, exactly as
    `torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
    enable_gqa=True)`, without materialising the L x S score matrix.

    Args:
        q: (B, Hq, L, E) or (Hq, L, E); any strides and storage offset (nothing is copied).
        k: (B, Hkv, S, E) or (Hkv, S, E); Hq must be a multiple of Hkv (GQA/MQA): query head h
            attends with key/value head h // (Hq // Hkv).
        v: (B, Hkv, S, Ev) or (Hkv, S, Ev); Ev may differ from E. E, Ev <= 576.
        causal: True: SDPA's top-left mask tril(ones(L, S)), query i sees keys 0..i;
            "bottom_right": flash-attn's, query i sees keys 0..i + S - L (rows that see none give
            zeros). The diagonal d_i (i, or i + S - L) also anchors window_size.
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
        window_size: None, or (left, right): query i sees only keys d_i - left .. d_i + right (-1:
            unbounded on that side; with causal the right side is 0), as flash-attn's sliding
            window; combinable with attn_mask. Key tiles wholly outside are never visited, so the
            cost grows with the window, not with S.
        window_align: None (the window follows causal's diagonal: top-left, or bottom-right with
            causal="bottom_right"), or with causal=False "top_left" or "bottom_right": which
            diagonal d_i the window (and ALiBi) is anchored on without a causal mask, e.g.
            bottom-right for a bidirectional window over a KV cache (flash_attn_func's
            causal=False windows are bottom-right).
        softcap: 0.0, or a positive number: each scaled score s becomes softcap * tanh(s / softcap)
            before masks (Gemma 2's logit softcapping); the backward differentiates through tanh.
        alibi_slopes: None, or float32 (Hq,) or (B, Hq) slopes on q's device: adds
            -slope * |d_i - j| to the score of query i and key j (ALiBi; d_i the diagonal as for
            window_size), after softcap. The slopes get no gradient (as in flash-attn).
        dropout_p: 0.0, or the probability in (0, 1] of dropping each attention probability, as
            SDPA's dropout_p (applied whenever it is > 0; modules pass 0 in eval): kept probabilities
            are scaled by 1 / (1 - dropout_p), the log-sum-exp is that of the undropped ones. The
            kernels drop with a counter-based generator (Philox 4x32-10) seeded per call from
            torch's default generator of q's device (`torch.manual_seed` makes calls reproducible),
            and the backward regenerates the same mask instead of storing it.
        sinks: None, or (Hq,) attention-sink logits (GPT-OSS, StreamingLLM), float32 or q's dtype
            (converted to float32), on q's device: row i of head h also counts exp(sinks[h]) in its
            softmax denominator, with no value, so its weights sum to less than 1. Combinable with
            every other option. A row that sees no key gives zeros; the log-sum-exp includes the
            sink (sinks[h] for such a row). Gradients flow to sinks too.

    q, k, v must share a dtype (float32, float16, bfloat16) and a device: "mps" runs Metal, "cpu"
    runs the same kernels on the CPU Metal device. Softmax statistics and accumulation are float32.
    Returns a new contiguous (B, Hq, L, Ev) (or (Hq, L, Ev)) tensor of q's dtype, and the
    log-sum-exp when return_lse is set. A lazily negated input (torch's negative bit, as in
    `z.conj().imag`) is resolved first, as torch's own kernels do: that copy is the only one.

    Differentiable with respect to q, k and v through a fused backward that never forms L x S either:
    eagerly through a torch.autograd.Function, and under torch.compile, export or tracing through
    the torch.library ops of flashattn_mps._autograd; the log-sum-exp carries no gradient and
    double backward raises.
    """
    if type(kernel) is str and kernel == "auto" and return_lse is False and window_size is None \
            and (causal is True or causal is False) and softcap == 0.0 and alibi_slopes is None and dropout_p == 0.0 \
            and sinks is None and window_align is None:
        return attend(q, k, v, attn_mask, causal, scale)
    causal, band = _band_of(causal, window_size, window_align)
    return attend(q, k, v, attn_mask, causal, scale, _check_options(kernel, return_lse), return_lse, band, False,
                  _check_softcap(softcap, "flash_attention"), alibi_slopes,
                  _check_dropout(dropout_p, "flash_attention"), None, sinks)


def attend(q, k, v, attn_mask=None, causal=False, scale=None, kernel: int = _C.KERNEL_AUTO, return_lse=False,
           band=None, seq_major=False, softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None, sinks=None):
    """flash_attention with its options already checked (kernel a _C.KERNEL_* code, return_lse a
    bool, band None or (bottom_right, left, right) ints as _band_of gives): the lean entry the SDPA
    drop-in and flash_attn_func call. causal and scale are checked here (cheaply when they are a
    bool and a float or None). seq_major: q is a (B, L, H, E) tensor viewed as (B, H, L, E), and
    out is allocated the same way (flash_attn_func's layout); the flash-attn API it serves has its
    log-sum-exp convention too (_flash_attn_lse). softcap: a checked float; alibi_slopes: None or
    the user's (H,) or (B, H) tensor, sinks None or the user's (H,) one (both checked here);
    dropout_p: a checked float, with rng_state the call's generator state (drawn here when None and
    dropout_p > 0)."""
    if (causal is not True and causal is not False) or not (scale is None or type(scale) is float):
        scale = _check_causal_and_scale(causal, scale)
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        _validate(q, k, v, causal, scale, attn_mask)
    if attn_mask is not None and causal:
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")
    if dropout_p > 0.0 and rng_state is None:
        rng_state = dropout_rng_state(q.device)  # outside the ops, so their fake implementations need none
    if _routes_through_torch(q, k, v) or (sinks is not None and _sinks_need_grad(sinks)):
        if kernel != _C.KERNEL_AUTO:
            names = {code: name for name, code in _KERNELS.items()}
            raise ValueError(
                f"flash_attention: kernel={names.get(kernel, kernel)!r} selects a forward kernel for tests and "
                "benchmarks of the forward; differentiable or compiled calls take kernel='auto'"
            )
        result = _attention_through_torch(q, k, v, attn_mask, causal, scale, return_lse, band, seq_major, softcap,
                                          alibi_slopes, dropout_p, rng_state, sinks)
        return (result[0], _flash_attn_lse(result[1])) if return_lse and seq_major else result
    mask = None if attn_mask is None else _validate_mask(attn_mask, q, k)
    alibi = None if alibi_slopes is None else _validate_alibi(alibi_slopes, q)
    sinks = None if sinks is None else _validate_sinks(sinks, q)
    out, lse = forward_core(q, k, v, mask, causal, scale, kernel, return_lse, band, seq_major, softcap, alibi,
                            dropout_p, rng_state, sinks)
    if not return_lse:
        return out
    return out, (_flash_attn_lse(lse) if seq_major else lse)


def _flash_attn_lse(lse: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp as flash-attn's API returns it: +inf for a row whose softmax sum is 0 (no
    visible key) or NaN, where the kernels (and SDPA's convention, kept by flash_attention and by
    the backward, which reads the kernels' own lse) have -inf and NaN. flash-attn's forward kernels
    write INFINITY there (csrc/flash_attn/src/softmax.h, normalize_softmax_lse)."""
    return lse.masked_fill(lse.isnan() | (lse == -math.inf), math.inf)


def forward_core(q, k, v, mask, causal: bool, scale, kernel: int, with_lse: bool, band=None, seq_major=False,
                 softcap=0.0, alibi=None, dropout_p=0.0, rng_state=None, sinks=None):
    """Runs the forward on tensors whose options are checked and whose mask (or None) is the
    (B, Hq, L, S) view: returns out and lse (None unless with_lse). Every path ends here."""
    if q.is_cpu:  # _C checks that every tensor is on this device
        device = _C.DEVICE_CPU
    elif q.is_mps:
        device = _C.DEVICE_MPS
        _prepare_mps()
    else:
        _validate(q, k, v, causal, scale, mask)
        raise ValueError(f"flash_attention: q is on device '{q.device}'")  # _validate raises first
    dims = q.dim()
    if not (q.dtype in _DTYPE_CODES and (dims == 4 or dims == 3) and k.dim() == dims and v.dim() == dims):
        _validate(q, k, v, causal, scale, mask)
    if q.is_neg() or k.is_neg() or v.is_neg():
        q, k, v = q.resolve_neg(), k.resolve_neg(), v.resolve_neg()
    shape = q.shape
    if scale is None:
        scale = _scale_value(shape[-1], None)
    rows = (shape[0], shape[1], shape[2]) if dims == 4 else (shape[0], shape[1])
    value_dim = v.shape[-1]
    if seq_major:  # (B, L, H, Ev) in memory, seen as (B, H, L, Ev)
        out = q.new_empty((shape[0], shape[2], shape[1], value_dim)).transpose(1, 2)
    elif value_dim == shape[-1]:
        out = torch.empty_like(q, memory_format=_CONTIGUOUS)
    else:
        out = q.new_empty((*rows, value_dim))
    lse = q.new_empty(rows, dtype=torch.float32) if with_lse else None
    if not _sources.registered:
        _sources.ensure_registered()
    try:
        _c_legacy.forward(device, q, k, v, out, lse, scale, causal, kernel, _WORKSPACES[device], mask, dims == 3, band, softcap,
                   alibi, dropout_p, _rng_words(rng_state), False, sinks)
    except (TypeError, ValueError):
        _validate(q, k, v, causal, scale, mask)  # names the problem in Python's terms if it can
        raise
    return out, lse


def backward_core(dout, q, k, v, out, lse, mask, causal: bool, scale: float, band=None, softcap=0.0, alibi=None,
                  dropout_p=0.0, rng_state=None, sinks=None):
    """dq, dk, dv of forward_core's call (mask as the (B, Hq, L, S) view or None; dropout_p and
    rng_state the forward's, so the same probabilities are dropped), and after them dsinks, the
    (Hq,) float32 gradient of the sinks, when sinks (float32 (Hq,)) is given."""
    device = _C.DEVICE_CPU if q.is_cpu else _C.DEVICE_MPS  # _C checks every tensor's device
    if device == _C.DEVICE_MPS:
        _prepare_mps()
    if dout.is_neg():
        dout = dout.resolve_neg()
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    delta = q.new_empty(q.shape[:-1], dtype=torch.float32)  # D = rowsum(dout * out): the core's scratch
    if not _sources.registered:
        _sources.ensure_registered()
    # Each row's term of the sinks' gradient (B, Hq, L), summed here over batch and rows, deterministically.
    sink_grad = None if sinks is None else q.new_empty(q.shape[:-1], dtype=torch.float32)
    _c_legacy.backward(device, q, k, v, out, lse, dout, delta, dq, dk, dv, scale, causal, mask, q.dim() == 3, band, softcap,
                alibi, dropout_p, _rng_words(rng_state), sinks, sink_grad)
    if sinks is None:
        return dq, dk, dv
    return dq, dk, dv, sink_grad.sum(dim=-1).reshape(-1, sink_grad.shape[-2]).sum(dim=0)


def probs_arguments(q, k, v, out, lse, mask, causal: bool, scale: float, band=None, softcap=0.0, alibi=None,
                    dropout_p=0.0, rng_state=None, sequences=None):
    """The probability pass's arguments, as _C.forward and _C.plan_forward take them, and the shape
    of the probabilities it writes: (B, Hq, L, S), or with sequences (_varlen.sequence_args) the
    grid's (sequences, Hq, max_seqlen_q, max_seqlen_k), each sequence in its top-left block."""
    device = _C.DEVICE_CPU if q.is_cpu else _C.DEVICE_MPS
    if rng_state is None:  # no dropout: every probability is kept whatever the words
        rng_state = torch.zeros(4, dtype=torch.int32, device=q.device)
    shape = (*q.shape[:-1], k.shape[-2]) if sequences is None else \
        (sequences[0].shape[0], q.shape[-3], sequences[2], sequences[3])
    args = (device, q, k, v, out, lse, scale, causal, _C.KERNEL_SIMPLE)
    options = dict(mask=mask, band=band, softcap=softcap, alibi_slopes=alibi, dropout_p=dropout_p,
                   rng_state=_rng_words(rng_state), write_probs=True, sequences=sequences)
    return args, options, shape


def probs_pass_runs(lse: torch.Tensor) -> bool:
    """Whether there is a probability pass to run: an empty lse (no query rows) has no storage for
    the core to read, and every probability is 0."""
    return lse.numel() > 0


def probs_core(q, k, v, out, lse, mask, causal: bool, scale: float, band=None, softcap=0.0, alibi=None,
               dropout_p=0.0, rng_state=None, sequences=None) -> torch.Tensor:
    """The attention probabilities of forward_core's call that returned out and lse, as flash-attn's
    return_attn_probs shows them: (B, Hq, L, S) float32, exp(s_ij - lse_i) for every key row i sees,
    negated where dropout dropped it (0 elsewhere). The simple kernel's probability pass computes
    them from the same scores and generator as the attention kernels (csrc/fa_core.h, write_probs);
    an L x S array, for tests. sequences: a varlen call's, with its (1, Hq, total, D) views (the
    layout probs_arguments says)."""
    args, options, shape = probs_arguments(q, k, v, out, lse, mask, causal, scale, band, softcap, alibi, dropout_p,
                                           rng_state, sequences)
    if args[0] == _C.DEVICE_MPS:
        _prepare_mps()
    probs = torch.zeros(shape, dtype=torch.float32, device=q.device)
    if not probs_pass_runs(lse):
        return probs
    if not _sources.registered:
        _sources.ensure_registered()
    _c_legacy.forward(*args, workspace=probs.view(-1), unbatched=q.dim() == 3, **options)
    return probs


def explained(plan: dict, device: torch.device) -> dict:
    """A plan as the explain functions return it: with "metal_stream" (how dispatches reach the GPU)
    for MPS tensors."""
    if device.type == "mps":
        plan["metal_stream"] = _metal_mode.describe()
    return plan


def explain_plan(q, k, v, causal=False, scale: Optional[float] = None, *, attn_mask=None,
                 kernel: str = "auto", window_size=None, softcap: float = 0.0, alibi_slopes=None,
                 dropout_p: float = 0.0, sinks=None, window_align=None, backward: bool = False) -> dict:
    """What `flash_attention(q, k, v, causal, scale, kernel=kernel, window_size=window_size, ...)`
    would launch, without running it:
    {"dispatches": [{"source", "function", "macros", "constants", "grid", "threadgroup", "cost"}, ...],
    "split_count", "workspace_bytes", "empty"} (and "metal_stream" for MPS tensors: how dispatches
    reach the GPU). split_count > 1 means the keys are split over threadgroups and a second dispatch
    merges the partial results. "constants" are the function constants by index. "cost" turns a
    timing into utilisation and bandwidth: "threadgroup_bytes" per threadgroup, "registers" (32-bit,
    per thread) the configuration budgets, "flops" the kernel issues (padding included), "tiles"
    (the key tiles the forward kernel's threadgroups visit; the scores the simple and decode
    kernels compute: under causal or a window only those the band reaches) and
    "useful_flops" (2 (E + Ev) per visible query-key pair), and "min_bytes_read" /
    "min_bytes_written" (each input element once, the outputs); an attn_mask's hidden keys count as
    visible (csrc/fa_plan.c says how each figure is counted).

    backward=True: the plan of the gradients' pass instead, {"dispatches": [delta, dkdv, dq]}: the
    pre-pass D = rowsum(dO * O), dK/dV over key blocks ("tiles": the query tiles its threadgroups
    visit, over every query head of a GQA group) and dQ over query blocks ("tiles": the key tiles,
    as the forward's), with the same cost figures (csrc/fa_backward_plan.c counts them).

    Calls of flash_attn_varlen_func and flash_attn_with_kvcache are explained by
    explain_varlen_plan and explain_kvcache_plan, which take those functions' arguments."""
    causal, band = _band_of(causal, window_size, window_align)
    _validate(q, k, v, causal, scale, attn_mask)
    code = _check_options(kernel, False)
    mask = None if attn_mask is None else _validate_mask(attn_mask, q, k)
    if q.dim() == 3:  # views, not copies
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        mask = None if mask is None else mask.unsqueeze(0)
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    device, scale = _DEVICE_CODES[q.device.type], _scale_value(q.shape[-1], scale)
    options = dict(mask=mask, band=band, softcap=_check_softcap(softcap, "explain_plan"),
                   alibi_slopes=None if alibi_slopes is None else _validate_alibi(alibi_slopes, q),
                   dropout_p=_check_dropout(dropout_p, "explain_plan"),
                   rng_state=_rng_words(torch.zeros(4, dtype=torch.int32, device=q.device)),
                   sinks=None if sinks is None else _validate_sinks(sinks, q))
    if backward is True:  # planning reads no element: the tensors only carry shapes and strides
        rows = q.new_empty(q.shape[:-1], dtype=torch.float32)
        sink_grad = None if sinks is None else rows
        return {"dispatches": _c_legacy.plan_backward(device, q, k, v, out, rows, out, rows.clone(), torch.empty_like(q),
                                               torch.empty_like(k), torch.empty_like(v), scale, causal,
                                               sink_grad=sink_grad, **options)}
    if backward is not False:
        raise TypeError(f"explain_plan: backward must be a bool, got {_given(backward)}")
    return explained(_c_legacy.plan_forward(device, q, k, v, out, None, scale, causal, code, **options), q.device)


def _scale_value(head_dim: int, scale) -> float:
    """SDPA's default 1/sqrt(E); with E == 0 every score is 0 and the core ignores the scale."""
    if scale is not None:
        return float(scale)
    return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 0.0
