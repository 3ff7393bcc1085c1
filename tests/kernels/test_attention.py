"""flash_attention against the float64 SDPA golden on CPU tensors (the CPU Metal device)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from flashattn_mps import flash_attention
from helpers import ALL_DTYPES, assert_matches_sdpa, randn, sdpa


def make_qkv(gen, b, hq, hkv, lq, lk, e, ev, dtype):
    return (
        randn(gen, b, hq, lq, e, dtype=dtype),
        randn(gen, b, hkv, lk, e, dtype=dtype),
        randn(gen, b, hkv, lk, ev, dtype=dtype),
    )


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel", ["auto", "simple"])
def test_basic(gen, dtype, causal, kernel):
    q, k, v = make_qkv(gen, 2, 3, 3, 37, 45, 64, 64, dtype)
    out = flash_attention(q, k, v, causal=causal, kernel=kernel)
    assert_matches_sdpa(out, q, k, v, causal)


# A sample of the product (lengths x head dims x GQA x dtype x causal); the full product is too
# slow for CI on the CPU device, and each axis is covered on its own.
LENGTHS = [(1, 1), (1, 147), (17, 9), (113, 203), (203, 113), (64, 64)]
HEAD_DIMS = [(8, 8), (32, 48), (59, 59), (64, 17), (111, 96), (128, 128), (256, 256), (1, 3)]
GQA = [(1, 1), (3, 1), (6, 2), (8, 1)]
_rng = random.Random(7)
CASES = [
    (lengths, dims, gqa, dtype, causal)
    for lengths, dims, gqa, dtype, causal in itertools.product(LENGTHS, HEAD_DIMS, GQA, ALL_DTYPES, [False, True])
    if _rng.random() < 0.06
]


@pytest.mark.parametrize("lengths,dims,gqa,dtype,causal", CASES)
@pytest.mark.slow
def test_sampled_product(gen, lengths, dims, gqa, dtype, causal):
    (lq, lk), (e, ev), (hq, hkv) = lengths, dims, gqa
    q, k, v = make_qkv(gen, 1, hq, hkv, lq, lk, e, ev, dtype)
    assert_matches_sdpa(flash_attention(q, k, v, causal=causal), q, k, v, causal)


@pytest.mark.parametrize("hq,hkv", [(8, 1), (6, 3), (4, 4)])
def test_gqa(gen, hq, hkv):
    q, k, v = make_qkv(gen, 2, hq, hkv, 19, 23, 32, 32, torch.float32)
    assert_matches_sdpa(flash_attention(q, k, v), q, k, v)


@pytest.mark.parametrize("lq,lk", [(5, 50), (50, 5), (1, 7), (7, 1), (33, 33)])
def test_causal_is_top_left(gen, lq, lk):
    q, k, v = make_qkv(gen, 1, 2, 2, lq, lk, 16, 16, torch.float32)
    assert_matches_sdpa(flash_attention(q, k, v, causal=True), q, k, v, causal=True)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_transposed_blhd_views(gen, dtype):
    # (B, L, H, D) storage viewed as (B, H, L, D): the layout most models produce.
    q = randn(gen, 2, 31, 4, 40, dtype=dtype).transpose(1, 2)
    k = randn(gen, 2, 29, 2, 40, dtype=dtype).transpose(1, 2)
    v = randn(gen, 2, 29, 2, 24, dtype=dtype).transpose(1, 2)
    assert not q.is_contiguous()
    assert_matches_sdpa(flash_attention(q, k, v, causal=True), q, k, v, causal=True)


def test_sliced_views_with_offsets(gen):
    base_q = randn(gen, 3, 5, 40, 70)
    base_kv = randn(gen, 3, 4, 60, 90)
    q = base_q[1:, 2:4, 3:30, 5:69]  # offset, sliced in every dim
    k = base_kv[1:, 1:2, 10:50, 7:71]
    v = base_kv[1:, 2:3, 10:50, 20:53]
    assert q.storage_offset() > 0 and k.storage_offset() > 0
    assert_matches_sdpa(flash_attention(q, k, v), q, k, v)


def test_strided_head_dim(gen):
    # Every other column: the last dim is not contiguous.
    q = randn(gen, 1, 2, 12, 64)[..., ::2]
    k = randn(gen, 1, 2, 14, 64)[..., ::2]
    v = randn(gen, 1, 2, 14, 20)[..., ::2]
    assert_matches_sdpa(flash_attention(q, k, v), q, k, v)


def test_expanded_kv_with_zero_stride(gen):
    k = randn(gen, 1, 1, 9, 16).expand(2, 1, 9, 16)  # batch stride 0
    v = randn(gen, 1, 1, 9, 16).expand(2, 1, 9, 16)
    q = randn(gen, 2, 2, 5, 16)
    assert_matches_sdpa(flash_attention(q, k, v), q, k, v)


def test_unbatched_3d(gen):
    q, k, v = randn(gen, 4, 10, 32), randn(gen, 2, 12, 32), randn(gen, 2, 12, 8)
    out = flash_attention(q, k, v, causal=True)
    assert out.shape == (4, 10, 8)
    assert_matches_sdpa(out, q, k, v, causal=True)


@pytest.mark.parametrize("scale", [0.05, 1.0, -0.3, 0.0])
def test_explicit_scale(gen, scale):
    q, k, v = make_qkv(gen, 1, 2, 2, 9, 11, 16, 16, torch.float32)
    assert_matches_sdpa(flash_attention(q, k, v, scale=scale), q, k, v, scale=scale)


def test_output_is_contiguous_and_new(gen):
    q, k, v = make_qkv(gen, 1, 2, 2, 4, 4, 8, 8, torch.float16)
    out = flash_attention(q, k, v)
    assert out.is_contiguous() and out.dtype == torch.float16
    assert out.untyped_storage().data_ptr() not in {t.untyped_storage().data_ptr() for t in (q, k, v)}


def test_empty_inputs(gen):
    q, k, v = make_qkv(gen, 1, 2, 2, 0, 5, 8, 8, torch.float32)
    assert flash_attention(q, k, v).shape == (1, 2, 0, 8)
    q, k, v = make_qkv(gen, 1, 2, 2, 3, 0, 8, 8, torch.float32)  # no keys: SDPA gives zeros
    assert_matches_sdpa(flash_attention(q, k, v), q, k, v)
    q, k, v = make_qkv(gen, 1, 2, 2, 3, 4, 0, 8, torch.float32)  # E = 0: every score is 0
    assert_matches_sdpa(flash_attention(q, k, v), q, k, v)


@pytest.mark.parametrize("kernel", ["forward", "simple"])
def test_nan_and_inf_propagate_to_exactly_the_rows_they_touch(gen, kernel):
    # torch's own CPU backends disagree here (the math path also turns rows that cannot see a
    # masked NaN key into NaN; the flash path turns a NaN query row into zeros), so the rule is
    # checked directly: a row is NaN iff it sees a NaN, every other row equals the clean golden.
    q, k, v = make_qkv(gen, 1, 1, 1, 40, 40, 16, 16, torch.float32)
    q = q.abs()
    q[0, 0, 1, 3] = float("nan")  # row 1 only
    k[0, 0, 30, 0] = float("nan")  # rows that see key 30: rows >= 30 under the causal mask
    k[0, 0, 20, :] = float("-inf")  # with q > 0 the score is -inf: weight 0, no NaN
    out = flash_attention(q, k, v, causal=True, kernel=kernel)
    nan_rows = out[0, 0].isnan().all(dim=-1)
    assert nan_rows.tolist() == [i == 1 or i >= 30 for i in range(40)]
    clean = [i for i in range(40) if not (i == 1 or i >= 30)]
    k_clean = k.clone()
    k_clean[0, 0, 30, 0] = 0.0
    golden = sdpa(q.nan_to_num(0.0).double(), k_clean.double(), v.double(), causal=True)
    torch.testing.assert_close(out[0, 0, clean].double(), golden[0, 0, clean], rtol=1e-5, atol=1e-5)


def test_large_fp16_values_do_not_overflow():
    # PyTorch's overflow case: all 256.0 in fp16, scores of 256*256*80 would overflow fp16.
    q = torch.full((1, 32, 23, 80), 256.0, dtype=torch.float16)
    out = flash_attention(q, q, q)
    assert not out.isnan().any() and not out.isinf().any()
    assert_matches_sdpa(out, q, q, q)
