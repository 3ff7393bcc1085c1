"""flashattn_mps.mps_probe: MPS is used only where a probe computes on it, since GitHub's macOS
runners report MPS available and cannot compute. The child process is replaced by small scripts
that act as a working, a failing and a crashing MPS."""

from __future__ import annotations

import sys

import torch

from flashattn_mps import mps_probe


def fake_python(tmp_path, body: str) -> str:
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)
    return str(script)


def test_the_verdict_comes_from_what_the_child_computed(tmp_path):
    works = mps_probe.run_probe(True, False, fake_python(tmp_path, "echo ok"))
    assert works.usable and works.available and "computed on it correctly" in works.describe()
    # a runner's paravirtual GPU: torch raises on the first allocation
    message = "RuntimeError: MPS backend out of memory (MPS allocated: 0 bytes, max allowed: 0 bytes)"
    oom = mps_probe.run_probe(True, True, fake_python(tmp_path, f"echo 'Traceback' >&2; echo '{message}' >&2; exit 1"))
    assert not oom.usable and oom.available and message in oom.detail and "a virtual machine" in oom.describe()
    wrong = mps_probe.run_probe(True, None, fake_python(tmp_path, "echo 'wrong result: [0.0] != [1.0]'"))
    assert not wrong.usable and "wrong result" in wrong.detail
    aborted = mps_probe.run_probe(True, True, fake_python(tmp_path, "kill -ABRT $$"))
    assert not aborted.usable and "exited with" in aborted.detail


def test_without_mps_no_child_runs(tmp_path):
    result = mps_probe.run_probe(False, None, fake_python(tmp_path, "exit 3"))
    assert not result.usable and not result.available and "torch reports no MPS" in result.detail


def test_the_real_probe_fails_where_torch_has_no_mps():
    if torch.backends.mps.is_available():
        assert mps_probe.probe().available
        return
    # asked to try anyway (as a runner's torch would), the child's torch refuses the device
    result = mps_probe.run_probe(True, mps_probe.is_virtual_machine(), sys.executable)
    assert not result.usable and "mps" in result.detail.lower(), result
    assert mps_probe.probe() == mps_probe.run_probe(False, mps_probe.is_virtual_machine())
    if sys.platform != "darwin":
        assert mps_probe.is_virtual_machine() is None
