"""The core's diagonal_offset (a band's fourth entry): row i's diagonal key is i + offset, for the
band (causal, windows) and ALiBi's origin, forward and backward; context parallelism's blocks are
built on it. Checked against a float64 reference that builds the same mask by hand."""

import math

import pytest
import torch

from flashattn_mps import _C
from flashattn_mps._core import backward_core, forward_core
from flashattn_mps._options import AttentionOptions, core_options

H, L, S, E, SCALE = 2, 40, 70, 16, 0.25


def reference(q, k, v, offset, causal, left, right, slopes):
    i = torch.arange(q.shape[-2])[:, None] + offset
    j = torch.arange(k.shape[-2])[None, :]
    keep = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool)
    if causal:
        keep &= j <= i
    if left >= 0:
        keep &= j >= i - left
    if right >= 0 and not causal:
        keep &= j <= i + right
    scores = (q @ k.transpose(-1, -2)) * SCALE
    if slopes is not None:
        scores = scores - slopes[:, None, None] * (i - j).abs()
    scores = scores.masked_fill(~keep, -math.inf)
    top = scores.amax(-1, keepdim=True).nan_to_num(neginf=0.0)
    weights = torch.exp(scores - top)
    total = weights.sum(-1, keepdim=True)
    return torch.where(total > 0, (weights / total.clamp_min(1e-300)) @ v, 0.0)


CASES = [
    (-50, True, -1, -1, False),  # every key after every row: no key seen
    (-10, False, 5, 7, False),
    (0, True, 8, -1, True),
    (15, False, -1, -1, True),
    (30, False, 1000, 3, False),  # a window wider than L + S
    (69, True, -1, -1, False),
    (100, False, 40, -1, True),  # a left window ending past every key
]


@pytest.mark.parametrize("offset, causal, left, right, alibi", CASES)
def test_diagonal_offset_matches_a_shifted_mask(offset, causal, left, right, alibi):
    gen = torch.Generator().manual_seed(offset + 1000)
    q, k, v = (torch.randn(1, H, n, E, generator=gen, dtype=torch.float64) for n in (L, S, S))
    slopes = torch.tensor([0.1, 0.3]) if alibi else None
    options = AttentionOptions(
        SCALE, causal, (0, left, right, offset), 0.0, None if slopes is None else slopes[None].expand(1, H)
    )
    q32, k32, v32 = q.float(), k.float(), v.float()
    out, lse = forward_core(q32, k32, v32, None, options, True)
    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
    ref = reference(
        ref_q[0], ref_k[0], ref_v[0], offset, causal, left, right, None if slopes is None else slopes.double()
    )
    assert (out[0].double() - ref).abs().max() < 1e-5
    dout = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    ref.backward(dout)
    grads = backward_core(dout[None].float(), q32, k32, v32, out, lse, None, options)
    for got, want in zip(grads, (ref_q.grad, ref_k.grad, ref_v.grad)):
        assert (got.double() - want).abs().max() < 1e-4


def test_diagonal_offset_is_checked():
    q = torch.randn(1, 1, 4, 8)
    options = core_options(0.5, True, (0, -1, -1, 2**31 - 2))
    with pytest.raises(ValueError, match="diagonal_offset"):
        _C.forward(_C.DEVICE_CPU, {"q": q, "k": q, "v": q, "out": torch.empty_like(q)}, options)
