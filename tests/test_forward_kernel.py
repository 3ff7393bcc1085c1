"""The FlashAttention-2 forward kernel: parity over a sampled product of shapes, layouts and flags,
a hypothesis fuzz test, the log-sum-exp, and memory that grows linearly with L."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashattn_mps import flash_attention
from conftest import ALL_DTYPES, LAYOUTS, product_case_tensors, sample_product, assert_matches_sdpa, layout_tensor, peak_memory_growth, randn

HEAD_DIMS = [8, 32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 256]
LENGTHS = [(113, 203), (128, 217), (203, 113), (1023, 1024), (1, 147), (37, 37)]
GQA = [1, 3, 8]


def case_cost(case):
    (lq, lk), e, gqa = case[0], case[1], case[2]
    return lq * lk * 2 * e * gqa


@pytest.mark.parametrize("lengths,e,gqa,dtype,causal,layout,ev_differs", sample_product(
    [LENGTHS, HEAD_DIMS, GQA, ALL_DTYPES, [False, True], LAYOUTS, [False, True]], 70, 4, case_cost, 12, 4e7))
def test_forward_parity(gen, lengths, e, gqa, dtype, causal, layout, ev_differs):
    q, k, v = product_case_tensors(gen, lengths, e, gqa, dtype, layout, ev_differs)
    out = flash_attention(q, k, v, causal=causal, kernel="forward")
    assert_matches_sdpa(out, q, k, v, causal)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_log_sum_exp(gen, dtype, causal):
    q, k, v = randn(gen, 2, 4, 45, 64, dtype=dtype), randn(gen, 2, 2, 70, 64, dtype=dtype), randn(gen, 2, 2, 70, 32, dtype=dtype)
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    scores = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) / 8.0
    if causal:
        scores = scores.masked_fill(torch.ones(45, 70, dtype=torch.bool).tril().logical_not(), float("-inf"))
    expected = torch.logsumexp(scores, dim=-1)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 45)
    torch.testing.assert_close(lse.double(), expected, rtol=1e-5, atol=1e-4 if dtype == torch.float32 else 2e-3)
    assert_matches_sdpa(out, q, k, v, causal)


def test_log_sum_exp_without_keys(gen):
    q, k, v = randn(gen, 1, 1, 3, 8), randn(gen, 1, 1, 0, 8), randn(gen, 1, 1, 0, 8)
    out, lse = flash_attention(q, k, v, return_lse=True)
    assert (out == 0).all() and (lse == float("-inf")).all()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.integers(1, 2), hkv=st.integers(1, 3), group=st.sampled_from([1, 2, 4]),
    lq=st.integers(1, 80), lk=st.integers(0, 80),
    e=st.sampled_from([1, 8, 16, 24, 33, 64, 72, 100, 128, 200]),
    ev=st.sampled_from([1, 16, 40, 64, 128]),
    dtype=st.sampled_from(ALL_DTYPES), causal=st.booleans(),
    layout=st.sampled_from(LAYOUTS), scale=st.sampled_from([None, 0.3, -1.0]),
    seed=st.integers(0, 2**16),
)
def test_fuzz_against_sdpa(b, hkv, group, lq, lk, e, ev, dtype, causal, layout, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    q = layout_tensor(gen, layout, b, hkv * group, lq, e, dtype)
    k = layout_tensor(gen, layout, b, hkv, lk, e, dtype)
    v = layout_tensor(gen, layout, b, hkv, lk, ev, dtype)
    out = flash_attention(q, k, v, causal=causal, scale=scale, kernel="forward")
    assert_matches_sdpa(out, q, k, v, causal, scale)


RUN_FORWARD = """
def run(n):
    q = torch.randn(1, 2, n, 64)
    flash_attention(q, q, q, causal=True)
    return q.nbytes * 2
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads peak RSS from /proc")
def test_memory_grows_linearly_with_length():
    small, small_io = peak_memory_growth(RUN_FORWARD, 1024)
    large, large_io = peak_memory_growth(RUN_FORWARD, 4096)
    score_matrix = 2 * 4096 * 4096 * 4  # what one float32 L x S matrix per head would need: 128 MiB
    assert large < score_matrix / 8, f"peak grew by {large} bytes at L=4096"
    # 4x the length: linear growth is ~4x (inputs and output), quadratic would be 16x.
    assert large - large_io <= 6 * max(small - small_io, 1 << 20), (small, large)
