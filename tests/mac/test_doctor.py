"""python -m flashattn_mps.doctor: it runs every kernel-family parity check on MPS where the probe
finds MPS computing (a Mac), else on the CPU Metal device and says the Metal path was not checked,
and exits non-zero when a check fails; its Metal verdicts are checked against a fake backend (the
real one needs a Mac). Every test passes on a Mac with MPS and on a machine without."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types

import pytest
import torch

import flashattn_mps
from flashattn_mps import _C, _metal_mode, doctor, mps_probe

# Where the kernel checks run on this machine: decided by the same probe as the doctor's.
DEVICE = "mps" if doctor.metal_usable() else "cpu"


@pytest.mark.slow
def test_doctor_json_runs_every_parity_check_on_the_device_the_probe_found():
    result = subprocess.run([sys.executable, "-m", "flashattn_mps.doctor", "--json"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["metal_checked"] is (DEVICE == "mps") and report["kernel_device"] == DEVICE
    checks = {c["name"]: c for c in report["checks"]}
    if DEVICE == "cpu":
        assert checks["Metal path"]["status"] == "skipped" and "not checked" in checks["Metal path"]["detail"]
    else:
        assert "Metal path" not in checks and checks["stream mode"]["status"] == "ok"
    assert checks["torch MPS"]["data"]["usable"] is mps_probe.usable()
    parity = [c for c in report["checks"] if c["name"].startswith("parity ")]
    assert [c["name"] for c in parity] == [f"parity {case.name}" for case in doctor.PARITY_CASES]
    for c in parity:
        if c["status"] == "skipped":  # only a dtype torch cannot hold on the device (bfloat16 on macOS 13)
            assert DEVICE == "mps" and "torch has no" in c["detail"], c
            continue
        assert c["status"] == "ok", c
        assert c["data"]["device"] == DEVICE and 0 <= c["data"]["error"] <= c["data"]["tolerance"]
    assert checks["versions"]["data"]["torch"] == torch.__version__
    assert checks["timing"]["status"] == ("ok" if DEVICE == "mps" else "skipped")
    families = {case.family for case in doctor.PARITY_CASES} | {case.backward for case in doctor.PARITY_CASES}
    assert families == {"fa_forward", "fa_decode", True, False}


def one_case(monkeypatch, case=None):
    monkeypatch.setattr(doctor, "PARITY_CASES", [case or doctor.PARITY_CASES[0]])


def test_a_wrong_result_fails_the_check_and_the_exit_code(monkeypatch, capsys):
    one_case(monkeypatch)
    monkeypatch.setattr(doctor, "_flash", lambda q, k, v, mask, causal: doctor.flash_attention(q, k, v) + 1e-3)
    assert doctor.main(["--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    (check,) = [c for c in report["checks"] if c["name"] == "parity forward float32"]
    assert check["status"] == "failed" and " > tolerance " in check["detail"]


def test_a_raising_kernel_is_a_failed_line_not_a_crash(monkeypatch, capsys):
    one_case(monkeypatch, doctor.Case("backward", torch.float32, (1, 1, 1, 8, 8, 8), backward=True))

    def broken(*args, **kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr(doctor, "flash_attention", broken)
    assert doctor.main([]) == 1
    out = capsys.readouterr().out
    assert "failed  parity backward" in out and "RuntimeError: planted" in out
    assert ("The Metal path was not checked" in out) is (DEVICE == "cpu")


def test_the_plan_must_run_the_family_the_case_names(monkeypatch, capsys):
    one_case(monkeypatch, doctor.Case("not decode", torch.float32, (1, 2, 2, 48, 40, 64), family="fa_decode"))
    assert doctor.main([]) == 1
    assert "the plan runs fa_forward" in capsys.readouterr().out


def fake_backend(**info):
    base = dict(
        name="Apple M1",
        registry_id=0x10,
        chosen_by="torch's MPS command buffer",
        low_power=False,
        families={"Apple7": True, "Apple8": False, "Apple9": False, "Mac2": True, "Metal3": True},
        max_threadgroup_memory=32768,
        torch_registry_id=0x10,
        language_version=310,
        fast_math=False,
        math_mode=0,
        math_fp32_functions=1,
        stream_mode=1,
        debug=False,
        check_buffers=True,
    )
    base.update(info)
    return types.SimpleNamespace(
        HAS_METAL_BACKEND=True,
        METAL_OWN_QUEUE=0,
        metal_device_info=lambda: base,
        metal_torch_symbols=lambda: {"_ZN5torch3mps18get_command_bufferEv": True},
        metal_object_class=lambda handle: "AGXG13GFamilyBuffer",
        metal_check_buffer=lambda handle, n: None,
    )


def metal_lines(monkeypatch, backend, decision):
    monkeypatch.setattr(doctor, "metal_usable", lambda: True)
    monkeypatch.setattr(doctor, "_C", backend)
    monkeypatch.setattr(_metal_mode, "current", lambda: decision)
    return {c.name: c for c in doctor.metal_checks()}


def test_metal_verdicts(monkeypatch):
    stream = _metal_mode.Decision(_C.METAL_TORCH_STREAM, _C.METAL_TORCH_STREAM, False, True, "torch 2.13.0 >= 2.9", ())
    good = metal_lines(monkeypatch, fake_backend(), stream)
    for name in ("stream mode", "torch symbols", "Metal device", "GPU families", "compile options"):
        assert good[name].status == "ok", good[name]
    assert (
        "same" in good["Metal device"].detail
        and "MSL 3.1, mathMode safe, FP32 functions precise" == good["compile options"].detail
    )
    # The fake backend accepts any buffer; without MPS the buffer line's own failure to allocate
    # one is reported, not raised (a runner's paravirtual MPS may allocate or not).
    expected = {"ok"} if mps_probe.usable() else {"ok", "failed"} if mps_probe.probe().available else {"failed"}
    assert good["MPS buffer"].status in expected, good["MPS buffer"]

    fallback = _metal_mode.Decision(
        _C.METAL_TORCH_STREAM, _C.METAL_OWN_QUEUE, False, True, "r", ("_ZN5torch3mps11synchronizeEv",)
    )
    bad = metal_lines(
        monkeypatch,
        fake_backend(torch_registry_id=0x20, fast_math=True, math_mode=-1, families={"Apple7": False, "Mac2": True}),
        fallback,
    )
    assert bad["stream mode"].status == "failed" and "synchronizeEv" in bad["stream mode"].detail
    assert bad["Metal device"].status == "failed" and "DIFFERENT" in bad["Metal device"].detail
    assert bad["GPU families"].status == "failed" and "Apple7" in bad["GPU families"].detail
    assert bad["compile options"].status == "failed" and "fastMathEnabled YES" in bad["compile options"].detail


def test_a_dtype_torch_cannot_hold_on_the_device_is_skipped(monkeypatch, capsys):
    one_case(monkeypatch, doctor.Case("forward bfloat16", torch.bfloat16, (1, 1, 1, 8, 8, 8)))
    real_zeros = torch.zeros

    def zeros(*args, dtype=None, device=None, **kwargs):
        if dtype == torch.bfloat16:
            raise TypeError("BFloat16 is not supported on MPS")
        return real_zeros(*args, dtype=dtype, device=device, **kwargs)

    monkeypatch.setattr(torch, "zeros", zeros)
    assert doctor.main([]) == 0
    assert "skipped parity forward bfloat16" in capsys.readouterr().out


def test_the_mps_line_follows_the_probe_not_is_available(monkeypatch):
    def line(**probe):
        monkeypatch.setattr(mps_probe, "probe", lambda: mps_probe.MPSProbe(**probe))
        return doctor._mps_check()

    works = line(usable=True, available=True, virtual_machine=False, detail="d")
    assert works.status == "ok" and works.data["usable"] is True
    # GitHub's macOS runners: MPS reported, not computing, in a VM -> skipped, so the run can pass
    runner = line(usable=False, available=True, virtual_machine=True, detail="failed: out of memory")
    assert runner.status == "skipped" and "a virtual machine" in runner.detail and "out of memory" in runner.detail
    # the same on bare metal is a broken Mac: failed
    assert line(usable=False, available=True, virtual_machine=False, detail="d").status == "failed"
    assert line(usable=False, available=False, virtual_machine=None, detail="no MPS").status == "skipped"
    monkeypatch.setattr(doctor, "_C", types.SimpleNamespace(HAS_METAL_BACKEND=True))
    monkeypatch.setattr(mps_probe, "usable", lambda: False)
    assert doctor.metal_usable() is False  # a macOS build on a runner: the kernel checks go to the CPU device


def test_dropout_generator_line(monkeypatch):
    assert doctor.dropout_generator_check("cpu").status == "ok"
    rng = torch.get_rng_state()
    monkeypatch.setattr(doctor._core, "dropout_rng_state", lambda device: torch.zeros(4, dtype=torch.int32))
    broken = doctor.dropout_generator_check("cpu")
    assert broken.status == "failed" and "two draws were equal" in broken.detail and "every word was 0" in broken.detail
    assert torch.equal(torch.get_rng_state(), rng)


def test_every_kernel_of_every_library_is_a_pipeline_to_build():
    from flashattn_mps import _sources, metal_offline_check

    items = metal_offline_check.pipeline_items()
    for source, text in _sources.kernel_sources().items():
        kernels = {item.function.rsplit("_", 1)[0] for item in items if item.source == source}
        assert kernels == set(re.findall(r'FA_HOST_NAME\("(\w+)"\)', text)), source
    specialisations = {(s, tuple(map(tuple, m))) for s, _, m in _C.specialisations()}
    assert {(item.source, item.macros) for item in items} == specialisations
    dq = next(item for item in items if item.function.startswith("fa_backward_dq_"))
    assert dict((i, kind) for i, kind, _ in dq.constants)[_C.FC_DROPOUT] == "int"


def test_pipelines_mode_prints_what_metal_decided_and_fails_on_an_error(monkeypatch, capsys):
    def build(source, function, macros, constants):
        if function == "fa_sequence_table_half":
            raise flashattn_mps.MetalCompileError("Metal pipeline fa_sequence_table_half: planted")
        return {
            "max_total_threads_per_threadgroup": 1024,
            "static_threadgroup_memory_length": 0,
            "thread_execution_width": 32,
        }

    monkeypatch.setattr(doctor, "_C", types.SimpleNamespace(HAS_METAL_BACKEND=True, metal_pipeline_info=build))
    assert doctor.main(["--pipelines", "--sources", "fa_simple.metal"]) == 1
    out = capsys.readouterr().out
    assert out.count("ok      pipeline fa_simple.metal") == 5 and "maxTotalThreadsPerThreadgroup 1024" in out
    assert "failed  pipeline fa_simple.metal fa_sequence_table_half" in out and "planted" in out
    assert "5 of 6 pipelines built" in out


def test_pipelines_mode_off_macos_says_why(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "_C", types.SimpleNamespace(HAS_METAL_BACKEND=False))
    assert doctor.main(["--pipelines"]) == 2
    assert "needs macOS" in capsys.readouterr().err
