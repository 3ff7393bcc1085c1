"""The planner's GPU families (csrc/fa_gpu_family.c): explain_plan(gpu=...) plans for each, Apple7/8
keep every D = 128 configuration within 96 fragment registers and 15 KiB of threadgroup memory, the
estimate's figures follow from its named model, and the CPU device runs the configurations of the
family FLASHATTN_MPS_GPU_FAMILY names (apple9 by default, the rest of the suite's) to the tested
tolerances."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest
import torch

from flashattn_mps import _C, explain_plan, flash_attention
from helpers import ALL_DTYPES, FUDGE, core_options, max_error, randn

FAMILIES = ["apple7", "apple8", "apple9", "apple10"]


def plans(dtype, d, gpu, l=256):
    q = torch.empty(1, 8, l, d, dtype=dtype)
    forward = explain_plan(q, q, q, gpu=gpu)
    backward = explain_plan(q, q, q, gpu=gpu, backward=True)
    return forward, backward


@pytest.mark.parametrize("gpu", FAMILIES)
def test_explain_plan_names_the_family_it_planned_for(gpu):
    forward, backward = plans(torch.float16, 128, gpu)
    assert forward["gpu_family"] == backward["gpu_family"] == gpu
    for d in forward["dispatches"] + backward["dispatches"]:
        assert d["estimate"]["gpu_family"] == gpu and "no spill" in d["estimate"]["assumptions"]


@pytest.mark.parametrize("gpu", ["apple7", "apple8"])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_apple7_and_apple8_budgets_at_d128(gpu, dtype):
    forward, backward = plans(dtype, 128, gpu)
    for d in forward["dispatches"] + backward["dispatches"][1:]:  # the delta pre-pass has no tiles
        cost = d["cost"]
        assert cost["registers"] <= 96, (d["function"], cost["registers"])
        assert cost["threadgroup_bytes"] <= 15 * 1024, (d["function"], cost["threadgroup_bytes"])


def test_apple9_keeps_the_wider_tiles():
    """Apple9's dynamic caching takes the larger tiles (BK 32 at D = 128 in fp16), Apple7 halves BK
    to fit its tile cap and blocks dK/dV in 64 columns to fit its register budget."""
    forward9, backward9 = plans(torch.float16, 128, "apple9")
    forward7, backward7 = plans(torch.float16, 128, "apple7")
    assert forward9["dispatches"][0]["macros"]["FA_BK"] == "32" and forward7["dispatches"][0]["macros"]["FA_BK"] == "16"
    assert backward9["dispatches"][1]["macros"]["FA_BD"] == "128"
    assert backward7["dispatches"][1]["macros"]["FA_BD"] == "64"
    assert backward7["dispatches"][1]["grid"][1] == 2 * backward9["dispatches"][1]["grid"][1]  # 2 column blocks


def test_estimate_follows_its_model():
    """fp16 forward at D = 128 on Apple7: 53 fragment registers + 32 overhead = 85; 208 KiB /
    (85 x 4 B x 128 threads) = 4 threadgroups by registers, 60 KiB / 8712 B = 7 by threadgroup
    memory: 4 resident, 16 SIMD-groups, 16 / 24 busy; no padding at D = 128 and L = 256."""
    forward, _ = plans(torch.float16, 128, "apple7")
    e = forward["dispatches"][0]["estimate"]
    assert (e["fragment_registers"], e["registers"], e["threadgroup_bytes"]) == (53, 85, 8712)
    assert (e["resident_threadgroups"], e["resident_simd_groups"]) == (4, 16)
    assert e["occupancy"] == pytest.approx(16 / 24) and e["fraction_of_peak"] == pytest.approx(16 / 24)


def test_bad_family_is_refused():
    q = torch.empty(1, 1, 8, 16)
    with pytest.raises(ValueError, match="gpu must be None"):
        explain_plan(q, q, q, gpu="apple6")
    tensors = {"q": q, "k": q, "v": q, "out": torch.empty_like(q), "rng_state": torch.zeros(4)}
    with pytest.raises(ValueError, match=r"gpu_family: must be 0 \(the device's\) or 7 to 10"):
        _C.plan_forward(_C.DEVICE_CPU, tensors, core_options(scale=1.0, gpu_family=6))


def gradients(q, k, v, dout, attention):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves)
    out.backward(dout)
    return [out] + [t.grad for t in leaves]


def sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def assert_matches_sdpa(dtype, e, gen):
    """Forward and gradients at head dim e against float64, within the suite's tolerance rule."""
    q, k, v = (randn(gen, 1, 2, n, e, dtype=dtype) for n in (70, 70, 70))
    dout = randn(gen, 1, 2, 70, e, dtype=dtype)
    golden = gradients(q.double(), k.double(), v.double(), dout.double(), sdpa)
    reference = gradients(q, k, v, dout, sdpa)
    actual = gradients(q, k, v, dout, lambda *t: flash_attention(*t, causal=True))
    for name, a, g, r in zip(("out", "dq", "dk", "dv"), actual, golden, reference):
        tolerance = max(1e-5, FUDGE.get(name, 5.0) * max_error(r, g))
        assert max_error(a, g) <= tolerance, f"{dtype} E={e} {name}: {max_error(a, g):.3e} > {tolerance:.3e}"


