"""The fixtures every test folder shares (the helpers are in helpers.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def checked_core():
    """The project's kernels built checked; counts the checked dispatches they ran."""
    from flashattn_mps import _metal_cpu
    from flashattn_mps import metal_cpu as mc

    mc.set_checked(True)
    start = _metal_cpu.checked_dispatches()
    try:
        yield lambda: _metal_cpu.checked_dispatches() - start
    finally:
        mc.set_checked(None)


@pytest.fixture
def core_calls(monkeypatch):
    """Counts the C core's forward and backward calls: the proof that the kernels ran."""
    import flashattn_mps

    counts = {"forward": 0, "backward": 0, "masked": 0}  # masked: forward calls given an attn_mask
    for name in ("forward", "backward"):

        def counting(*args, _real=getattr(flashattn_mps._C, name), _name=name, **kwargs):  # noqa: B008 (bound per name)
            counts[_name] += 1
            # _C.forward(device, tensors, options, workspace): tensors a dict slot name -> tensor
            mask = kwargs.get("tensors", args[1] if len(args) > 1 else {}).get("mask")
            counts["masked"] += _name == "forward" and mask is not None
            return _real(*args, **kwargs)

        monkeypatch.setattr(flashattn_mps._C, name, counting)
    return counts
