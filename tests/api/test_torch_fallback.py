"""Calls the drop-in hands to torch work on every admitted torch: torch 2.4's SDPA has no
enable_gqa, so there the fallback repeats the key/value heads itself and leaves the argument out.

Each test runs on the installed torch and once more against a stand-in with torch 2.4's signature
(the installed SDPA, refusing enable_gqa), so the torch 2.4 path is proven on any torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashattn_mps import _sdpa, explain, scaled_dot_product_attention
from helpers import randn

_installed_sdpa = F.scaled_dot_product_attention


def _sdpa_of_torch_2_4(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    return _installed_sdpa(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
    )


@pytest.fixture(params=["installed torch", "torch 2.4's signature"])
def torch_sdpa(request, monkeypatch):
    if request.param != "installed torch":
        monkeypatch.setattr(_sdpa, "_original_sdpa", _sdpa_of_torch_2_4)
        monkeypatch.setattr(_sdpa, "_TORCH_HAS_ENABLE_GQA", False)
    return _sdpa.torch_sdpa


def _torchs_gqa(q, k, v, **kwargs):
    """What torch's SDPA gives for GQA: its enable_gqa where it has one (the fallback passes it
    through), else the key/value heads repeated (exactly what the fallback must match)."""
    if _sdpa._TORCH_HAS_ENABLE_GQA:
        return _installed_sdpa(q, k, v, enable_gqa=True, **kwargs)
    groups = q.shape[-3] // k.shape[-3]
    return _installed_sdpa(q, k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3), **kwargs)


@pytest.mark.parametrize("shape", [(2, 6, 5, 8), (6, 7, 8)], ids=["4d", "3d"])
def test_gqa_call_routed_to_torch_is_exact(gen, torch_sdpa, shape, core_calls):
    """float64 is not a kernel dtype: the drop-in hands the call to torch, GQA heads and all."""
    kv_shape = (*shape[:-3], 2, shape[-2] + 3, shape[-1])
    q, k, v = (randn(gen, *s, dtype=torch.float64).requires_grad_() for s in (shape, kv_shape, kv_shape))
    assert explain(q, k, v, is_causal=True, enable_gqa=True).startswith("torch's")
    out = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert core_calls["forward"] == 0
    expected = _torchs_gqa(q, k, v, is_causal=True)
    assert torch.equal(out, expected)
    assert torch.equal(torch_sdpa(q, k, v, is_causal=True, enable_gqa=True), expected)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
    for ours, theirs in zip(grads, expected_grads):
        assert torch.equal(ours, theirs)


def test_equal_heads_and_enable_gqa_false(gen, torch_sdpa):
    q, k, v = (randn(gen, 1, 3, 4, 8, dtype=torch.float64) for _ in range(3))
    expected = _installed_sdpa(q, k, v)
    for enable_gqa in (False, True):
        assert torch.equal(scaled_dot_product_attention(q, k, v, enable_gqa=enable_gqa), expected)
        assert torch.equal(torch_sdpa(q, k, v, enable_gqa=enable_gqa), expected)


def test_mismatched_heads_raise_as_torch_does(gen, torch_sdpa):
    q = randn(gen, 1, 6, 4, 8, dtype=torch.float64)
    for hkv, enable_gqa in ((4, True), (2, False)):
        k, v = (randn(gen, 1, hkv, 5, 8, dtype=torch.float64) for _ in range(2))
        with pytest.raises(RuntimeError):
            scaled_dot_product_attention(q, k, v, enable_gqa=enable_gqa)


def test_non_bool_enable_gqa_is_a_type_error(gen, torch_sdpa):
    q, k, v = (randn(gen, 1, 2, 4, 8, dtype=torch.float64) for _ in range(3))
    with pytest.raises(TypeError, match="enable_gqa"):
        torch_sdpa(q, k, v, enable_gqa=1)
    with pytest.raises(TypeError):
        scaled_dot_product_attention(q, k, v, enable_gqa="yes")