def test_the_cpu_device_plans_for_apple9_by_default():
    q = torch.empty(1, 2, 70, 128)
    assert explain_plan(q, q, q)["gpu_family"] == os.environ.get("FLASHATTN_MPS_GPU_FAMILY", "apple9")


CHILD = """
import torch
from flashattn_mps import explain_plan
import test_gpu_family as t
q = torch.empty(1, 2, 70, 128)
assert explain_plan(q, q, q)["gpu_family"] == "apple7"
gen = torch.Generator().manual_seed(1)
for dtype in (torch.float16, torch.bfloat16, torch.float32):
    t.assert_matches_sdpa(dtype, 128, gen)
t.assert_matches_sdpa(torch.float16, 256, gen)
t.assert_matches_sdpa(torch.float32, 64, gen)
print("ok")
"""


def child_env(family):
    env = dict(os.environ, FLASHATTN_MPS_GPU_FAMILY=family)
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([here, os.path.dirname(here), env.get("PYTHONPATH", "")])
    return env


def test_cpu_device_runs_the_family_the_environment_names():
    """FLASHATTN_MPS_GPU_FAMILY=apple7: the planner takes Apple7's tiles (BK 16 or 8 at D = 128, dK/dV
    and float dQ in 64-column blocks, 3 x 96 and 4 x 64 blocks at 256) and they run and match (a
    fresh process: the variable is read once)."""
    run = subprocess.run([sys.executable, "-c", CHILD], env=child_env("apple7"), capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


@pytest.mark.slow
def test_bad_environment_family_is_a_clear_error():
    child = "import torch, flashattn_mps as f; q = torch.empty(1, 1, 8, 16); f.explain_plan(q, q, q)"
    run = subprocess.run([sys.executable, "-c", child], env=child_env("m1"), capture_output=True, text=True)
    assert (
        run.returncode != 0
        and "FLASHATTN_MPS_GPU_FAMILY: must be apple7, apple8, apple9 or apple10 (or unset)" in run.stderr
    )


def test_benchmark_fractions_use_the_chips_figures_and_the_plans_estimate(tmp_path):
    """benchmarks/peak_fractions.py: an M1 (8 cores x 256 FLOPs x 1.278 GHz = 2.617 TFLOPS, 68.25
    GB/s) turns a forward row's useful TFLOPS and a decode row's GB/s into fractions, and puts
    explain_plan's Apple7 estimate beside this project's rows only."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "peak_fractions.py")
    spec = importlib.util.spec_from_file_location("peak_fractions", path)
    fractions = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fractions)
    common = dict(device="MPS", batch=1, head_dim=128, dtype="float16", ms=1.0)
    forward = [
        dict(common, impl=impl, heads=16, seq=4096, causal=False, useful_tflops=1.3085)
        for impl in ("flash_attention", "torch_sdpa")
    ]
    decode = [dict(common, impl="flash_attention", q_heads=32, kv_heads=4, kv_len=4096, kv_gb_per_s=34.125)]
    for name, rows in (("attention", forward), ("decode", decode)):
        with open(tmp_path / f"{name}_mps.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    fractions.main(["--results", str(tmp_path), "--tag", "mps", "--chip", "M1"])
    with open(tmp_path / "fractions_mps.csv", newline="") as f:
        out = list(csv.DictReader(f))
    assert [(r["kind"], r["impl"], r["gpu_family"]) for r in out] == [
        ("forward", "flash_attention", "apple7"),
        ("forward", "torch_sdpa", "apple7"),
        ("decode", "flash_attention", "apple7"),
    ]
    assert [float(r["measured_fraction"]) for r in out] == pytest.approx([0.5, 0.5, 0.5], rel=1e-3)
    q = torch.empty(1, 16, 4096, 128, dtype=torch.float16)
    estimate = explain_plan(q, q, q, kernel="forward", gpu="apple7")["dispatches"][0]["estimate"]
    assert float(out[0]["estimated_fraction"]) == pytest.approx(estimate["fraction_of_peak"])
    assert out[1]["estimated_fraction"] == "" and 0 < float(out[2]["estimated_fraction"]) <= 1
