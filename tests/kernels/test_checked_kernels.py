"""The project's kernels on the CPU Metal device in checked mode (docs/cpu-device.md, "Checked mode"):
switching modes switches the kernels, and a sample of the planner's paths and variants, forward and
backward, runs with nothing reported and gives the same bits as unchecked."""

import pytest
import torch
import torch.nn.functional as F

import flashattn_mps
from flashattn_mps import metal_cpu as mc


def test_switching_modes_switches_the_project_kernels(checked_core):
    q = torch.randn(1, 2, 20, 64)
    mc.set_checked(False)
    unchecked = flashattn_mps.flash_attention(q, q, q)  # a plan cached for this shape, unchecked
    count = checked_core()
    mc.set_checked(True)
    assert torch.equal(flashattn_mps.flash_attention(q, q, q), unchecked) and checked_core() == count + 1
    mc.set_checked(False)
    flashattn_mps.flash_attention(q, q, q)
    assert checked_core() == count + 1


# (kernel, B, Hq, Hkv, L, S, E, options): a sample of the planner's paths and variants.
CASES = [
    ("forward", 1, 2, 2, 40, 70, 64, {"causal": True}),
    ("forward", 1, 4, 2, 33, 50, 64, {"mask": "bool"}),
    ("forward", 1, 2, 1, 20, 64, 64, {"mask": "float", "softcap": 5.0}),
    ("forward", 1, 2, 2, 48, 48, 64, {"window_size": (8, 4), "alibi": True}),
    ("decode", 1, 4, 2, 1, 1100, 64, {}),  # long enough to split the keys over threadgroups
    ("decode", 2, 2, 2, 3, 40, 64, {"mask": "bool"}),
    ("decode", 1, 2, 2, 4, 40, 64, {"causal": "bottom_right"}),
    ("simple", 1, 2, 2, 9, 30, 64, {"causal": True}),
]


@pytest.mark.parametrize("kernel, B, Hq, Hkv, L, S, E, options", CASES)
def test_project_kernels_run_clean(checked_core, kernel, B, Hq, Hkv, L, S, E, options):
    torch.manual_seed(L * S)
    q, k, v = torch.randn(B, Hq, L, E), torch.randn(B, Hkv, S, E), torch.randn(B, Hkv, S, E)
    kwargs = {key: value for key, value in options.items() if key in ("causal", "softcap", "window_size")}
    if options.get("mask") == "bool":
        kwargs["attn_mask"] = torch.rand(L, S) > 0.3
    elif options.get("mask") == "float":
        kwargs["attn_mask"] = torch.randn(1, Hq, L, S)
    if options.get("alibi"):
        kwargs["alibi_slopes"] = torch.rand(Hq)
    if kernel == "decode" and L == 1:
        assert flashattn_mps.explain_plan(q, k, v, kernel=kernel, **kwargs)["split_count"] > 1
    out = flashattn_mps.flash_attention(q, k, v, kernel=kernel, **kwargs)
    assert checked_core() >= 1
    mc.set_checked(False)  # the same call unchecked gives the same bits
    assert torch.equal(out, flashattn_mps.flash_attention(q, k, v, kernel=kernel, **kwargs))


@pytest.mark.parametrize("causal, masked, L, S", [(True, False, 40, 56), (False, True, 24, 70)])
def test_project_backward_runs_clean(checked_core, causal, masked, L, S):
    torch.manual_seed(S)
    q, k, v = (torch.randn(1, 2, n, 64, requires_grad=True) for n in (L, S, S))
    mask = torch.rand(L, S) > 0.3 if masked else None
    grad = torch.randn(1, 2, L, 64)
    flashattn_mps.flash_attention(q, k, v, causal=causal, attn_mask=mask).backward(grad)
    assert checked_core() >= 4  # the forward, then the backward's delta, dK/dV and dQ
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, is_causal=causal).backward(grad.double())
    for got, want in ((q.grad, qr.grad), (k.grad, kr.grad), (v.grad, vr.grad)):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=0)
