"""A call's options as one checked value, and the argument checks that build it.

Every entry point (flash_attention, the SDPA drop-in, flash_attn_func, flash_attn_varlen_func,
flash_attn_with_kvcache and the explain functions) checks its arguments with these helpers, so a
wrong argument gets the same message whichever function it was given to (`who` names the
function). `AttentionOptions` holds the result; `AttentionOptions.core` turns it into the C
binding's options tuple (flashattn_mps._core)."""

from __future__ import annotations

import math
import numbers
import operator
from typing import NamedTuple, Optional

import torch

from . import _C

_DTYPE_CODES = {
    torch.float32: _C.DTYPE_FLOAT32,
    torch.float16: _C.DTYPE_FLOAT16,
    torch.bfloat16: _C.DTYPE_BFLOAT16,
}


_DESCRIPTOR_DTYPES = {
    **_DTYPE_CODES,
    torch.bool: _C.DTYPE_BOOL,  # bool only for masks
    torch.int32: _C.DTYPE_INT32,
    torch.uint8: _C.DTYPE_UINT8,
}  # int32 only for sequence tables (_varlen.py), uint8 only for quantized K/V (_quantized.py)
_C.set_tensor_dtypes(_DESCRIPTOR_DTYPES)


_DEVICE_CODES = {"cpu": _C.DEVICE_CPU, "mps": _C.DEVICE_MPS}


_KERNELS = {
    "auto": _C.KERNEL_AUTO,
    "simple": _C.KERNEL_SIMPLE,
    "forward": _C.KERNEL_FORWARD,
    "decode": _C.KERNEL_DECODE,
    "tensor": _C.KERNEL_TENSOR,
}


