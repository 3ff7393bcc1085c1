"""The SDPA drop-in: torch's signature and semantics, our kernels where they apply, torch's own
SDPA (visibly) where they do not, and patch()/unpatch() to switch a whole model over."""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.nn.attention.bias import CausalBias, CausalVariant

from . import _C, _metal_mode
from ._api import attend
from ._autograd import _is_traced
from ._options import supported_mask_dtype

log = logging.getLogger("flashattn_mps")

_original_sdpa = F.scaled_dot_product_attention
# enable_gqa came with torch 2.5; torch_sdpa stands in for it on torch 2.4.
_TORCH_HAS_ENABLE_GQA = _metal_mode.torch_version_tuple(torch.__version__) >= (2, 5)
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TRACING_TENSORS = (FakeTensor, FunctionalTensor)  # what make_fx and export trace with


@dataclass(frozen=True)
class Route:
    """Which path a call takes: "kernel" (flashattn_mps) or "torch" (the original SDPA), and why."""

    path: str
    reason: str

    def __str__(self) -> str:
        where = "flashattn_mps kernels" if self.path == "kernel" else "torch's scaled_dot_product_attention"
        return f"{where}: {self.reason}"


class _KernelCall(NamedTuple):
    """A call the kernels take, its arguments resolved: autocast applied, a CausalBias turned into
    is_causal (True, or "bottom_right" for a lower-right one) or a bool mask, scale a float or None,
    dropout_p a float in [0, 1]."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: Optional[torch.Tensor]
    is_causal: bool
    scale: Optional[float]
    dropout_p: float = 0.0


_NOT_ACCEPTED = object()


def _float_argument(x):
    """torch's parsing of a `float` argument of SDPA: Python and NumPy numbers, and 0-dim tensors
    that do not require grad; _NOT_ACCEPTED where torch raises (it then raises its own error)."""
    if isinstance(x, (np.number, np.bool_)):
        return float(np.real(x))
    if isinstance(x, (float, int)):  # bool included
        return float(x)
    if (
        isinstance(x, torch.Tensor)
        and type(x) is torch.Tensor
        and x.dim() == 0
        and not x.requires_grad
        and not x.is_complex()
        and x.device.type != "meta"
        and not torch.compiler.is_compiling()
    ):
        return float(x.item())
    return _NOT_ACCEPTED


def _scalar_arguments(dropout_p, is_causal, scale, enable_gqa):
    """(dropout_p, scale) as floats (scale may stay None), or None when torch's argument parser
    rejects one of the four (is_causal and enable_gqa must be Python bools)."""
    dropout = _float_argument(dropout_p)
    scale_value = None if scale is None else _float_argument(scale)
    if dropout is _NOT_ACCEPTED or scale_value is _NOT_ACCEPTED:
        return None
    if not (isinstance(is_causal, bool) and isinstance(enable_gqa, bool)):
        return None
    return dropout, scale_value


def _overrides_torch_function(t) -> bool:
    """A tensor subclass with its own __torch_function__ (nn.Parameter disables it)."""
    cls = type(t)
    if not isinstance(t, torch.Tensor) or cls is torch.Tensor:
        return False
    return cls.__torch_function__ is not torch._C._disabled_torch_function_impl


def _dispatches_for_itself(t) -> bool:
    """A tensor subclass with its own __torch_dispatch__ (DTensor, FakeTensor, FunctionalTensor, a
    user's wrapper): its elements are not in its own storage (a wrapper has none), so the kernels
    cannot read them. The tracing machinery's own fake and functional tensors are the exception
    while it traces (a dispatch mode active, torch.compile): the custom ops' fakes take them."""
    cls = type(t)
    if cls is torch.Tensor or not isinstance(t, torch.Tensor):
        return False
    if cls.__torch_dispatch__ is torch.Tensor.__torch_dispatch__:
        return False
    return not (isinstance(t, _TRACING_TENSORS) and _is_traced())


@torch.compiler.assume_constant_result
def _fused_backends_allowed() -> bool:
    """Whether torch.nn.attention.sdpa_kernel (or torch.backends.cuda.enable_*_sdp) allows a fused
    backend the kernels stand in for: FLASH_ATTENTION or EFFICIENT_ATTENTION. Under torch.compile
    it is read when tracing (no guard: changing it later does not retrace)."""
    return torch.backends.cuda.flash_sdp_enabled() or torch.backends.cuda.mem_efficient_sdp_enabled()


def _autocast_device_types() -> frozenset:
    """The kernels' devices this torch has autocast for (MPS autocast came with torch 2.5)."""
    types = set()
    for device_type in ("cpu", "mps"):
        try:
            torch.is_autocast_enabled(device_type)
            types.add(device_type)
        except RuntimeError:
            pass
    return frozenset(types)


_AUTOCAST_DEVICE_TYPES = _autocast_device_types()


def _autocast(call: _KernelCall) -> tuple:
    """Autocast's rule for SDPA (lower_precision_fp on CPU, CUDA and MPS): floating-point tensor
    arguments other than float64 are cast to the autocast dtype. Returns the call and the dtype
    (None without autocast)."""
    device_type = call.query.device.type
    if device_type not in _AUTOCAST_DEVICE_TYPES or not torch.is_autocast_enabled(device_type):
        return call, None
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t):
        eligible = t is not None and t.is_floating_point() and t.dtype != torch.float64
        return t.to(dtype) if eligible else t

    return call._replace(
        query=cast(call.query), key=cast(call.key), value=cast(call.value), attn_mask=cast(call.attn_mask)
    ), dtype


