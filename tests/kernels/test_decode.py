"""The decode kernel (few query rows, split-K over long KV): parity with the float64 SDPA golden over
a sampled product of query lengths, KV lengths, GQA ratios, dtypes and the causal flag, on KV
caches sliced out of larger buffers; head dims; log-sum-exp; NaN/inf; and the planner's choices."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from flashattn_mps import _C, _sources, explain_plan, flash_attention
from flashattn_mps._api import describe
from helpers import ALL_DTYPES, FORWARD_NAMES, assert_matches_sdpa, core_options, max_error, randn, sdpa, slots

QUERY_LENS = [1, 2, 5, 8]
KV_LENS = [1, 7, 9, 32, 63, 67, 129, 400, 2000, 8192]
GQA = [1, 4, 8]
LAYOUTS = ["contiguous", "cache", "cache_blhd"]


def decode_inputs(gen, b, hkv, gqa, lq, lk, e, ev, dtype, layout):
    """q (b, hkv*gqa, lq, e) and k, v (b, hkv, lk, e/ev). "cache": k and v are the first lk rows of
    layer 1 of a preallocated (layers, b, hkv, s_max, d) cache, so they carry a storage offset and
    a row stride longer than lk; "cache_blhd": the same with a (layers, b, s_max, hkv, d) cache and
    q in (b, lq, h, e) memory, the layouts most models keep."""
    hq, s_max = hkv * gqa, lk + 29
    if layout == "contiguous":
        return (
            randn(gen, b, hq, lq, e, dtype=dtype),
            randn(gen, b, hkv, lk, e, dtype=dtype),
            randn(gen, b, hkv, lk, ev, dtype=dtype),
        )
    if layout == "cache":
        q = randn(gen, b, hq, lq, e, dtype=dtype)
        k = randn(gen, 2, b, hkv, s_max, e, dtype=dtype)[1][:, :, :lk]
        v = randn(gen, 2, b, hkv, s_max, ev, dtype=dtype)[1][:, :, :lk]
    else:
        q = randn(gen, b, lq, hq, e, dtype=dtype).transpose(1, 2)
        k = randn(gen, 2, b, s_max, hkv, e, dtype=dtype)[1][:, :lk].transpose(1, 2)
        v = randn(gen, 2, b, s_max, hkv, ev, dtype=dtype)[1][:, :lk].transpose(1, 2)
    assert k.storage_offset() > 0
    return q, k, v


def sampled_cases():
    """Each (L, S) pair three times, with GQA ratio, dtype, causal flag, layout and head dim drawn at
    random (seeded). The CPU device is slow for long KV, so S = 2000 and 8192 come twice (16 cases)."""
    rng = random.Random(5)
    pairs = list(itertools.product(QUERY_LENS, KV_LENS)) * 2
    pairs += [(lq, lk) for lq, lk in pairs[:40] if lk <= 400]
    return [
        (
            lq,
            lk,
            rng.choice(GQA),
            rng.choice(ALL_DTYPES),
            rng.random() < 0.5,
            rng.choice(LAYOUTS),
            rng.choice([64, 128]),
        )
        for lq, lk in pairs
    ]


@pytest.mark.parametrize("lq,lk,gqa,dtype,causal,layout,e", sampled_cases())
@pytest.mark.slow
def test_decode_parity(gen, lq, lk, gqa, dtype, causal, layout, e):
    q, k, v = decode_inputs(gen, 1, 2 if gqa < 8 else 1, gqa, lq, lk, e, e, dtype, layout)
    out = flash_attention(q, k, v, causal=causal, kernel="decode")
    assert_matches_sdpa(out, q, k, v, causal)
    if lk >= 2000 and not causal:
        assert explain_plan(q, k, v, causal)["split_count"] > 1, "long KV goes through split-K"


def vector_loads(q, k, v, causal=False):
    """Whether the plan's decode dispatch reads K and V rows as vectors."""
    decode = explain_plan(q, k, v, causal, kernel="decode")["dispatches"][0]
    return bool(decode["constants"][_C.FC_DECODE_VECTOR_LOADS])


