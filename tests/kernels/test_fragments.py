"""Which plans fold the head-dim guards (FA_FC_EXACT_HEAD_DIMS) and take bfloat operand fragments
(FA_BFLOAT_FRAGMENTS, Apple9/10 only), what the register budgets count for them, and that bfloat
fragments give float fragments' results to the bit (metal/fa_fragments.h, fa_head_blocks.h)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from flashattn_mps import explain_plan, flash_attention
from helpers import ALL_DTYPES, randn

FC_EXACT_HEAD_DIMS = 21  # metal/fa_params.h


def tiled_dispatches(dtype, e, ev, gpu="apple9"):
    q, k, v = (torch.empty(1, 4, 100, d, dtype=dtype) for d in (e, e, ev))
    forward = explain_plan(q, k, v, kernel="forward", gpu=gpu)["dispatches"]
    # the simdgroup dK/dV and dQ (AUTO takes the tensor backward on Apple10)
    backward = explain_plan(q, k, v, kernel="forward", backward=True, gpu=gpu)["dispatches"][1:]
    return forward + backward


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("e, ev", [(64, 64), (128, 128), (72, 72), (128, 64), (256, 256), (576, 512)])
def test_exact_head_dims_is_set_when_the_dims_are_the_widths(dtype, e, ev):
    for d in tiled_dispatches(dtype, e, ev):
        exact = e == int(d["macros"]["FA_BD"]) and ev == int(d["macros"]["FA_BDV"])
        assert d["constants"][FC_EXACT_HEAD_DIMS] == int(exact), (d["function"], d["macros"])


def test_exact_head_dims_follows_each_kernels_own_tiles():
    # float16 at D = 256 on Apple9: the forward keeps 256 resident, dK/dV and dQ block in 128 columns
    forward, dkdv, dq = tiled_dispatches(torch.float16, 256, 256)
    assert forward["constants"][FC_EXACT_HEAD_DIMS] == 1
    assert dkdv["macros"]["FA_BD"] == dq["macros"]["FA_BD"] == "128"
    assert dkdv["constants"][FC_EXACT_HEAD_DIMS] == dq["constants"][FC_EXACT_HEAD_DIMS] == 0
    assert all(d["constants"][FC_EXACT_HEAD_DIMS] == 1 for d in tiled_dispatches(torch.float32, 64, 64))


@pytest.mark.parametrize("gpu, bfloat", [("apple7", False), ("apple8", False), ("apple9", True), ("apple10", True)])
def test_bfloat_fragments_by_family(gpu, bfloat):
    for dtype in ALL_DTYPES:
        for d in tiled_dispatches(dtype, 128, 128, gpu):
            expected = "1" if bfloat and dtype == torch.bfloat16 else None
            assert d["macros"].get("FA_BFLOAT_FRAGMENTS") == expected, (gpu, dtype, d["function"])


def test_bfloat_fragments_take_half_fragments_registers():
    # Apple9/10: bfloat16 takes float16's tiles and registers (one per operand fragment); Apple7/8
    # keep float operand fragments, so bfloat16 costs more than float16 there at the same widths.
    for e in (64, 128, 256):
        bf16, fp16 = tiled_dispatches(torch.bfloat16, e, e), tiled_dispatches(torch.float16, e, e)
        assert [(d["macros"]["FA_BD"], d["cost"]["registers"]) for d in bf16] == [
            (d["macros"]["FA_BD"], d["cost"]["registers"]) for d in fp16
        ]
    bf16, fp16 = tiled_dispatches(torch.bfloat16, 64, 64, "apple7"), tiled_dispatches(torch.float16, 64, 64, "apple7")
    assert all(b["cost"]["registers"] > h["cost"]["registers"] for b, h in zip(bf16, fp16))
    # the forward at D = 128: Q 16 + O 32 + S 8 + a K/V fragment in flight 1
    assert tiled_dispatches(torch.bfloat16, 128, 128)[0]["cost"]["registers"] == 57


CHILD = """
import sys, torch
from flashattn_mps import explain_plan, flash_attention
q = torch.empty(1, 2, 70, 64, dtype=torch.bfloat16)
plan = explain_plan(q, q, q, causal=True)
assert plan["gpu_family"] == "apple7" and "FA_BFLOAT_FRAGMENTS" not in plan["dispatches"][0]["macros"]
inputs = torch.load(sys.argv[1])
q, k, v, dout = (t.requires_grad_(i < 3) for i, t in enumerate(inputs))
out = flash_attention(q, k, v, causal=True)
out.backward(dout)
torch.save([out.detach(), q.grad, k.grad, v.grad], sys.argv[2])
"""


def test_bfloat_fragments_give_the_float_fragments_bits(tmp_path):
    """bfloat16 at D = 64, where Apple7 and Apple9 choose the same tiles: Apple9's bfloat operand
    fragments (this process) and Apple7's float ones (a child process planning for Apple7) give the
    same output and gradients, bit for bit (a bfloat product is exact in float32)."""
    gen = torch.Generator().manual_seed(3)
    inputs = [randn(gen, 1, 2, 70, 64, dtype=torch.bfloat16) for _ in range(4)]
    torch.save(inputs, tmp_path / "inputs.pt")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, FLASHATTN_MPS_GPU_FAMILY="apple7")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "inputs.pt"), str(tmp_path / "apple7.pt")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    q, k, v, dout = (t.clone().requires_grad_(i < 3) for i, t in enumerate(inputs))
    [plan] = explain_plan(q, k, v, causal=True)["dispatches"]
    assert plan["macros"].get("FA_BFLOAT_FRAGMENTS") == "1"
    out = flash_attention(q, k, v, causal=True)
    out.backward(dout)
    apple7 = torch.load(tmp_path / "apple7.pt")
    for name, mine, theirs in zip(("out", "dq", "dk", "dv"), (out.detach(), q.grad, k.grad, v.grad), apple7):
        assert torch.equal(mine.view(torch.int16), theirs.view(torch.int16)), name