def _as_4d(t: torch.Tensor) -> Optional[torch.Tensor]:
    """(N, ..., H, L, E) as a (B, H, L, E) view; None when that would need a copy."""
    if t.dim() == 2:
        return t.unsqueeze(0).unsqueeze(0)
    if t.dim() == 3:
        return t.unsqueeze(0)
    if t.dim() == 4:
        return t
    try:
        return t.view(-1, *t.shape[-3:])
    except RuntimeError:
        return None


def route(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, allow_cpu=True
) -> Route:
    """Decide the path without running anything. Invalid calls route to torch, which raises exactly
    what it raises for them."""
    return _plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, allow_cpu)[0]


def _plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, allow_cpu):
    """(Route, _KernelCall for the kernels or None)."""
    scalars = _scalar_arguments(dropout_p, is_causal, scale, enable_gqa)
    if scalars is None:
        return Route(
            "torch", "dropout_p, is_causal, scale or enable_gqa of a type torch does not accept (torch raises)"
        ), None
    dropout_p, scale = scalars
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return Route("torch", "query, key and value are not all tensors"), None
    if any(t.is_nested for t in tensors):
        return Route("torch", "nested (jagged) tensors"), None
    if not torch.compiler.is_compiling() and any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors):
        return Route("torch", "tensors of a torch.func transform (vmap, grad, functionalize)"), None
    if not torch.compiler.is_compiling() and any(torch._is_functional_tensor(t) for t in tensors):
        return Route("torch", "functional tensors (functionalization's wrappers): their storage is not theirs"), None
    mask_is_bias = isinstance(attn_mask, CausalBias)
    subclassed = [t for t in (*tensors, None if mask_is_bias else attn_mask) if _overrides_torch_function(t)]
    if subclassed:
        return Route(
            "torch",
            f"a {type(subclassed[0]).__name__} argument: tensor subclasses with "
            "__torch_function__ decide for themselves",
        ), None
    wrapped = [t for t in (*tensors, None if mask_is_bias else attn_mask) if _dispatches_for_itself(t)]
    if wrapped:
        return Route(
            "torch",
            f"a {type(wrapped[0]).__name__} argument: a tensor subclass with __torch_dispatch__ (DTensor, "
            "FakeTensor outside tracing, a wrapper) keeps its elements elsewhere; torch's SDPA dispatches to it",
        ), None
    if not _fused_backends_allowed():
        return Route(
            "torch",
            "torch.nn.attention.sdpa_kernel excludes FLASH_ATTENTION and EFFICIENT_ATTENTION, "
            "the backends the kernels stand in for",
        ), None
    masking = "attn_mask" if attn_mask is not None else "causal" if is_causal else "no mask"
    if mask_is_bias:
        if is_causal:
            return Route("torch", "a CausalBias with is_causal=True (torch raises)"), None
        if attn_mask.variant == CausalVariant.UPPER_LEFT or attn_mask.seq_len_q == attn_mask.seq_len_kv:
            attn_mask, is_causal, masking = None, True, "causal (CausalBias, upper left)"
        else:  # flash-attn's alignment: the kernels' bottom-right band, no mask
            attn_mask, is_causal, masking = None, "bottom_right", "causal (CausalBias, lower right)"
    call, autocast_dtype = _autocast(_KernelCall(query, key, value, attn_mask, is_causal, scale, dropout_p))
    refusal = _kernel_refusal(call, dropout_p, enable_gqa, allow_cpu)
    if refusal is not None:
        return Route("torch", refusal), None
    if dropout_p > 0.0:
        masking += f", dropout_p={dropout_p} (in the kernels)"
    if autocast_dtype is not None:
        masking += f", under autocast to {autocast_dtype}"
    return Route("kernel", f"{masking} (flashattn_mps.explain_plan shows the kernels and grids)"), call