def strided_kv(gen, lk, e, dtype, how):
    """(1, 2, lk, e) views that defeat vector loads: every other column of a wider row ("columns"),
    rows starting one element off the chunk alignment ("offset"), a row stride that is not a
    multiple of the chunk ("pitch")."""
    if how == "columns":
        return randn(gen, 1, 2, lk, 2 * e, dtype=dtype)[..., ::2]
    if how == "offset":
        return randn(gen, 2 * lk * e + 1, dtype=dtype)[1:].view(1, 2, lk, e)
    return randn(gen, 1, 2, lk, e + 1, dtype=dtype)[..., :e]


@pytest.mark.parametrize("how", ["columns", "offset", "pitch"])
@pytest.mark.parametrize("dtype,e,lk", [(torch.float32, 128, 90), (torch.float16, 64, 700), (torch.bfloat16, 256, 33)])
def test_generic_loads_for_unaligned_or_strided_kv(gen, how, dtype, e, lk):
    q = randn(gen, 1, 8, 2, e, dtype=dtype)
    k, v = strided_kv(gen, lk, e, dtype, how), strided_kv(gen, lk, e, dtype, how)
    assert not vector_loads(q, k, v)
    assert_matches_sdpa(flash_attention(q, k, v, causal=True, kernel="decode"), q, k, v, causal=True)
    contiguous = k.clone(memory_format=torch.contiguous_format), v.clone(memory_format=torch.contiguous_format)
    assert vector_loads(q, *contiguous), "the same shapes, unit-strided and aligned, take vector loads"


@pytest.mark.parametrize("e,hq,lq,rows,chunks", [(64, 16, 2, 16, 2), (128, 32, 1, 8, 4), (200, 8, 3, 4, 6)])
@pytest.mark.parametrize("lk", [45, 1500])  # 1500: split over threadgroups, then merged
def test_rows_capped_by_registers_stay_exact(gen, e, hq, lq, rows, chunks, lk):
    dtype = torch.float16 if e == 128 else torch.float32
    q, k, v = decode_inputs(gen, 1, 1, hq, lq, lk, e, e, dtype, "cache_blhd")
    p = explain_plan(q, k, v)
    decode = p["dispatches"][0]
    assert decode["macros"]["FA_DECODE_ROWS"] == str(rows) and decode["grid"][1] == chunks
    assert (p["split_count"] > 1) == (lk > 1000)
    assert vector_loads(q, k, v)
    assert_matches_sdpa(flash_attention(q, k, v), q, k, v)


@pytest.mark.parametrize(
    "shape,kind", [((2, 1, 1, -1), "bool"), ((1, 8, 3, -1), "float"), ((3, -1), "bool"), ((2, 8, 1, -1), "float")]
)
@pytest.mark.parametrize("lk", [45, 1200])  # 1200: split over threadgroups
def test_masks_through_their_strides(gen, shape, kind, lk):
    # GQA 4 packs 4 query heads x 3 rows per kv head; the mask is read per (row, key pair).
    q, k, v = decode_inputs(gen, 2, 2, 4, 3, lk, 64, 64, torch.float16, "cache")
    shape = tuple(lk if n == -1 else n for n in shape)
    keep = torch.rand(*shape, generator=gen) > 0.4
    mask = keep if kind == "bool" else torch.where(keep, torch.randn(*shape, generator=gen), float("-inf"))
    out = flash_attention(q, k, v, attn_mask=mask, kernel="decode")
    golden = sdpa(q.double(), k.double(), v.double(), attn_mask=mask if kind == "bool" else mask.double())
    reference = sdpa(q, k, v, attn_mask=mask if kind == "bool" else mask.to(q.dtype))
    assert max_error(out, golden) <= max(1e-5, 5 * max_error(reference, golden))


@pytest.mark.parametrize("e,ev", [(0, 16), (1, 3), (37, 37), (96, 80), (64, 17), (200, 256), (256, 256)])
@pytest.mark.parametrize("lk", [90, 700])  # 700: split over threadgroups
def test_head_dims(gen, e, ev, lk):
    q, k, v = decode_inputs(gen, 2, 1, 4, 2, lk, e, ev, torch.float32, "cache")
    out = flash_attention(q, k, v, kernel="decode")
    assert_matches_sdpa(out, q, k, v)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("lk,causal", [(50, False), (50, True), (1500, False)])
