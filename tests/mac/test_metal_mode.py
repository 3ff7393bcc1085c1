"""The Metal stream-mode choice (flashattn_mps._metal_mode): which mode each torch version and
environment call for, what the backend's answer does to the description, and the bindings' view
on a build without Metal. The Objective-C that acts on it needs a Mac (csrc/metal_backend/README.md)."""

from __future__ import annotations

import pytest
import torch

import flashattn_mps
from flashattn_mps import _C, _metal_mode


@pytest.mark.parametrize(
    "version, expected",
    [
        ("2.4.0", _C.METAL_TORCH_STREAM_END_COALESCING),
        ("2.8.0+cpu", _C.METAL_TORCH_STREAM_END_COALESCING),
        ("2.9.0", _C.METAL_TORCH_STREAM),
        ("2.10.0a0+git1234", _C.METAL_TORCH_STREAM),
        ("2.15.1", _C.METAL_TORCH_STREAM),
        ("2.3.1", _C.METAL_OWN_QUEUE),
    ],
)
def test_requested_mode_by_torch_version(version, expected):
    mode, reason = _metal_mode.requested_mode(version, {})
    assert mode == expected
    assert version in reason


def test_env_forces_the_fallback_and_rejects_unknown_values():
    assert _metal_mode.requested_mode("2.13.0", {"FLASHATTN_MPS_STREAM": "sync"})[0] == _C.METAL_OWN_QUEUE
    with pytest.raises(ValueError, match="FLASHATTN_MPS_STREAM"):
        _metal_mode.requested_mode("2.13.0", {"FLASHATTN_MPS_STREAM": "fast"})
    with pytest.raises(ValueError, match="FLASHATTN_MPS_DEBUG_SYNC"):
        _metal_mode.decide("2.13.0", {"FLASHATTN_MPS_DEBUG_SYNC": "maybe"})


class FakeBackend:
    """Answers as the Metal backend would with some torch symbols missing."""

    def __init__(self, found):
        self.found = found
        self.calls = []

    def metal_torch_symbols(self):
        return dict(self.found)

    def metal_configure(self, mode, debug, check_buffers):
        self.calls.append((mode, debug, check_buffers))
        return mode if all(self.found.values()) else _C.METAL_OWN_QUEUE


def test_decision_passes_env_to_the_backend_and_reports_missing_symbols():
    backend = FakeBackend({"_ZN2at3mps9MPSStream19endKernelCoalescingEv": False, "_ZN5torch3mps11synchronizeEv": True})
    env = {"FLASHATTN_MPS_DEBUG_SYNC": "1", "FLASHATTN_MPS_NO_BUFFER_CHECK": "yes"}
    decision = _metal_mode.decide("2.6.0", env, backend)
    assert backend.calls == [(_C.METAL_TORCH_STREAM_END_COALESCING, True, False)]
    assert decision.mode == _C.METAL_OWN_QUEUE and decision.debug and not decision.check_buffers
    text = decision.describe()
    assert text.startswith("Metal stream mode: synchronising fallback")
    assert "endKernelCoalescing" in text and "synchronizeEv" not in text
    assert "debug sync on; buffer check off" in text


def test_decision_in_effect_is_described_plainly():
    decision = _metal_mode.decide("2.13.0", {}, FakeBackend({"_ZN5torch3mps18get_command_bufferEv": True}))
    assert decision.mode == _C.METAL_TORCH_STREAM
    assert decision.describe() == (
        "Metal stream mode: torch's MPS stream (torch 2.13.0 >= 2.9 ends its coalesced "
        "encoder itself); debug sync off; buffer check on"
    )


def test_explain_names_the_stream_mode_for_mps_tensors_only(monkeypatch):
    q = torch.zeros(1, 2, 4, 8)
    assert "stream mode" not in flashattn_mps.explain(q, q, q)
    monkeypatch.setattr(_metal_mode, "describe", lambda: "Metal stream mode: X")
    monkeypatch.setattr(torch.Tensor, "is_mps", property(lambda self: True))
    assert flashattn_mps.explain(q, q, q).endswith("; Metal stream mode: X")


def test_bindings_without_metal_find_nothing_and_fall_back():
    if _C.HAS_METAL_BACKEND:
        pytest.skip("this build has the Metal backend")
    symbols = _C.metal_torch_symbols()
    assert list(symbols) == [
        "_ZN5torch3mps18get_command_bufferEv",
        "_ZN5torch3mps18get_dispatch_queueEv",
        "_ZN5torch3mps11synchronizeEv",
        "_ZN2at3mps19getCurrentMPSStreamEv",
        "_ZN2at3mps9MPSStream19endKernelCoalescingEv",
        "_ZN5torch3mps6commitEv",
    ]
    assert not any(symbols.values())
    assert _C.metal_configure(_C.METAL_TORCH_STREAM, False, True) == _C.METAL_OWN_QUEUE
    with pytest.raises(flashattn_mps.MetalDispatchError, match="only in macOS builds"):
        _C.metal_device_info()
