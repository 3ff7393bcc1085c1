"""The decode kernel's key batches and its parallel split-K merge: a SIMD-group scores KEYS keys per
pass (4 at 8 rows of E = 128, 32 at one row of E = 64), so lengths that are not a multiple of the
batch, masked, NaN and -inf keys inside a batch, and every split count the planner can be asked for
must give the float64 golden's results and its NaN rows exactly."""

from __future__ import annotations

import math

import pytest
import torch

from flashattn_mps import explain_kvcache_plan, explain_plan, flash_attention, flash_attn_with_kvcache
from helpers import assert_matches_sdpa, max_error, randn, sdpa

# (query heads per kv head, head dim, dtype): 8 rows of 4 columns per lane take batches of 4 keys,
# one row of 2 columns batches of 32.
BATCHES = {4: (8, 128, torch.float16), 32: (1, 64, torch.float32)}


def batch_keys(q, k, v, **options):
    """KEYS of the plan's decode dispatch, from its registers: rows * (2 cols + KEYS) + 2 cols."""
    decode = explain_plan(q, k, v, kernel="decode", **options)["dispatches"][0]
    cols, rows = int(decode["macros"]["FA_DECODE_COLS"]), int(decode["macros"]["FA_DECODE_ROWS"])
    return (decode["cost"]["registers"] - 2 * cols) // rows - 2 * cols


def inputs(gen, keys, lk, lq=1, hkv=2):
    gqa, e, dtype = BATCHES[keys]
    q = randn(gen, 1, hkv * gqa, lq, e, dtype=dtype)
    k, v = randn(gen, 1, hkv, lk, e, dtype=dtype), randn(gen, 1, hkv, lk, e, dtype=dtype)
    assert lq > 1 or batch_keys(q, k, v) == keys  # more rows may take smaller batches
    return q, k, v


@pytest.mark.parametrize("keys", sorted(BATCHES))
@pytest.mark.parametrize("lk", [1, 6, 37, 301])
def test_lengths_that_are_not_a_multiple_of_the_batch(gen, keys, lk):
    q, k, v = inputs(gen, keys, lk)
    assert_matches_sdpa(flash_attention(q, k, v, kernel="decode"), q, k, v)


@pytest.mark.parametrize("keys", sorted(BATCHES))
def test_causal_rows_see_different_keys_of_one_batch(gen, keys):
    q, k, v = inputs(gen, keys, 45, lq=5)  # row i sees keys 0..i: the last batch is cut per row
    assert batch_keys(q, k, v, causal=True) > 1
    assert_matches_sdpa(flash_attention(q, k, v, causal=True, kernel="decode"), q, k, v, causal=True)


@pytest.mark.parametrize("keys", sorted(BATCHES))
def test_masked_keys_inside_a_batch_keep_their_nan_values_out(gen, keys):
    q, k, v = inputs(gen, keys, 70)
    keep = torch.arange(70) % 3 != 1  # two keys of every three, the gaps inside every batch
    v[:, :, ~keep] = float("nan")
    out = flash_attention(q, k, v, attn_mask=keep, kernel="decode")
    assert not out.isnan().any()
    golden = sdpa(q.double(), k.double(), v.nan_to_num(0.0).double(), attn_mask=keep)
    reference = sdpa(q, k, v.nan_to_num(0.0), attn_mask=keep)
    assert max_error(out, golden) <= max(1e-5, 5 * max_error(reference, golden))


@pytest.mark.parametrize("keys", sorted(BATCHES))
def test_minus_inf_batches_before_finite_ones(gen, keys):
    """An additive -inf over the first batches of every SIMD-group (the running maximum stays -inf
    through them), then finite keys; and -inf scattered inside later batches."""
    q, k, v = inputs(gen, keys, 600)
    bias = torch.zeros(600, dtype=q.dtype)
    bias[: 8 * keys + 3] = float("-inf")
    bias[400::7] = float("-inf")
    out = flash_attention(q, k, v, attn_mask=bias, kernel="decode")
    golden = sdpa(q.double(), k.double(), v.double(), attn_mask=bias.double())
    reference = sdpa(q, k, v, attn_mask=bias)
    assert max_error(out, golden) <= max(1e-5, 5 * max_error(reference, golden))


@pytest.mark.parametrize("keys", sorted(BATCHES))
@pytest.mark.parametrize("where", [0, 5, 33])  # first key of a batch, inside one, past the first turn
def test_nan_score_inside_a_batch_reaches_exactly_its_kv_heads_rows(gen, keys, where):
    q, k, v = inputs(gen, keys, 90)
    k[0, 1, where, 3] = float("nan")  # kv head 1: every query row of its group
    out = flash_attention(q, k, v, kernel="decode")
    gqa = q.shape[1] // 2
    assert out[0, gqa:].isnan().all() and not out[0, :gqa].isnan().any()
    assert_matches_sdpa(out[:, :gqa], q[:, :gqa], k[:, :1], v[:, :1])


def test_plus_inf_score_inside_a_batch_gives_nan_as_softmax_does(gen):
    q, k, v = inputs(gen, 32, 50)
    q = q.abs()
    k[0, 0, 10] = float("inf")  # q > 0: score +inf, exp(inf - inf) = NaN
    out = flash_attention(q, k, v, kernel="decode")
    assert out[0, 0].isnan().all() and not out[0, 1].isnan().any()


def kvcache_golden(q, k_cache, v_cache):
    """flash_attn_with_kvcache's layout (b, s, h, d) through the SDPA golden."""
    t = [x.transpose(1, 2).double() for x in (q, k_cache, v_cache)]
    return sdpa(*t).transpose(1, 2)


def test_every_requested_split_count(gen):
    """num_splits 1 .. 13 over 200 keys and 44 over 700 (more splits than a SIMD-group's lanes: the
    merge takes them 32 at a time). A requested count takes shares of whole 16-key turns."""
    q = randn(gen, 1, 1, 4, 32)
    for lk, requests in ((200, range(1, 14)), (700, [44])):
        k_cache, v_cache = randn(gen, 1, lk, 2, 32), randn(gen, 1, lk, 2, 32)
        golden = kvcache_golden(q, k_cache, v_cache)
        for n in requests:
            share = math.ceil(math.ceil(lk / n) / 16) * 16
            expected = 1 if n == 1 else math.ceil(lk / share)
            assert explain_kvcache_plan(q, k_cache, v_cache, num_splits=n)["split_count"] == expected
            out = flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=n)
            assert max_error(out, golden) <= 1e-5, n


def test_splits_without_a_visible_key_merge_to_nothing(gen):
    """A bool mask hiding the first half of the keys: the splits there have no key (max -inf, sum
    0) and NaN values that must stay out; a row whose every key is hidden gives zeros."""
    q, k, v = randn(gen, 1, 4, 1, 32), randn(gen, 1, 2, 1024, 32), randn(gen, 1, 2, 1024, 32)
    keep = torch.ones(1, 4, 1, 1024, dtype=torch.bool)
    keep[..., :512] = False
    keep[0, 3] = False  # query head 3 sees no key at all
    v[:, :, :512] = float("nan")
    assert explain_plan(q, k, v, attn_mask=keep)["split_count"] > 2
    out = flash_attention(q, k, v, attn_mask=keep)
    assert not out.isnan().any() and (out[0, 3] == 0).all()
    golden = sdpa(q.double(), k.double(), v.nan_to_num(0.0).double(), attn_mask=keep)
    assert max_error(out, golden) <= 1e-5
