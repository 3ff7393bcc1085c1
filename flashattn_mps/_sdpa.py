"""The SDPA drop-in: torch's signature and semantics, our kernels where they apply, torch's own
SDPA (visibly) where they do not, and patch()/unpatch() to switch a whole model over."""
from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ._api import attend, supported_mask_dtype

log = logging.getLogger("flashattn_mps")

_original_sdpa = F.scaled_dot_product_attention
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Route:
    """Which path a call takes: "kernel" (flashattn_mps) or "torch" (the original SDPA), and why."""

    path: str
    reason: str

    def __str__(self) -> str:
        where = "flashattn_mps kernels" if self.path == "kernel" else "torch's scaled_dot_product_attention"
        return f"{where}: {self.reason}"


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


def route(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
          allow_cpu=True) -> Route:
    """Decide the path without running anything. Invalid calls route to torch, which raises exactly
    what it raises for them."""
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return Route("torch", "query, key and value are not all tensors")
    devices = {t.device.type for t in tensors}
    if attn_mask is not None and isinstance(attn_mask, torch.Tensor):
        devices.add(attn_mask.device.type)
    if devices not in ({"mps"}, {"cpu"}):
        return Route("torch", f"device(s) {sorted(devices)}: the kernels run on mps (or cpu, via the CPU Metal device)")
    if devices == {"cpu"} and not allow_cpu:
        return Route("torch", "CPU tensors and the patch was not asked to route CPU calls")
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in _KERNEL_DTYPES:
        return Route("torch", f"dtypes {query.dtype}, {key.dtype}, {value.dtype}: the kernels take one of float32, float16, bfloat16")
    if not 0.0 <= float(dropout_p) <= 1.0:
        return Route("torch", "dropout_p out of [0, 1] (torch raises)")
    if dropout_p > 0.0:
        return Route("torch", f"dropout_p={dropout_p}: the kernels have no dropout")
    if query.dim() < 2 or not (query.dim() == key.dim() == value.dim()):
        return Route("torch", "query, key and value differ in rank")
    if query.dim() >= 3 and not (query.shape[:-3] == key.shape[:-3] == value.shape[:-3]):
        return Route("torch", "batch dimensions differ (broadcast batches are left to torch)")
    if key.shape[-2] != value.shape[-2]:
        return Route("torch", f"key has {key.shape[-2]} positions but value has {value.shape[-2]}")
    if query.shape[-1] != key.shape[-1]:
        return Route("torch", "query and key head dims differ (torch raises)")
    hq = query.shape[-3] if query.dim() >= 3 else 1
    hkv = key.shape[-3] if key.dim() >= 3 else 1
    if key.shape[:-2] != value.shape[:-2]:
        return Route("torch", "key and value heads differ (torch raises)")
    if hq != hkv and not (enable_gqa and hkv > 0 and hq % hkv == 0):
        return Route("torch", f"{hq} query heads and {hkv} key/value heads without enable_gqa=True (torch raises)")
    if query.shape[-1] > 256 or value.shape[-1] > 256:
        return Route("torch", "head dims above 256")
    if any(_as_4d(t) is None for t in tensors):
        return Route("torch", "leading dims cannot be flattened into one batch dim without a copy")
    if attn_mask is not None:
        if is_causal:
            return Route("torch", "both attn_mask and is_causal")  # scaled_dot_product_attention raises first
        if not isinstance(attn_mask, torch.Tensor):
            return Route("torch", "attn_mask is not a tensor")
        if not supported_mask_dtype(attn_mask.dtype, query.dtype):
            return Route("torch", f"attn_mask dtype {attn_mask.dtype}: bool, float32 or the query's dtype (torch raises otherwise)")
        target = (*query.shape[:-2], query.shape[-2], key.shape[-2])
        try:
            broadcast = torch.broadcast_shapes(attn_mask.shape, target)
        except RuntimeError:
            return Route("torch", f"attn_mask {tuple(attn_mask.shape)} does not broadcast to {target} (torch raises)")
        if broadcast != torch.Size(target):
            return Route("torch", f"attn_mask {tuple(attn_mask.shape)} would broadcast the output beyond {target}")
        if _as_4d(_broadcast_mask(attn_mask, query, key)) is None:
            return Route("torch", "attn_mask's leading dims cannot be viewed as one batch dim")
        if attn_mask.requires_grad and torch.is_grad_enabled():
            return Route("torch", "attn_mask requires grad: the kernels do not differentiate masks")
    masking = "attn_mask" if attn_mask is not None else "causal" if is_causal else "no mask"
    return Route("kernel", f"{masking} (flashattn_mps.explain_plan shows the kernels and grids)")


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """`torch.nn.functional.scaled_dot_product_attention` with the same signature, semantics, errors
    and results, computed by flashattn_mps kernels (MPS tensors on Metal, CPU tensors on the CPU
    Metal device) without an L x S matrix. Calls the kernels do not cover (dropout, masks that need
    grad, other devices or dtypes, broadcast batches...) go to torch's own SDPA; `explain` says which
    path a call takes and why, and the reason is logged at DEBUG level on logger "flashattn_mps"."""
    return _attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, allow_cpu=True)


def _attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, allow_cpu):
    if attn_mask is not None and is_causal:
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")
    decision = route(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, allow_cpu=allow_cpu)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("scaled_dot_product_attention -> %s", decision)
    if decision.path == "torch":
        return _original_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa)
    return _run_kernel(query, key, value, attn_mask, is_causal, scale)


def _run_kernel(query, key, value, attn_mask, is_causal, scale):
    q, k, v = (_as_4d(t) for t in (query, key, value))
    mask = None if attn_mask is None else _as_4d(_broadcast_mask(attn_mask, query, key))
    out = attend(q, k, v, mask, is_causal, scale)  # flash_attention's lean entry
    return out.view(*query.shape[:-1], value.shape[-1])


def _broadcast_mask(attn_mask, query, key):
    """The mask as a (..., L, S) view over the query's leading dims: broadcast dims get stride 0,
    nothing is expanded in memory."""
    return attn_mask.expand(*query.shape[:-2], query.shape[-2], key.shape[-2])


def explain(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False) -> str:
    """Which path `scaled_dot_product_attention` takes for these arguments, and why."""
    return str(route(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa))


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

        def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                         scale=None, enable_gqa=False):
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