def _kernel_refusal(call: _KernelCall, dropout_p: float, enable_gqa: bool, allow_cpu: bool) -> Optional[str]:
    """Why the kernels cannot take this call (None when they can)."""
    query, key, value, attn_mask, is_causal, _, _ = call
    tensors = (query, key, value)
    devices = {t.device.type for t in tensors}
    if attn_mask is not None and isinstance(attn_mask, torch.Tensor):
        devices.add(attn_mask.device.type)
    if devices not in ({"mps"}, {"cpu"}):
        return f"device(s) {sorted(devices)}: the kernels run on mps (or cpu, via the CPU Metal device)"
    if devices == {"cpu"} and not allow_cpu:
        return "CPU tensors and the patch was not asked to route CPU calls"
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in _KERNEL_DTYPES:
        return f"dtypes {query.dtype}, {key.dtype}, {value.dtype}: the kernels take one of float32, float16, bfloat16"
    if not 0.0 <= dropout_p <= 1.0:
        return "dropout_p out of [0, 1] (torch raises)"
    if query.dim() < 2 or not (query.dim() == key.dim() == value.dim()):
        return "query, key and value differ in rank"
    if query.dim() >= 3 and not (query.shape[:-3] == key.shape[:-3] == value.shape[:-3]):
        return "batch dimensions differ (broadcast batches are left to torch)"
    if key.shape[-2] != value.shape[-2]:
        return f"key has {key.shape[-2]} positions but value has {value.shape[-2]}"
    if query.shape[-1] != key.shape[-1]:
        return "query and key head dims differ (torch raises)"
    hq = query.shape[-3] if query.dim() >= 3 else 1
    hkv = key.shape[-3] if key.dim() >= 3 else 1
    if key.shape[:-2] != value.shape[:-2]:
        return "key and value heads differ (torch raises)"
    if hq != hkv and not (enable_gqa and hkv > 0 and hq % hkv == 0):
        return f"{hq} query heads and {hkv} key/value heads without enable_gqa=True (torch raises)"
    if query.shape[-1] > _C.MAX_HEAD_DIM or value.shape[-1] > _C.MAX_HEAD_DIM:
        return f"head dims above {_C.MAX_HEAD_DIM}"
    if any(_as_4d(t) is None for t in tensors):
        return "leading dims cannot be flattened into one batch dim without a copy"
    if attn_mask is not None:
        if is_causal:
            return "both attn_mask and is_causal"  # scaled_dot_product_attention raises
        if not isinstance(attn_mask, torch.Tensor):
            return "attn_mask is not a tensor"
        if not supported_mask_dtype(attn_mask.dtype, query.dtype):
            return f"attn_mask dtype {attn_mask.dtype}: bool, float32 or the query's dtype (torch raises otherwise)"
        target = (*query.shape[:-2], query.shape[-2], key.shape[-2])
        try:
            broadcast = torch.broadcast_shapes(attn_mask.shape, target)
        except RuntimeError:
            return f"attn_mask {tuple(attn_mask.shape)} does not broadcast to {target} (torch raises)"
        if tuple(broadcast) != target:
            return f"attn_mask {tuple(attn_mask.shape)} would broadcast the output beyond {target}"
        if _as_4d(_broadcast_mask(attn_mask, query, key)) is None:
            return "attn_mask's leading dims cannot be viewed as one batch dim"
        if attn_mask.requires_grad and torch.is_grad_enabled():
            return "attn_mask requires grad: the kernels do not differentiate masks"
    return None


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """`torch.nn.functional.scaled_dot_product_attention` with the same signature, semantics, errors
    and results, computed by flashattn_mps kernels (MPS tensors on Metal, CPU tensors on the CPU
    Metal device) without an L x S matrix; dropout_p > 0 drops probabilities in the kernels
    (whenever it is > 0, as torch does: modules pass 0 in eval), seeded from torch's default
    generator of the tensors' device, so torch.manual_seed reproduces a run (the mask differs from
    torch's own, which no two SDPA backends share either). Calls the kernels do not cover (masks
    that need grad, other devices or dtypes, broadcast batches, nested tensors, torch.func transforms, tensor
    subclasses, an sdpa_kernel context that excludes the fused backends...) go to torch's own SDPA;
    `explain` says which path a call takes and why, and the reason is logged at DEBUG level on
    logger "flashattn_mps" (not while torch.compile traces)."""
    return _attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, allow_cpu=True)


