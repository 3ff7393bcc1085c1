"""The FlashAttention-2 forward kernel: parity over a sampled product of shapes, layouts and flags,
a hypothesis fuzz test, the log-sum-exp, and memory that grows linearly with L."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashattn_mps import explain_plan, flash_attention
from helpers import (
    ALL_DTYPES,
    LAYOUTS,
    assert_matches_sdpa,
    layout_tensor,
    max_error,
    peak_memory_growth,
    product_case_tensors,
    randn,
    sample_product,
    sdpa,
)

HEAD_DIMS = [8, 32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 256]
LENGTHS = [(113, 203), (128, 217), (203, 113), (1023, 1024), (1, 147), (37, 37)]
GQA = [1, 3, 8]


def case_cost(case):
    (lq, lk), e, gqa = case[0], case[1], case[2]
    return lq * lk * 2 * e * gqa


@pytest.mark.parametrize(
    "lengths,e,gqa,dtype,causal,layout,ev_differs",
    sample_product(
        [LENGTHS, HEAD_DIMS, GQA, ALL_DTYPES, [False, True], LAYOUTS, [False, True]], 70, 4, case_cost, 12, 4e7
    ),
)
@pytest.mark.slow
def test_forward_parity(gen, lengths, e, gqa, dtype, causal, layout, ev_differs):
    q, k, v = product_case_tensors(gen, lengths, e, gqa, dtype, layout, ev_differs)
    out = flash_attention(q, k, v, causal=causal, kernel="forward")
    assert_matches_sdpa(out, q, k, v, causal)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_log_sum_exp(gen, dtype, causal):
    q, k, v = (
        randn(gen, 2, 4, 45, 64, dtype=dtype),
        randn(gen, 2, 2, 70, 64, dtype=dtype),
        randn(gen, 2, 2, 70, 32, dtype=dtype),
    )
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
    b=st.integers(1, 2),
    hkv=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    lq=st.integers(1, 80),
    lk=st.integers(0, 80),
    e=st.sampled_from([1, 8, 16, 24, 33, 64, 72, 100, 128, 200]),
    ev=st.sampled_from([1, 16, 40, 64, 128]),
    dtype=st.sampled_from(ALL_DTYPES),
    causal=st.booleans(),
    layout=st.sampled_from(LAYOUTS),
    scale=st.sampled_from([None, 0.3, -1.0]),
    seed=st.integers(0, 2**16),
)
@pytest.mark.slow
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
@pytest.mark.slow
def test_memory_grows_linearly_with_length():
    small, small_io = peak_memory_growth(RUN_FORWARD, 1024)
    large, large_io = peak_memory_growth(RUN_FORWARD, 4096)
    score_matrix = 2 * 4096 * 4096 * 4  # what one float32 L x S matrix per head would need: 128 MiB
    assert large < score_matrix / 8, f"peak grew by {large} bytes at L=4096"
    # 4x the length: linear growth is ~4x (inputs and output), quadratic would be 16x.
    assert large - large_io <= 6 * max(small - small_io, 1 << 20), (small, large)


# --- the tiled kernels' paths: tile loads, padded head dims, causal order, mask tile classes -------

FC_CONTIGUOUS_TILES = 3  # FA_FC_CONTIGUOUS_TILES in metal/fa_params.h


def forward_dispatch(q, k, v, **kwargs):
    (dispatch,) = explain_plan(q, k, v, kernel="forward", **kwargs)["dispatches"]
    return dispatch


def unaligned_view(gen, b, h, n, d, dtype):
    """(b, h, n, d) with unit column stride and aligned strides, starting one element off alignment."""
    return randn(gen, b, h, n, d + 4, dtype=dtype)[..., 1 : d + 1]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize(
    "layout,contiguous", [("bhld", True), ("blhd", True), ("unaligned", False), ("strided", False), ("odd_rows", False)]
)
def test_tile_load_paths(gen, dtype, layout, contiguous):
    """The vector path for contiguous K/V (and Q/dO in the backward) and the strided one for every
    other view, each on ragged key tiles and a head dim narrower than its width (40 in 48)."""
    lq, lk, e, ev = 37, 75, 40, 24
    if layout == "unaligned":
        make = unaligned_view
    elif layout == "strided":
        make = lambda gen, b, h, n, d, dtype: randn(gen, b, h, n, 2 * d, dtype=dtype)[..., ::2]
    elif layout == "odd_rows":  # rows 41 elements apart: not on 4-element boundaries
        make = lambda gen, b, h, n, d, dtype: randn(gen, b, h, n, d + 1, dtype=dtype)[..., :d]
    else:
        make = lambda gen, b, h, n, d, dtype: layout_tensor(gen, layout, b, h, n, d, dtype)
    q, k, v = make(gen, 2, 4, lq, e, dtype), make(gen, 2, 2, lk, e, dtype), make(gen, 2, 2, lk, ev, dtype)
    assert forward_dispatch(q, k, v)["constants"][FC_CONTIGUOUS_TILES] == int(contiguous)
    for causal in (False, True):
        assert_matches_sdpa(flash_attention(q, k, v, causal=causal, kernel="forward"), q, k, v, causal)


def test_contiguous_path_needs_every_operand_aligned(gen):
    q, k, v = randn(gen, 1, 2, 20, 64), randn(gen, 1, 2, 30, 64), randn(gen, 1, 2, 30, 64)
    assert forward_dispatch(q, k, v)["constants"][FC_CONTIGUOUS_TILES] == 1
    assert (
        forward_dispatch(q, k, unaligned_view(gen, 1, 2, 30, 64, torch.float32))["constants"][FC_CONTIGUOUS_TILES] == 0
    )
    assert forward_dispatch(q, k, v[..., :62])["constants"][FC_CONTIGUOUS_TILES] == 0  # Ev not a multiple of 4
    # q is not tiled by the forward kernel: its layout does not matter.
    assert forward_dispatch(q[..., ::2], k[..., ::2], v)["constants"][FC_CONTIGUOUS_TILES] == 0
    assert (
        forward_dispatch(unaligned_view(gen, 1, 2, 20, 64, torch.float32), k, v)["constants"][FC_CONTIGUOUS_TILES] == 1
    )


@pytest.mark.parametrize(
    "e,ev,dtype",
    [(72, 72, torch.float16), (136, 40, torch.float32), (200, 136, torch.bfloat16), (8, 100, torch.float32)],
)
def test_padded_head_dims_skip_empty_slices(gen, e, ev, dtype):
    """Head dims whose width has 8-wide slices of pure padding (72 in 80, 136 in 160, 40 in 48, ...):
    the matrix work skips them, and the result must not change."""
    q, k, v = (
        randn(gen, 1, 2, 41, e, dtype=dtype),
        randn(gen, 1, 2, 53, e, dtype=dtype),
        randn(gen, 1, 2, 53, ev, dtype=dtype),
    )
    for causal in (False, True):
        assert_matches_sdpa(flash_attention(q, k, v, causal=causal, kernel="forward"), q, k, v, causal)


def test_causal_grid_puts_the_heaviest_blocks_first(gen):
    q, k, v = randn(gen, 2, 3, 100, 32), randn(gen, 2, 3, 120, 32), randn(gen, 2, 3, 120, 32)
    assert forward_dispatch(q, k, v)["grid"] == (4, 3, 2)  # (query blocks, heads, batch)
    assert forward_dispatch(q, k, v, causal=True)["grid"] == (3, 2, 4)  # (heads, batch, blocks): blocks slowest
    for causal in (False, True):
        assert_matches_sdpa(flash_attention(q, k, v, causal=causal, kernel="forward"), q, k, v, causal)


def mask_golden_and_reference(q, k, v, mask):
    golden_mask = mask if mask.dtype == torch.bool else mask.double()
    return sdpa(q.double(), k.double(), v.double(), attn_mask=golden_mask), sdpa(q, k, v, attn_mask=mask)


def block_mask(lq, lk, row_block, key_block, seed):
    """A bool mask of (row_block x key_block) blocks each wholly kept, wholly excluded or random."""
    g = torch.Generator().manual_seed(seed)
    kind = torch.randint(0, 3, ((lq + row_block - 1) // row_block, (lk + key_block - 1) // key_block), generator=g)
    kind = kind.repeat_interleave(row_block, 0)[:lq].repeat_interleave(key_block, 1)[:, :lk]
    return torch.where(kind == 2, torch.rand(lq, lk, generator=g) > 0.5, kind == 1)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
def test_mask_tile_classes(gen, dtype, mask_kind):
    """Masks made of blocks that are wholly kept (visible tiles), wholly excluded (blocked: skipped,
    and for a bool mask not even loaded when every SIMD-group of the threadgroup is blocked) and
    mixed; broadcast over heads, and transposed in memory (a large key stride)."""
    lq, lk = 70, 100
    q, k, v = (
        randn(gen, 2, 2, lq, 64, dtype=dtype),
        randn(gen, 2, 2, lk, 64, dtype=dtype),
        randn(gen, 2, 2, lk, 48, dtype=dtype),
    )
    keep = block_mask(lq, lk, 8, 32, seed=3) | (torch.arange(lk) == 0)  # every row keeps key 0
    keep[32:64] = False  # one query block excluded everywhere: no K/V tile is loaded for it
    keep[32:64, 0] = True
    if mask_kind == "additive":
        keep = torch.where(keep, torch.randn(keep.shape, generator=gen), torch.tensor(float("-inf"))).to(dtype)
    for mask in (keep, keep.t().contiguous().t()[None, None].expand(2, 1, lq, lk)):
        out = flash_attention(q, k, v, attn_mask=mask, kernel="forward")
        golden, reference = mask_golden_and_reference(q, k, v, mask)
        error, reference_error = max_error(out, golden), max_error(reference, golden)
        assert error <= max(1e-5, 5 * reference_error), (error, reference_error)


@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
def test_nan_key_under_a_blocked_tile(gen, mask_kind):
    """A NaN key the mask hides from every row. A bool mask excludes it whatever its score (the
    project's rule, test_attention.py's NaN test: torch's math path would spread it): its tiles are
    skipped and the rows equal the golden without it. An additive -inf adds to the NaN score and
    gives NaN, as SDPA does, so additive masks never skip a tile."""
    q, k, v = randn(gen, 1, 1, 40, 16), randn(gen, 1, 1, 64, 16), randn(gen, 1, 1, 64, 16)
    keep = torch.ones(40, 64, dtype=torch.bool)
    keep[:, 32:] = False  # the second key tile is blocked for every row
    mask = keep if mask_kind == "bool" else torch.zeros(40, 64).masked_fill(~keep, float("-inf"))
    golden, _ = mask_golden_and_reference(q, k, v, mask)  # before the NaN
    k[0, 0, 40:, 0] = float("nan")
    out = flash_attention(q, k, v, attn_mask=mask, kernel="forward")
    if mask_kind == "additive":
        assert out.isnan().all() and mask_golden_and_reference(q, k, v, mask)[0].isnan().all()
    else:
        assert max_error(out, golden) < 1e-5


# --- the bounded fuzz against torch's math SDPA in float64 -----------------------------------


def strided(gen, shape, dtype, layout, offset):
    """A view of the given shape: contiguous, transposed in memory (heads and length swapped) or
    a slice with gaps; offset elements of storage before it."""
    b, h, n, d = shape
    if layout == "transposed":
        base = torch.randn(offset + b * n * h * d, generator=gen).to(dtype)
        return base[offset:].view(b, n, h, d).transpose(1, 2)
    if layout == "gaps":
        base = torch.randn(offset + b * h * n * (d + 3), generator=gen).to(dtype)
        return base[offset:].view(b, h, n, d + 3)[..., 1 : d + 1]
    base = torch.randn(offset + b * h * n * d, generator=gen).to(dtype)
    return base[offset:].view(b, h, n, d)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.integers(1, 2),
    hkv=st.integers(1, 2),
    group=st.sampled_from([1, 2]),
    lq=st.integers(1, 12),
    lk=st.integers(1, 12),
    e=st.sampled_from([1, 4, 8, 16, 20]),
    ev=st.sampled_from([4, 8, 12]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    layout=st.sampled_from(["contiguous", "transposed", "gaps"]),
    offset=st.integers(0, 5),
    mask=st.sampled_from([None, "bool", "float", "bool-broadcast", "float-rows"]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
@pytest.mark.slow
def test_fuzz_shapes_strides_offsets_dtypes_and_masks(
    b, hkv, group, lq, lk, e, ev, dtype, layout, offset, mask, causal, seed
):
    gen = torch.Generator().manual_seed(seed)
    hq = hkv * group
    q = strided(gen, (b, hq, lq, e), dtype, layout, offset)
    k = strided(gen, (b, hkv, lk, e), dtype, layout, offset)
    v = strided(gen, (b, hkv, lk, ev), dtype, layout, offset)
    attn_mask = None
    if mask == "bool":
        attn_mask = torch.rand(b, hq, lq, lk, generator=gen) > 0.3
    elif mask == "float":
        attn_mask = torch.randn(b, hq, lq, lk, generator=gen).to(dtype)
    elif mask == "bool-broadcast":
        attn_mask = torch.rand(lq, lk, generator=gen) > 0.5
    elif mask == "float-rows":
        attn_mask = torch.randn(1, 1, lq, 1, generator=gen).expand(b, hq, lq, lk)
    if attn_mask is not None and causal:
        causal = False  # SDPA takes one or the other
    out = flash_attention(q, k, v, causal=causal, attn_mask=attn_mask)
    golden = sdpa(
        q.double(),
        k.double(),
        v.double(),
        causal,
        attn_mask=attn_mask if attn_mask is None or attn_mask.dtype == torch.bool else attn_mask.double(),
    )
    reference = sdpa(q, k, v, causal, attn_mask=attn_mask)
    tolerance = max(1e-5, 5 * max_error(reference, golden))
    assert max_error(out, golden) <= tolerance
