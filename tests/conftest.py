"""Shared helpers: the float64 SDPA golden and PyTorch's tolerance rule."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F


def sdpa(q, k, v, causal=False, scale=None):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)


def max_error(actual: torch.Tensor, golden: torch.Tensor) -> float:
    """max |actual - golden| where both are finite; NaN/inf must sit at the same places."""
    a = actual.double()
    same_nonfinite = (a.isnan() == golden.isnan()).all() and (a.isinf() == golden.isinf()).all()
    assert same_nonfinite, "NaN/inf positions differ from the golden"
    finite = golden.isfinite()
    if not finite.any():
        return 0.0
    assert (a[golden.isinf()] == golden[golden.isinf()]).all()
    return (a[finite] - golden[finite]).abs().max().item()


def assert_matches_sdpa(out, q, k, v, causal=False, scale=None, factor=5.0):
    """PyTorch's rule: error vs a float64 golden <= max(1e-5, factor x the error of torch's own SDPA
    in the same dtype)."""
    golden = sdpa(q.double(), k.double(), v.double(), causal, scale)
    reference = sdpa(q, k, v, causal, scale)
    assert out.shape == golden.shape, f"shape {tuple(out.shape)} != {tuple(golden.shape)}"
    assert out.dtype == q.dtype
    error = max_error(out, golden)
    reference_error = max_error(reference, golden)
    tolerance = max(1e-5, factor * reference_error)
    assert error <= tolerance, f"error {error:.3e} > tolerance {tolerance:.3e} (reference error {reference_error:.3e})"
    return error


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)


ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