def test_log_sum_exp(gen, dtype, lk, causal):
    q, k, v = decode_inputs(gen, 1, 2, 4, 3, lk, 64, 32, dtype, "contiguous")
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True, kernel="decode")
    scores = (q.double() @ k.double().repeat_interleave(4, 1).transpose(-1, -2)) / 8.0
    if causal:
        scores = scores.masked_fill(torch.ones(3, lk, dtype=torch.bool).tril().logical_not(), float("-inf"))
    assert lse.dtype == torch.float32 and lse.shape == (1, 8, 3)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, dim=-1), rtol=1e-5, atol=tolerance)
    assert_matches_sdpa(out, q, k, v, causal)


def test_no_keys_gives_zeros_and_minus_infinity(gen):
    q, k, v = randn(gen, 1, 4, 2, 16), randn(gen, 1, 2, 0, 16), randn(gen, 1, 2, 0, 8)
    out, lse = flash_attention(q, k, v, return_lse=True, kernel="decode")
    assert out.shape == (1, 4, 2, 8) and (out == 0).all() and (lse == float("-inf")).all()


@pytest.mark.parametrize("lk", [40, 3000])
def test_nan_and_inf_reach_exactly_the_rows_they_touch(gen, lk):
    # Query heads 0-3 share kv head 0, 4-7 kv head 1; 5 query rows, causal (row i sees keys 0..i).
    q, k, v = decode_inputs(gen, 1, 2, 4, 5, lk, 16, 16, torch.float32, "contiguous")
    q = q.abs()
    q[0, 1, 0, 3] = float("nan")  # head 1, row 0 only
    k[0, 1, 2, 0] = float("nan")  # kv head 1, key 2: rows >= 2 of heads 4-7
    v[0, 0, 3, 5] = float("nan")  # kv head 0, key 3: rows >= 3 of heads 0-3 (masked before)
    k[0, 0, 1, :] = float("-inf")  # with q > 0 the score is -inf: weight 0, no NaN
    out = flash_attention(q, k, v, causal=True, kernel="decode")
    nan_rows = out[0].isnan().any(dim=-1)
    expected = torch.zeros(8, 5, dtype=torch.bool)
    expected[1, 0] = True
    expected[4:, 2:] = True
    expected[:4, 3:] = True
    assert nan_rows.tolist() == expected.tolist()
    clean_q, clean_k, clean_v = q.nan_to_num(0.0), k.clone(), v.clone()
    clean_k[0, 1, 2, 0], clean_v[0, 0, 3, 5] = 0.0, 0.0
    golden = sdpa(clean_q.double(), clean_k.double(), clean_v.double(), causal=True)
    torch.testing.assert_close(out[0][~expected].double(), golden[0][~expected], rtol=1e-5, atol=1e-5)


def test_nan_key_in_one_split_reaches_every_row_of_its_head(gen):
    q, k, v = decode_inputs(gen, 1, 2, 2, 1, 3000, 16, 16, torch.float32, "contiguous")
    k[0, 0, 2500, 7] = float("nan")
    assert explain_plan(q, k, v)["split_count"] > 1
    out = flash_attention(q, k, v)
    assert out[0, :2].isnan().all() and not out[0, 2:].isnan().any()
    assert_matches_sdpa(out[:, 2:], q[:, 2:], k[:, 1:], v[:, 1:])


def test_large_fp16_values_do_not_overflow():
    q = torch.full((1, 8, 1, 80), 256.0, dtype=torch.float16)
    kv = torch.full((1, 2, 1000, 80), 256.0, dtype=torch.float16)
    out = flash_attention(q, kv, kv, kernel="decode")
    assert not out.isnan().any() and not out.isinf().any()
    assert_matches_sdpa(out, q, kv, kv)


@pytest.mark.parametrize("scale", [-0.7, 0.0])
def test_explicit_scale(gen, scale):
    q, k, v = decode_inputs(gen, 1, 1, 4, 1, 600, 32, 32, torch.float32, "cache")
    assert_matches_sdpa(flash_attention(q, k, v, scale=scale), q, k, v, scale=scale)