def _attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, allow_cpu):
    decision, call = _plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, allow_cpu)
    if (
        is_causal is True
        and attn_mask is not None
        and not isinstance(attn_mask, CausalBias)
        and _scalar_arguments(dropout_p, is_causal, scale, enable_gqa) is not None
    ):
        # what torch raises on meta and MPS tensors (its CPU kernel lets it pass)
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")
    if not torch.compiler.is_compiling() and log.isEnabledFor(logging.DEBUG):
        log.debug("scaled_dot_product_attention -> %s", decision)
    if call is None:
        return torch_sdpa(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    return _run_kernel(call)


def torch_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch's own SDPA (the original, also under patch()) with enable_gqa on every admitted torch.
    torch 2.4's has no enable_gqa: there the key and value heads are repeated as torch's math path
    does for GQA (the same numbers) and the argument is left out; head counts GQA cannot pair are
    passed unrepeated, so torch raises its own shape error."""
    if _TORCH_HAS_ENABLE_GQA:
        return _original_sdpa(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    if not isinstance(enable_gqa, bool):  # torch >= 2.5's argument parser says the same
        raise TypeError(
            f"scaled_dot_product_attention(): argument 'enable_gqa' must be bool, not {type(enable_gqa).__name__}"
        )
    if enable_gqa and all(isinstance(t, torch.Tensor) and t.dim() >= 3 for t in (query, key, value)):
        hq, hkv = query.shape[-3], key.shape[-3]
        if hkv > 0 and hq != hkv and hq % hkv == 0:
            key = key.repeat_interleave(hq // hkv, dim=-3)
            value = value.repeat_interleave(hq // hkv, dim=-3)
    return _original_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)


def _run_kernel(call: _KernelCall):
    query, key, value, attn_mask, is_causal, scale, dropout_p = call
    q, k, v = (_as_4d(t) for t in (query, key, value))
    mask = None if attn_mask is None else _as_4d(_broadcast_mask(attn_mask, query, key))
    if is_causal == "bottom_right":
        out = attend(q, k, v, mask, True, scale, band=(1, -1, -1), dropout_p=dropout_p)
    else:
        out = attend(q, k, v, mask, is_causal, scale, dropout_p=dropout_p)  # flash_attention's lean entry
    return out.view(*query.shape[:-1], value.shape[-1])


def _broadcast_mask(attn_mask, query, key):
    """The mask as a (..., L, S) view over the query's leading dims: broadcast dims get stride 0,
    nothing is expanded in memory."""
    return attn_mask.expand(*query.shape[:-2], query.shape[-2], key.shape[-2])


def explain(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False) -> str:
    """Which path `scaled_dot_product_attention` takes for these arguments, and why (for MPS
    tensors also the Metal stream mode in effect)."""
    decision = str(route(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa))
    return decision + (f"; {_metal_mode.describe()}" if getattr(query, "is_mps", False) else "")


class patch:
    """Route `torch.nn.functional.scaled_dot_product_attention` through the drop-in.

        flashattn_mps.patch()            # MPS tensors go to flashattn_mps from now on
        flashattn_mps.unpatch()
        with flashattn_mps.patch(cpu=True):  # also CPU tensors, through the CPU Metal device
            model(x)

    Everything the kernels do not cover goes to the original function untouched."""

    _lock = threading.Lock()
    _active: list = []

    def __init__(self, cpu: bool = False):
        allow_cpu = bool(cpu)

        def scaled_dot_product_attention(
            query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
        ):
            return _attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, allow_cpu)

        self.cpu = allow_cpu
        with patch._lock:
            patch._active.append((self, F.scaled_dot_product_attention))
            F.scaled_dot_product_attention = functools.update_wrapper(scaled_dot_product_attention, _original_sdpa)

    def close(self) -> None:
        with patch._lock:
            for i, (owner, previous) in enumerate(patch._active):
                if owner is self:
                    del patch._active[i]
                    if i == len(patch._active):  # the newest patch: restore what it replaced
                        F.scaled_dot_product_attention = previous
                    else:  # an older one: the next patch must restore what this one replaced
                        nxt, _ = patch._active[i]
                        patch._active[i] = (nxt, previous)
                    return

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def unpatch() -> None:
    """Undo every active patch(): torch's own scaled_dot_product_attention is back."""
    with patch._lock:
        patch._active.clear()
        F.scaled_dot_product_attention = _original_sdpa