def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def type_name(value) -> str:
    """ "str", "numpy.bool", "list": the type as a user would write it."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def given(value) -> str:
    """ "numpy.bool True", "str '0.5'", "list []": what a caller passed, for messages."""
    shown = repr(value) if isinstance(value, str) else str(value)
    return f"{type_name(value)} {shown if len(shown) <= 60 else shown[:57] + '...'}"


class FlashAttnInputError(ValueError, RuntimeError):
    """A wrong argument value (shape, length, range) where flash-attn itself raises RuntimeError:
    both a ValueError (this package's convention) and a RuntimeError (what code written for
    flash-attn catches)."""


class FlashAttnTypeError(TypeError, RuntimeError):
    """A tensor of the wrong dtype or device where flash-attn itself raises RuntimeError: a
    TypeError (this package's convention) and a RuntimeError."""


def check_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale, attn_mask=None) -> None:
    """Raises the first problem of a call, in Python's terms; returns when it finds none."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flash_attention: {name} must be a torch.Tensor, got {type_name(t)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type not in _DEVICE_CODES:
            raise FlashAttnInputError(
                f"flash_attention: {name} is on device '{t.device}'; supported devices are mps (Metal) "
                "and cpu (the CPU Metal device)"
            )
    if not (q.device == k.device == v.device):
        raise FlashAttnInputError(
            f"flash_attention: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _DTYPE_CODES:
            raise FlashAttnTypeError(
                f"flash_attention: {name} has dtype {t.dtype}; supported are float32, float16 and bfloat16"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise FlashAttnTypeError(f"flash_attention: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dim() not in (3, 4) or k.dim() != q.dim() or v.dim() != q.dim():
        raise FlashAttnInputError(
            "flash_attention: q, k, v must all be 4-D (B, H, L, E) or all 3-D (H, L, E), got "
            f"q {_shape(q)}, k {_shape(k)}, v {_shape(v)}"
        )

    def shapes():  # only for messages: torch.compile cannot trace str() of symbolic shapes
        return f"q {_shape(q)}, k {_shape(k)}, v {_shape(v)}"

    if q.dim() == 4 and not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise FlashAttnInputError(f"flash_attention: batch sizes differ: {shapes()}")
    if k.shape[-3] != v.shape[-3] or k.shape[-2] != v.shape[-2]:
        raise FlashAttnInputError(f"flash_attention: k and v must have the same heads and sequence length: {shapes()}")
    if q.shape[-1] != k.shape[-1]:
        raise FlashAttnInputError(f"flash_attention: q and k must have the same head dim: {shapes()}")
    if (q.shape[-3] % k.shape[-3] if k.shape[-3] else q.shape[-3]) != 0:  # no heads at all: an empty call
        raise FlashAttnInputError(
            f"flash_attention: the number of query heads ({q.shape[-3]}) must be a multiple of the number "
            f"of key/value heads ({k.shape[-3]}): {shapes()}"
        )
    for name, t in (("q", q), ("v", v)):
        if t.shape[-1] > _C.MAX_HEAD_DIM:
            raise FlashAttnInputError(
                f"flash_attention: head dims up to {_C.MAX_HEAD_DIM} are supported, {name} has {t.shape[-1]}: "
                f"{shapes()}"
            )
    check_causal_and_scale(causal, scale)
    if attn_mask is not None and causal:
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")


def check_causal_and_scale(causal, scale) -> float:
    """Raises for a causal that is not a bool or a scale that is not a number; returns the scale as
    a float (None stays None)."""
    if causal is not True and causal is not False:
        raise TypeError(f"flash_attention: causal must be a bool (True or False), got {given(causal)}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(
            f"flash_attention: scale must be a float or None (an int is taken as a float), got {given(scale)}"
        )
    return None if scale is None else float(scale)


def _numbers(values, name: str, who: str, integral: bool) -> list:
    """Python numbers for `values`, each an int (a float too unless integral), a numpy scalar or a
    0-d torch.Tensor (what flash-attn's bindings accept, through __index__ / __float__). The
    tensors among them are read in one host read."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    for v in tensors:
        if v.dim() != 0 or v.dtype == torch.bool or v.is_complex() or (integral and v.is_floating_point()):
            kind = "an int" if integral else "a number"
            raise TypeError(f"{who}: {name} must be {kind} or a 0-d tensor of one, got {given(v)}")
    if tensors:
        dtype, device = tensors[0].dtype, tensors[0].device
        for t in tensors[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
        read = iter(torch.stack([t.detach().to(device, dtype) for t in tensors]).tolist())
    result = []
    for v in values:
        if isinstance(v, torch.Tensor):
            result.append(next(read))
        elif isinstance(v, numbers.Integral) and not isinstance(v, bool):
            result.append(operator.index(v))
        elif not integral and isinstance(v, numbers.Real) and not isinstance(v, bool):
            result.append(float(v))
        else:
            kind = "an int" if integral else "a number"
            raise TypeError(f"{who}: {name} must be {kind} or a 0-d tensor of one, got {given(v)}")
    return result


def check_number(value, name: str, who: str, integral: bool = False):
    """An int (or, unless integral, a float) given as a Python or numpy number or a 0-d tensor."""
    return _numbers([value], name, who, integral)[0]


def check_window(window_size, who: str) -> tuple:
    """window_size as (left, right) ints, each -1 (unbounded) or >= 0. Given as a pair of ints or
    0-d tensors, or a tensor of 2 ints (flash-attn's own tests draw it with torch.randint); the
    tensors are read in one host read."""
    if isinstance(window_size, torch.Tensor) and window_size.dim() == 1 and window_size.shape[0] == 2:
        window_size = window_size.unbind()
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2):
        raise TypeError(
            f"{who}: window_size must be a pair of ints (left, right) or a tensor of 2 ints, got {given(window_size)}"
        )
    left, right = _numbers(window_size, "window_size", who, integral=True)
    if left < -1 or right < -1:
        raise FlashAttnInputError(f"{who}: window_size sides must be -1 (unbounded) or >= 0, got ({left}, {right})")
    return int(left), int(right)


def check_alibi(slopes, q: torch.Tensor) -> torch.Tensor:
    """ALiBi slopes of flash_attention's q (B, Hq, L, E) or (Hq, L, E), as alibi_view gives them."""
    batch, heads = (q.shape[0], q.shape[1]) if q.dim() == 4 else (1, q.shape[0])
    return alibi_view(slopes, batch, heads, q.device, "flash_attention")


def alibi_view(slopes, batch: int, heads: int, device, who: str):
    """ALiBi slopes (None, or float32 (Hq,) or (B, Hq) on `device`) as the (B, Hq) view the core
    reads (a batch stride of 0 for (Hq,) slopes), or None."""
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor):
        raise TypeError(f"{who}: alibi_slopes must be a torch.Tensor or None, got {type_name(slopes)}")
    if slopes.dtype != torch.float32 or slopes.device != device:
        raise FlashAttnTypeError(
            f"{who}: alibi_slopes must be float32 on q's device ({device}), got {slopes.dtype} on {slopes.device}"
        )
    if slopes.shape not in ((heads,), (batch, heads)):
        raise FlashAttnInputError(
            f"{who}: alibi_slopes must be (Hq,) = ({heads},) or (B, Hq) = ({batch}, {heads}), got {tuple(slopes.shape)}"
        )
    slopes = slopes.detach()
    return _resolved(slopes).expand(batch, heads)


