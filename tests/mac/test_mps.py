"""The Metal backend on a real Apple GPU: the same parity checks as on the CPU Metal device, for MPS
tensors. They run wherever MPS computes (a Mac with Apple silicon), as decided by a probe that
computes on it: GitHub's macOS runners report MPS available and cannot compute, and CI's Linux
machines have none, so there these tests are reported as skipped (with the probe's reason), never
as passed."""

from __future__ import annotations

import platform

import pytest
import torch

import flashattn_mps
from flashattn_mps import mps_probe
from flashattn_mps._sdpa import torch_sdpa  # torch's SDPA with enable_gqa also on torch 2.4
from helpers import ALL_DTYPES, max_error, randn

pytestmark = pytest.mark.skipif(not mps_probe.usable(), reason=f"needs an Apple GPU: {mps_probe.probe().describe()}")


def macos_major() -> int:
    version = platform.mac_ver()[0]
    return int(version.split(".")[0]) if version else 0


# MPS has bfloat16 from macOS 14 on; on macOS 13 torch cannot hold it on the device.
DTYPES = [
    pytest.param(
        dtype,
        marks=pytest.mark.skipif(dtype == torch.bfloat16 and macos_major() < 14, reason="MPS bf16 needs macOS 14"),
    )
    for dtype in ALL_DTYPES
]


def to_mps(*tensors):
    return [t.to("mps") for t in tensors]


def check(out, q, k, v, factor=5.0, **kwargs):
    golden = torch_sdpa(q.double(), k.double(), v.double(), enable_gqa=True, **kwargs)
    reference = torch_sdpa(q, k, v, enable_gqa=True, **kwargs)
    assert max_error(out.cpu(), golden) <= max(1e-5, factor * max_error(reference, golden))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lq,lk", [(1, 300), (5, 2000), (113, 203), (1024, 1024)])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_on_metal(gen, dtype, lq, lk, causal):
    q, k, v = (
        randn(gen, 2, 8, lq, 64, dtype=dtype),
        randn(gen, 2, 2, lk, 64, dtype=dtype),
        randn(gen, 2, 2, lk, 64, dtype=dtype),
    )
    out = flashattn_mps.flash_attention(*to_mps(q, k, v), causal=causal)
    assert out.device.type == "mps"
    check(out, q, k, v, is_causal=causal)


def test_strided_views_and_masks_on_metal(gen):
    q = randn(gen, 2, 40, 4, 96).transpose(1, 2)
    k = randn(gen, 2, 50, 4, 96).transpose(1, 2)
    v = randn(gen, 2, 50, 4, 96).transpose(1, 2)
    mask = torch.rand(2, 1, 1, 50, generator=gen) > 0.2
    qm, km, vm, mm = to_mps(q, k, v, mask)
    check(flashattn_mps.scaled_dot_product_attention(qm, km, vm, attn_mask=mm), q, k, v, attn_mask=mask)


def test_backward_on_metal(gen):
    q, k, v = randn(gen, 1, 4, 70, 64), randn(gen, 1, 2, 90, 64), randn(gen, 1, 2, 90, 64)
    leaves = [t.to("mps").requires_grad_() for t in (q, k, v)]
    flashattn_mps.flash_attention(*leaves, causal=True).sum().backward()
    golden = [t.double().requires_grad_() for t in (q, k, v)]
    torch_sdpa(*golden, is_causal=True, enable_gqa=True).sum().backward()
    for ours, theirs in zip(leaves, golden):
        assert max_error(ours.grad.cpu(), theirs.grad) < 1e-3


@pytest.mark.skipif(not hasattr(torch.mps, "stream"), reason="torch.mps.stream needs torch 2.15")
def test_calls_under_another_mps_stream(gen):
    # torch 2.15's per-thread streams: inputs made and the output consumed on a non-default stream,
    # so our kernels must be ordered with that stream's work, not only with the default stream's
    q, k, v = randn(gen, 1, 4, 300, 64), randn(gen, 1, 2, 300, 64), randn(gen, 1, 2, 300, 64)
    stream = torch.mps.Stream() if hasattr(torch.mps, "Stream") else torch.Stream(device="mps")
    with torch.mps.stream(stream):
        qm, km, vm = (t.to("mps") * 1.0 for t in (q, k, v))
        out = flashattn_mps.flash_attention(qm, km, vm, causal=True) + 0.0
    torch.mps.synchronize()
    check(out, q, k, v, is_causal=True)


def test_a_loop_of_only_our_calls_completes_and_stays_right(gen):
    # stream mode commits each dispatch (as PyTorch's own custom-kernel example does), so many calls
    # with no torch op between them neither pile up in one command buffer nor lose ordering
    q, k, v = randn(gen, 1, 4, 64, 64), randn(gen, 1, 2, 64, 64), randn(gen, 1, 2, 64, 64)
    qm, km, vm = to_mps(q, k, v)
    outs = [flashattn_mps.flash_attention(qm, km, vm, causal=True) for _ in range(200)]
    torch.mps.synchronize()
    for out in outs[:: len(outs) // 4]:
        check(out, q, k, v, is_causal=True)
