"""warmup: compile ahead of time what a model's attention calls will need.

The first call of each kind compiles a Metal library and specialises its pipelines (on a Mac, a
fraction of a second to seconds per kernel; on the CPU Metal device, a clang run unless the disk
cache has it) and plans the call. warmup makes that call once on zeros of the same shapes, dtypes,
strides and device, so later calls of those shapes compile nothing and find their plans cached.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from . import _C


def _zeros_like(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """Zeros with t's shape, strides, dtype and device (a plan is keyed by the strides too)."""
    z = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).zero_()
    return z.requires_grad_(requires_grad)


def warmup(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    backward: bool = False,
    function: Optional[Callable] = None,
    **kwargs,
) -> dict:
    """Compiles the libraries and pipelines, and makes the plans, that `function(q, k, v, **kwargs)`
    (default `flash_attention`) needs, by calling it once on zeros like q, k and v; with
    `backward=True` also its backward (the forward then saves what the backward reads, as under
    autograd). MPS and CPU tensors alike. q, k and v are only read for their shapes, strides, dtype
    and device; keyword tensors (masks, slopes, sinks, ...) are passed as given. The random state
    is left as it was (a dropout call's draw is undone).

    Call it once per distinct call shape a model makes (e.g. prefill and one decode step per batch
    size). Returns {"builds": libraries compiled and pipelines built, "plans": plans made,
    "seconds": time taken}; a repeated warmup builds and plans nothing. The backward is warmed
    with a contiguous gradient; a tensor whose strides differ from the warmed ones (e.g. the
    expanded gradient of `out.sum()`) gets a plan of its own, and may need a specialisation of its
    own (vector loads need unit strides).
    """
    from ._api import flash_attention

    function = function or flash_attention
    devices = {t.device for t in (q, k, v)}
    before, builds = _C.plan_cache_counts(), _C.backend_builds()
    start = time.perf_counter()
    mps = any(d.type == "mps" for d in devices)
    cpu_rng, mps_rng = torch.get_rng_state(), torch.mps.get_rng_state() if mps else None
    try:
        leaves = [_zeros_like(t, backward) for t in (q, k, v)]
        out = function(*leaves, **kwargs)
        first = out[0] if isinstance(out, (tuple, list)) else out
        if backward:
            first.backward(torch.zeros_like(first))
        if mps:
            torch.mps.synchronize()
    finally:
        torch.set_rng_state(cpu_rng)
        if mps:
            torch.mps.set_rng_state(mps_rng)
    after = _C.plan_cache_counts()
    plans = (after["forward_misses"] - before["forward_misses"]) + (
        after["backward_misses"] - before["backward_misses"]
    )
    return {"builds": _C.backend_builds() - builds, "plans": plans, "seconds": time.perf_counter() - start}