def _resolved(t: torch.Tensor) -> torch.Tensor:
    """t with torch's lazy negation resolved (a copy only when t is negated). torch.compile cannot
    trace the test, so traced calls leave it to the ops, which run these checks again."""
    return t if _is_compiling() or not t.is_neg() else t.resolve_neg()


_is_compiling = torch.compiler.is_compiling


def check_bool(value, name: str, who: str) -> bool:
    if value is not True and value is not False:
        raise TypeError(f"{who}: {name} must be a bool, got {given(value)}")
    return value


def check_sinks(sinks, q: torch.Tensor, who: str = "flash_attention") -> torch.Tensor:
    """Attention sinks as the (Hq,) float32 tensor the core reads: float32 as given, or q's dtype
    converted to float32 (a copy of Hq numbers, differentiable, so gradients reach the given tensor).
    q is seen with heads third from last, as (..., Hq, L, E)."""
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"{who}: sinks must be a torch.Tensor or None, got {type_name(sinks)}")
    if sinks.dtype not in (torch.float32, q.dtype) or sinks.device != q.device:
        raise FlashAttnTypeError(
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
    return _resolved(sinks)


def check_softcap(softcap, who: str) -> float:
    if type(softcap) is not float:
        softcap = check_number(softcap, "softcap", who)
    if not (0.0 <= softcap < math.inf):
        raise FlashAttnInputError(f"{who}: softcap must be 0.0 (none) or positive and finite, got {softcap}")
    return float(softcap)


def check_dropout(dropout_p, who: str) -> float:
    """dropout_p as a float in [0, 1]."""
    if type(dropout_p) is not float:
        dropout_p = check_number(dropout_p, "dropout_p", who)
    if not 0.0 <= dropout_p <= 1.0:
        raise FlashAttnInputError(f"{who}: dropout_p must be in [0, 1], got {dropout_p}")
    return float(dropout_p)


def band_of(causal, window_size, window_align=None):
    """flash_attention's causal (False, True, "bottom_right"), window_size and window_align (None,
    "top_left", "bottom_right") as the core's causal flag and band: None (SDPA's top-left causal, no
    window) or (bottom_right, left, right)."""
    bottom_right = isinstance(causal, str) and causal == "bottom_right"
    if isinstance(causal, str) and not bottom_right:
        raise ValueError(f"flash_attention: causal must be True, False or 'bottom_right', got {given(causal)}")
    if window_align is not None:
        if window_align not in ("top_left", "bottom_right"):
            raise ValueError(
                f"flash_attention: window_align must be None, 'top_left' or 'bottom_right', got {given(window_align)}"
            )
        if causal is not False and (window_align == "bottom_right") != bottom_right:
            raise ValueError(
                f"flash_attention: window_align={window_align!r} contradicts causal={causal!r}, which anchors the "
                "window itself (True: top-left, 'bottom_right': bottom-right); window_align is for causal=False"
            )
        bottom_right = window_align == "bottom_right"
    left, right = (-1, -1) if window_size is None else check_window(window_size, "flash_attention")
    if window_size is None and not bottom_right:
        return causal, None
    return (causal is not False), (int(bottom_right), left, right)


def supported_mask_dtype(mask_dtype: torch.dtype, query_dtype: torch.dtype) -> bool:
    """SDPA's rule: bool, float32, or the query's dtype."""
    return mask_dtype in (torch.bool, torch.float32, query_dtype)


def check_mask(attn_mask, q: torch.Tensor, k: torch.Tensor):
    """The mask as a (B, Hq, L, S) view (broadcast dims get stride 0; nothing is expanded in memory)."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"flash_attention: attn_mask must be a torch.Tensor or None, got {type_name(attn_mask)}")
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


def check_kernel(kernel, return_lse) -> int:
    """The kernel's code; raises for an unknown kernel or a return_lse that is not a bool."""
    if return_lse is not True and return_lse is not False:
        raise TypeError(f"flash_attention: return_lse must be a bool (True or False), got {given(return_lse)}")
    if not isinstance(kernel, str):
        raise TypeError(f"flash_attention: kernel must be one of {sorted(_KERNELS)}, got {given(kernel)}")
    if kernel not in _KERNELS:
        raise ValueError(f"flash_attention: kernel must be one of {sorted(_KERNELS)}, got {given(kernel)}")
    return _KERNELS[kernel]


def scale_value(head_dim: int, scale) -> float:
    """SDPA's default 1/sqrt(E); with E == 0 every score is 0 and the core ignores the scale."""
    if scale is not None:
        return float(scale)
    return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 0.0


def check_int(value, name: str, who: str) -> int:
    """A count in [0, 2^31): an int, a numpy int or a 0-d integer tensor (read on the host)."""
    if type(value) is not int:
        value = check_number(value, name, who, integral=True)
    if value < 0 or value >= 2**31:
        raise FlashAttnInputError(f"{who}: {name} must be in [0, 2^31), got {value}")
    return value


def check_lengths_tensor(t, name: str, who: str, device, length=None) -> None:
    """A 1-D int32 tensor on `device` (of `length` entries when given), as flash-attn requires."""
    if not isinstance(t, torch.Tensor):
        raise FlashAttnTypeError(f"{who}: {name} must be an int32 torch.Tensor, got {given(t)}")
    if t.dtype != torch.int32:
        raise FlashAttnTypeError(f"{who}: {name} must be int32, got {t.dtype}")
    if t.dim() != 1 or (length is not None and t.shape[0] != length):
        want = f"({length},)" if length is not None else "1-D"
        raise FlashAttnInputError(f"{who}: {name} must be {want}, got shape {tuple(t.shape)}")
    if t.device != device:
        raise FlashAttnInputError(f"{who}: {name} is on {t.device}, q on {device}")


def check_scale(softmax_scale, head_dim: int, who: str) -> float:
    """softmax_scale (None: 1 / sqrt(headdim); a number or a 0-d tensor) as a float."""
    if softmax_scale is not None and type(softmax_scale) is not float:
        softmax_scale = check_number(softmax_scale, "softmax_scale", who)
    return scale_value(head_dim, softmax_scale)


def check_common(who: str, causal, window_size, softcap, deterministic):
    """The options flash_attn_varlen_func and flash_attn_with_kvcache share with flash_attn_func."""
    check_bool(causal, "causal", who)
    check_bool(deterministic, "deterministic", who)
    left, right = check_window(window_size, who)
    return (1, left, right), check_softcap(softcap, who)


class AttentionOptions(NamedTuple):
    """A call's checked options: what every entry point builds from its arguments with the checks
    above, and what the forward, the backward, the autograd Function and the custom ops carry.

    scale: a float (the default already resolved); causal: a bool; band: None (no window, SDPA's
    top-left causal diagonal) or (bottom_right, left, right), as band_of and check_common give, or
    (bottom_right, left, right, diagonal_offset) for a block of a longer sequence;
    softcap: a float, 0.0 for none; alibi: None or the (B, Hq) float32 slopes view
    (alibi_view); sinks: None or the (Hq,) float32 logits (check_sinks); dropout_p: a float in
    [0, 1]; kernel: a _C.KERNEL_* code; num_splits: the decode kernel's split-K, 0 for the
    planner's choice; kv_quant: None, or (k's, v's) QuantizedKV or None each (_quantized.py): the
    core reads their data in the k and v slots and their scales and biases in their own."""

    scale: float
    causal: bool
    band: Optional[tuple] = None
    softcap: float = 0.0
    alibi: Optional[torch.Tensor] = None
    sinks: Optional[torch.Tensor] = None
    dropout_p: float = 0.0
    kernel: int = _C.KERNEL_AUTO
    num_splits: int = 0
    kv_quant: Optional[tuple] = None

    def core(
        self, write_probs: bool = False, max_q_len: int = 0, max_kv_len: int = 0, unbatched: bool = False
    ) -> tuple:
        """The C binding's options tuple (_C.OPTION_FIELDS' order, flashattn_mps._core)."""
        return core_options(
            self.scale,
            self.causal,
            self.band,
            self.softcap,
            self.dropout_p,
            self.kernel,
            self.num_splits,
            write_probs,
            max_q_len,
            max_kv_len,
            unbatched,
            quant_fields(self.kv_quant),
        )


def quant_fields(kv_quant) -> tuple:
    """(k_bits, k_group_size, v_bits, v_group_size) of AttentionOptions.kv_quant (0 where not quantized)."""
    if kv_quant is None:
        return (0, 0, 0, 0)
    k, v = kv_quant
    return (
        0 if k is None else k.bits,
        0 if k is None else k.group_size,
        0 if v is None else v.bits,
        0 if v is None else v.group_size,
    )


# The fields of the options tuple below, in order: the C contract's table (_C.OPTION_FIELDS) must
# say the same, or every call would hand the core misplaced values.
CORE_FIELDS = (
    "scale",
    "causal",
    "bottom_right",
    "window_left",
    "window_right",
    "softcap",
    "dropout_p",
    "kernel",
    "num_splits",
    "write_probs",
    "max_q_len",
    "max_kv_len",
    "unbatched",
    "diagonal_offset",
    "k_bits",
    "k_group_size",
    "v_bits",
    "v_group_size",
    "gpu_family",
)
if _C.OPTION_FIELDS != CORE_FIELDS:
    raise ImportError(f"flashattn_mps: the C core's options are {_C.OPTION_FIELDS}, this module builds {CORE_FIELDS}")


# The GPU families the planner has tables for (csrc/fa_gpu_family.c): MTLGPUFamilyApple<N> as N.
GPU_FAMILIES = {"apple7": 7, "apple8": 8, "apple9": 9, "apple10": 10}


def check_gpu(gpu, who: str) -> int:
    """The option code of `gpu` (None: the device's own family, 0), or a clear error."""
    if gpu is None:
        return 0
    if not isinstance(gpu, str) or gpu.lower() not in GPU_FAMILIES:
        raise ValueError(
            f"{who}: gpu must be None (the device's family) or one of {', '.join(GPU_FAMILIES)}, got {given(gpu)}"
        )
    return GPU_FAMILIES[gpu.lower()]


def core_options(
    scale: float,
    causal: bool,
    band=None,
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    kernel: int = _C.KERNEL_AUTO,
    num_splits: int = 0,
    write_probs: bool = False,
    max_q_len: int = 0,
    max_kv_len: int = 0,
    unbatched: bool = False,
    quant: tuple = (0, 0, 0, 0),
    gpu_family: int = 0,
) -> tuple:
    """The C binding's options tuple: scale, causal, bottom_right, window_left, window_right,
    softcap, dropout_p, kernel, num_splits, write_probs, max_q_len, max_kv_len, unbatched,
    diagonal_offset, then quant's k_bits, k_group_size, v_bits, v_group_size (quant_fields), then
    gpu_family (0: the device's; check_gpu's codes). A band of None is no window on SDPA's
    top-left diagonal (bottom_right False, both sides -1); a band's optional fourth entry shifts
    every row's diagonal by that many keys (a block of a longer sequence:
    flashattn_mps.distributed's blocks)."""
    if band is None:
        return (
            scale,
            causal,
            False,
            -1,
            -1,
            softcap,
            dropout_p,
            kernel,
            num_splits,
            write_probs,
            max_q_len,
            max_kv_len,
            unbatched,
            0,
            *quant,
            gpu_family,
        )
    return (
        scale,
        causal,
        bool(band[0]),
        band[1],
        band[2],
        softcap,
        dropout_p,
        kernel,
        num_splits,
        write_probs,
        max_q_len,
        max_kv_len,
        unbatched,
        band[3] if len(band) > 3 else 0,
        *quant,
        gpu_family,
    )
