"""The Metal backend on a real Apple GPU: the same parity checks as on the CPU Metal device, for MPS
tensors. They run wherever torch has MPS (a Mac with Apple silicon); CI's Linux machines and
GitHub's macOS runners have none, so there they are reported as skipped, never as passed."""

from __future__ import annotations

import pytest
import torch

import flashattn_mps
from flashattn_mps._sdpa import torch_sdpa  # torch's SDPA with enable_gqa also on torch 2.4
from helpers import ALL_DTYPES, max_error, randn

pytestmark = pytest.mark.skipif(not torch.backends.mps.is_available(), reason="needs an Apple GPU (torch MPS)")


def to_mps(*tensors):
    return [t.to("mps") for t in tensors]


def check(out, q, k, v, factor=5.0, **kwargs):
    golden = torch_sdpa(q.double(), k.double(), v.double(), enable_gqa=True, **kwargs)
    reference = torch_sdpa(q, k, v, enable_gqa=True, **kwargs)
    assert max_error(out.cpu(), golden) <= max(1e-5, factor * max_error(reference, golden))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
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