def test_unbatched_and_longer_queries(gen):
    q, k, v = randn(gen, 4, 1, 32), randn(gen, 2, 900, 32), randn(gen, 2, 900, 8)
    out = flash_attention(q, k, v)
    assert out.shape == (4, 1, 8)
    assert_matches_sdpa(out, q, k, v)
    # Forced past AUTO's threshold the kernel stays exact, only slower than the prefill kernel.
    q, k, v = decode_inputs(gen, 1, 1, 3, 37, 45, 24, 24, torch.float16, "cache_blhd")
    assert_matches_sdpa(flash_attention(q, k, v, causal=True, kernel="decode"), q, k, v, causal=True)


# --- the planner ---------------------------------------------------------------------------------


def plan(b, hq, hkv, lq, lk, causal=False, e=64, kernel="auto", dtype=torch.float16):
    q = torch.empty(b, hq, lq, e, dtype=dtype)
    k = torch.empty(1, 1, 1, e, dtype=dtype).expand(b, hkv, lk, e)  # planning reads no element
    return explain_plan(q, k, k, causal, kernel=kernel)


@pytest.mark.parametrize("lq,expected", [(1, "fa_decode_half"), (8, "fa_decode_half"), (9, "fa_forward_half")])
def test_auto_routes_small_query_lengths_to_decode(lq, expected):
    assert [d["function"] for d in plan(1, 8, 2, lq, 100)["dispatches"]] == [expected]


def test_long_kv_is_split_and_merged():
    p = plan(1, 32, 4, 1, 32768)  # GQA 8: one threadgroup per kv head, 4 of them, before splitting
    assert [d["function"] for d in p["dispatches"]] == ["fa_decode_half", "fa_decode_merge_half"]
    decode, merge = p["dispatches"]
    assert decode["grid"][1:] == (4, 1), "the 8 query heads of a kv head share one threadgroup"
    assert decode["macros"]["FA_DECODE_ROWS"] == "8"
    assert 8 <= p["split_count"] <= 128 and decode["grid"][0] == p["split_count"]
    assert 32768 / p["split_count"] >= 256, "at least 256 keys per split"
    assert merge["grid"] == (1, 32, 1)
    assert p["workspace_bytes"] == p["split_count"] * 32 * (64 + 2) * 4


@pytest.mark.parametrize(
    "shape,why",
    [
        ((1, 8, 8, 1, 400), "too few keys to share"),
        ((1, 8, 2, 1, 8192, True), "causal with L = 1: only key 0 is visible"),
        ((16, 32, 32, 1, 8192), "512 threadgroups fill the GPU already"),
    ],
)
def test_no_split_when_it_does_not_pay(shape, why):
    p = plan(*shape)
    assert p["split_count"] == 1 and len(p["dispatches"]) == 1 and p["workspace_bytes"] == 0, why


def test_rows_beyond_the_register_budget_take_more_threadgroups():
    p = plan(1, 16, 2, 8, 100, e=256)  # 64 rows per kv head, 4 per threadgroup at E = 256
    assert p["dispatches"][0]["macros"] == {"FA_DTYPE": "half", "FA_DECODE_COLS": "8", "FA_DECODE_ROWS": "4"}
    assert p["dispatches"][0]["grid"] == (1, 2 * 16, 1)


def test_missing_or_small_workspace_is_rejected(gen):
    _sources.ensure_registered()  # this test calls the core directly
    q, k, v = randn(gen, 1, 2, 1, 16), randn(gen, 1, 1, 2000, 16), randn(gen, 1, 1, 2000, 16)
    out = torch.empty(1, 2, 1, 16)
    args = (_C.DEVICE_CPU, slots(FORWARD_NAMES, [describe(t) for t in (q, k, v, out)]), core_options(scale=0.25))
    needed = _C.forward_workspace_bytes(*args)
    assert needed > 0
    with pytest.raises(ValueError, match=f"needs a workspace of {needed} bytes"):
        _C.forward(*args)
    small = torch.empty(needed // 4 - 1)
    with pytest.raises(ValueError, match="workspace: .* this call needs"):
        _C.forward(*args, describe(small))
    with pytest.raises(TypeError, match="workspace: must be float32"):
        _C.forward(*args, describe(torch.empty(needed, dtype=torch.float16)))
    workspace = torch.empty(needed // 4)  # kept alive: a descriptor is only an address
    _C.forward(*args, describe(workspace))
    assert_matches_sdpa(out, q, k, v, scale=0.25)
