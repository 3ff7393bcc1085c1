"""How Metal dispatches reach the GPU on MPS tensors: the stream mode, the debug switch and the
buffer check, chosen from torch's version and the environment (the Metal backend confirms the
torch symbols each mode calls; csrc/metal_backend/metal_backend.h).

Stream modes:
- torch >= 2.9: encode on torch's MPS stream (`torch::mps::get_command_buffer()`, which ends torch's
  open coalesced encoder from 2.9 on) and commit it there (`torch::mps::commit()`, as PyTorch's own
  custom-kernel example does); no wait, ordered with torch's own work. A command buffer of ours that
  fails on the GPU is reported on stderr naming the kernel, and raised by the next call.
- torch 2.4 to 2.8: the same, ending torch's coalesced encoder first through
  `at::mps::getCurrentMPSStream()->endKernelCoalescing()`.
- Fallback, only when a symbol that mode calls is missing or FLASHATTN_MPS_STREAM=sync:
  the backend's own command queue; torch.mps.synchronize() before each call, a wait after each
  dispatch.

Environment variables (read once, at the first MPS call):
- FLASHATTN_MPS_STREAM: "auto" (default) or "sync" (the fallback, e.g. to rule out stream mode).
- FLASHATTN_MPS_DEBUG_SYNC=1: every dispatch waits on torch's stream, and a failed command buffer
  raises flashattn_mps.MetalDispatchError naming the kernel at that call (otherwise it is raised by
  the next call). Slow; for diagnosis.
- FLASHATTN_MPS_NO_BUFFER_CHECK=1: skip the test that each MPS storage handle is an
  id<MTLBuffer> (malloc_size, conformsToProtocol); lengths and devices are still checked.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import torch

from . import _C

ENV_STREAM = "FLASHATTN_MPS_STREAM"
ENV_DEBUG = "FLASHATTN_MPS_DEBUG_SYNC"
ENV_NO_BUFFER_CHECK = "FLASHATTN_MPS_NO_BUFFER_CHECK"

MODE_NAMES = {
    _C.METAL_OWN_QUEUE: "synchronising fallback (own command queue, torch.mps.synchronize() first, wait per dispatch)",
    _C.METAL_TORCH_STREAM: "torch's MPS stream",
    _C.METAL_TORCH_STREAM_END_COALESCING: "torch's MPS stream, ending torch's kernel coalescing first",
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def _flag(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "").strip().lower()
    if value not in _TRUE | _FALSE:
        raise ValueError(f"flashattn_mps: {name}={env[name]!r}; use 1 or 0")
    return value in _TRUE


def torch_version_tuple(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as '2.9.0', '2.10.0a0+git1234' or '2.8.0+cpu'."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


@dataclass(frozen=True)
class Decision:
    requested: int  # the mode this torch and environment call for
    mode: int  # the mode in effect (the backend's answer)
    debug: bool
    check_buffers: bool
    reason: str  # why `requested`
    missing: tuple  # torch symbols not found (mangled names)

    def describe(self) -> str:
        text = f"Metal stream mode: {MODE_NAMES[self.mode]} ({self.reason}"
        if self.mode != self.requested:
            text += f"; wanted {MODE_NAMES[self.requested]}, but torch symbols are missing: {', '.join(self.missing)}"
        text += f"); debug sync {'on' if self.debug else 'off'}; buffer check {'on' if self.check_buffers else 'off'}"
        return text


def requested_mode(torch_version: str, env: Mapping[str, str]) -> tuple[int, str]:
    """The stream mode a torch version and the environment call for, and why."""
    stream = env.get(ENV_STREAM, "auto").strip().lower() or "auto"
    if stream not in ("auto", "sync"):
        raise ValueError(f"flashattn_mps: {ENV_STREAM}={env[ENV_STREAM]!r}; use auto or sync")
    if stream == "sync":
        return _C.METAL_OWN_QUEUE, f"{ENV_STREAM}=sync"
    version = torch_version_tuple(torch_version)
    if version >= (2, 9):
        return _C.METAL_TORCH_STREAM, f"torch {torch_version} >= 2.9 ends its coalesced encoder itself"
    if version >= (2, 4):
        return _C.METAL_TORCH_STREAM_END_COALESCING, f"torch {torch_version} < 2.9 leaves its coalesced encoder open"
    return _C.METAL_OWN_QUEUE, f"torch {torch_version} is older than 2.4"


def decide(torch_version: str, env: Mapping[str, str], backend=_C) -> Decision:
    """Chooses the mode, configures the backend, and returns what is in effect."""
    requested, reason = requested_mode(torch_version, env)
    debug = _flag(env, ENV_DEBUG)
    check_buffers = not _flag(env, ENV_NO_BUFFER_CHECK)
    mode = backend.metal_configure(requested, debug, check_buffers)
    missing = tuple(name for name, found in backend.metal_torch_symbols().items() if not found)
    return Decision(requested, mode, debug, check_buffers, reason, missing)


_lock = threading.Lock()
_decision: Optional[Decision] = None


def current() -> Decision:
    """The decision for this process (made on first use)."""
    global _decision
    if _decision is None:
        with _lock:
            if _decision is None:
                _decision = decide(torch.__version__, os.environ)
    return _decision


def prepare() -> None:
    """Before every Metal call: in the fallback, order the backend's queue after torch's work."""
    if current().mode == _C.METAL_OWN_QUEUE:
        torch.mps.synchronize()


def describe() -> str:
    """One line for explain / explain_plan / the doctor: the stream mode in effect and why."""
    return current().describe()
