"""Empty dimensions (B, H, L, S, E or Ev of 0) in every API: SDPA's result (shapes, dtype, zeros
for rows without keys, the mean of v for E = 0), flash-attn's log-sum-exp (+inf for rows without
keys), gradients of the right shapes, and no kernel launched where nothing is left to compute. The
C core refuses an empty tensor in a call that launches kernels."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
import torch.nn.functional as F

from flashattn_mps import (
    _C,
    explain_plan,
    explain_varlen_plan,
    flash_attention,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    patch,
)
from helpers import BACKWARD_NAMES, FORWARD_NAMES, core_options, max_error, randn, slots

# (B, H, L, S, E, Ev, causal) with at least one empty dim: E alone, Ev alone and S alone always,
# then a fixed sample of the rest (L < S, so every causal row sees a key).
_EMPTY = [c for c in itertools.product((0, 2), (0, 2), (0, 5), (0, 6), (0, 8), (0, 8), (False, True)) if 0 in c[:6]]
CASES = sorted(
    {(2, 2, 5, 6, 0, 8, True), (2, 2, 5, 6, 8, 0, False), (2, 2, 5, 0, 8, 8, True)}
    | set(random.Random(17).sample(_EMPTY, 9))
)


def _reference(q, k, v, causal):
    """SDPA's out and the log-sum-exp of each row's scaled scores, in float64 (E = 0: every score 0)."""
    q, k, v = (t.double() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    scores = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if q.shape[-1] else 0.0)
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    return out, torch.logsumexp(scores, dim=-1)


@pytest.mark.parametrize("b, h, l, s, e, ev, causal", CASES)
def test_empty_dimension_in_every_api(gen, b, h, l, s, e, ev, causal, core_calls):
    q, k, v = randn(gen, b, h, l, e), randn(gen, b, h, s, e), randn(gen, b, h, s, ev)
    golden, golden_lse = _reference(q, k, v, causal)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    dout = randn(gen, *golden.shape)
    golden_grads = torch.autograd.grad(
        F.scaled_dot_product_attention(*leaves, is_causal=causal), leaves, dout.double(), allow_unused=True
    )

    grads_of = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attention(*grads_of, causal=causal, return_lse=True)
    assert out.shape == golden.shape and out.dtype == q.dtype and lse.shape == golden_lse.shape
    assert max_error(out, golden) < 1e-5 and max_error(lse, golden_lse) < 1e-5
    out.backward(dout)
    for got, want, t in zip((g.grad for g in grads_of), golden_grads, (q, k, v)):
        assert got.shape == t.shape and max_error(got, torch.zeros_like(t) if want is None else want) < 1e-5

    with patch(cpu=True):
        assert max_error(F.scaled_dot_product_attention(q, k, v, is_causal=causal), golden) < 1e-5

    # flash-attn's layout (B, L, H, D), without causal (its causal is bottom-right); its lse is +inf
    # for rows without keys
    golden, golden_lse = _reference(q, k, v, False)
    golden_grads = torch.autograd.grad(
        F.scaled_dot_product_attention(*leaves), leaves, dout.double(), allow_unused=True
    )
    flash_lse = golden_lse.masked_fill(golden_lse == -math.inf, math.inf)
    qf, kf, vf = (t.transpose(1, 2) for t in (q, k, v))
    out, lse, _ = flash_attn_func(qf, kf, vf, return_attn_probs=True)
    assert max_error(out, golden.transpose(1, 2)) < 1e-5 and max_error(lse, flash_lse) < 1e-5
    out, lse = flash_attn_with_kvcache(qf, kf, vf, cache_seqlens=s, return_softmax_lse=True)
    assert max_error(out, golden.transpose(1, 2)) < 1e-5 and max_error(lse, flash_lse) < 1e-5
    cu_q, cu_k = (torch.arange(b + 1, dtype=torch.int32) * n for n in (l, s))
    packed = [t.reshape(b * t.shape[1], h, t.shape[3]).requires_grad_() for t in (qf, kf, vf)]
    out, lse, _ = flash_attn_varlen_func(*packed, cu_q, cu_k, l, s, return_attn_probs=True)
    assert max_error(out, golden.transpose(1, 2).reshape(b * l, h, ev)) < 1e-5
    assert max_error(lse, flash_lse.transpose(0, 1).reshape(h, b * l)) < 1e-5
    out.backward(dout.transpose(1, 2).reshape(out.shape))
    for got, want, t in zip((p.grad for p in packed), golden_grads, (q, k, v)):
        want = torch.zeros_like(t) if want is None else want
        assert max_error(got, want.transpose(1, 2).reshape(got.shape)) < 1e-5

    if min(b, h, l, s) == 0:  # no row or no key: nothing for a kernel to compute
        assert core_calls["forward"] == 0 and core_calls["backward"] == 0
    # the plans say the same: Ev = 0 leaves nothing to compute but varlen's lse
    for backward in (False, True):
        plan = explain_plan(q, k, v, causal=causal, backward=backward)
        assert (plan["dispatches"] == []) == (min(b, h, l, s, ev) == 0)
        plan = explain_varlen_plan(*packed, cu_q, cu_k, l, s, backward=backward)
        assert (plan["dispatches"] == []) == (min(b, h, l, s, ev if backward else 1) == 0)


@pytest.mark.parametrize("dim, named", [("S", "k"), ("E", "q"), ("Ev", "v")])
def test_the_core_refuses_empty_tensors_in_a_launching_call(dim, named):
    b, h, l, s, e, ev = 1, 2, 3, 0 if dim == "S" else 4, 0 if dim == "E" else 8, 0 if dim == "Ev" else 8
    tensors = [torch.zeros(shape) for shape in ((b, h, l, e), (b, h, s, e), (b, h, s, ev), (b, h, l, ev))]
    lse = torch.zeros(b, h, l)
    with pytest.raises(ValueError, match=f"{named}: an empty tensor"):
        _C.forward(_C.DEVICE_CPU, slots(FORWARD_NAMES, (*tensors, lse)), core_options())
    args = (
        *tensors,
        lse,
        torch.zeros_like(tensors[3]),
        torch.zeros_like(lse),
        *(torch.zeros_like(t) for t in tensors[:3]),
    )
    with pytest.raises(ValueError, match=f"{named}: an empty tensor"):
        _C.backward(_C.DEVICE_CPU, slots(BACKWARD_NAMES, args), core_options())


@pytest.mark.parametrize("s, e", [(0, 8), (6, 0)])
def test_sinks_with_an_empty_dimension(gen, s, e):
    """No keys: each row's lse is its sink, out and dsinks are 0; E = 0: the sink joins zero scores."""
    q, k, v = randn(gen, 1, 2, 5, e), randn(gen, 1, 2, s, e), randn(gen, 1, 2, s, 8)
    sinks = randn(gen, 2).requires_grad_()
    out, lse = flash_attention(q, k, v, sinks=sinks, return_lse=True)
    golden_sinks = sinks.detach().double().requires_grad_()
    scores = q.double() @ k.double().transpose(-1, -2) * (1 / math.sqrt(e) if e else 0.0)
    logits = torch.cat([scores, golden_sinks.view(1, 2, 1, 1).expand(1, 2, 5, 1)], dim=-1)
    golden = logits.softmax(dim=-1)[..., :s] @ v.double()
    dout = randn(gen, 1, 2, 5, 8)
    out.backward(dout)
    golden.backward(dout.double())
    assert max_error(out, golden) < 1e-5 and max_error(lse, logits.logsumexp(dim=-1)) < 1e-5
    assert max_error(sinks.grad, golden_sinks.grad) < 1e-5
