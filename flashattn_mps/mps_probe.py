"""Whether torch's MPS device actually computes here, decided by running it.

`torch.backends.mps.is_available()` is not enough: GitHub's macOS runners (virtual machines with a
paravirtual GPU) report MPS available, yet allocating or computing on it fails. The probe allocates
a tensor on MPS, computes with it, reads the result back and compares it with the same computation
on the CPU. It runs in a child process, since a failing Metal driver may abort the process rather
than raise, and only when torch reports MPS available (elsewhere the answer is known at once). The
result is computed once per process.

    python -m flashattn_mps.mps_probe      # one line; exit code 0 when MPS computes here
"""

from __future__ import annotations

import functools
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

import torch

# The child's work: a result that depends on every element, compared exactly (integers held in
# float32 are exact, so any correct GPU gives the CPU's numbers).
_PROBE = """
import torch
x = torch.arange(4096, dtype=torch.float32)
on_mps = (x.to("mps") * 3 + 1).reshape(64, 64).sum(dim=1).cpu()
expected = (x * 3 + 1).reshape(64, 64).sum(dim=1)
print("ok" if torch.equal(on_mps, expected) else f"wrong result: {on_mps[:4].tolist()} != {expected[:4].tolist()}")
"""
PROBE_TIMEOUT_S = 120


@dataclass(frozen=True)
class MPSProbe:
    usable: bool  # MPS allocated, computed and read back the right numbers
    available: bool  # what torch.backends.mps.is_available() says
    virtual_machine: Optional[bool]  # macOS's kern.hv_vmm_present; None where unknown (not macOS)
    detail: str  # why, in one line

    def describe(self) -> str:
        machine = {True: "a virtual machine", False: "not a virtual machine", None: "machine kind unknown"}
        return f"MPS {'usable' if self.usable else 'not usable'}: {self.detail} ({machine[self.virtual_machine]})"


def is_virtual_machine() -> Optional[bool]:
    """True in a macOS virtual machine (kern.hv_vmm_present is 1), False on bare metal, None off
    macOS or when sysctl cannot say."""
    if sys.platform != "darwin":
        return None
    try:
        out = subprocess.run(["sysctl", "-n", "kern.hv_vmm_present"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    value = out.stdout.strip()
    return value == "1" if out.returncode == 0 and value in ("0", "1") else None


def run_probe(available: bool, virtual_machine: Optional[bool], python: str = sys.executable) -> MPSProbe:
    """The probe without the cache (tests pass `available`; the child runs `python`)."""
    if not available:
        return MPSProbe(
            False, False, virtual_machine, f"torch reports no MPS (built with MPS: {torch.backends.mps.is_built()})"
        )
    try:
        child = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return MPSProbe(
            False, True, virtual_machine, f"torch reports MPS available, but the probe hung for {PROBE_TIMEOUT_S} s"
        )
    last = (child.stdout.strip().splitlines() or [""])[-1]
    if child.returncode == 0 and last == "ok":
        return MPSProbe(True, True, virtual_machine, "torch reports MPS available and a probe computed on it correctly")
    errors = [line for line in child.stderr.strip().splitlines() if line.strip()]
    why = (
        last
        if child.returncode == 0
        else (errors[-1] if errors else f"the probe process exited with {child.returncode}")
    )
    return MPSProbe(False, True, virtual_machine, f"torch reports MPS available, but a probe on it failed: {why}")


@functools.cache
def probe() -> MPSProbe:
    """This machine's answer, computed once per process."""
    return run_probe(torch.backends.mps.is_available(), is_virtual_machine())


def usable() -> bool:
    """Whether MPS tensors compute here (the probe's verdict)."""
    return probe().usable


if __name__ == "__main__":
    result = probe()
    print(result.describe())
    raise SystemExit(0 if result.usable else 1)
