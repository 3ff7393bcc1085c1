"""Head dims above 256, up to 576 (E = 576, Ev = 512 is DeepSeek's absorbed MLA), in every kernel:
the forward's blocking along D (Q and K streamed in 64-column blocks, the output split into column
blocks, each alone and together), decode with split-K (12, 16 and 20 columns per lane), the simple
kernel, the blocked backward (dQ, dK, dV), every variant (band, masks, softcap, ALiBi) through the
shared headers, and the SDPA drop-in running the kernels for them. Against float64 references on
materialised scores; shapes are small (each case costs L x S x (E + Ev) on the CPU device)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashattn_mps import _C, explain, explain_plan, flash_attention, scaled_dot_product_attention
from helpers import ALL_DTYPES, FUDGE, max_error, randn, reference, sample_product

# slow: every kernel at head dims 320 to 576, each case a few seconds
pytestmark = pytest.mark.slow

# (E, Ev): both blocked; E streamed alone (576, 64); Ev in column blocks alone (128, 512); dims that
# are not multiples of 4 (strided loads, ragged last blocks).
HEAD_DIMS = [(320, 320), (448, 448), (512, 512), (576, 512), (576, 64), (128, 512), (300, 452)]
# flash_attention's options and the reference's (SDPA layout, top-left unless bottom_right).
VARIANTS = {
    "none": ({}, {}),
    "causal": ({"causal": True}, {"causal": True}),
    "bottom-right causal": ({"causal": "bottom_right"}, {"causal": True, "bottom_right": True}),
    "bottom-right window": (
        {"causal": "bottom_right", "window_size": (6, -1)},
        {"causal": True, "bottom_right": True, "window": (6, -1)},
    ),
    "window": ({"window_size": (5, 3)}, {"window": (5, 3)}),
    "softcap": ({"softcap": 0.7}, {"softcap": 0.7}),
    "alibi": ({"alibi_slopes": "h"}, {"alibi": "h"}),
    "bool mask": ({"attn_mask": "bool"}, {"attn_mask": "bool"}),
    "float mask": ({"attn_mask": "float"}, {"attn_mask": "float"}),
}


def variant_options(gen, name, q, k):
    """(flash_attention kwargs, reference kwargs) of a variant for these inputs."""
    ours, theirs = (dict(d) for d in VARIANTS[name])
    hq, l, s = q.shape[1], q.shape[2], k.shape[2]
    if "alibi_slopes" in ours:
        ours["alibi_slopes"] = theirs["alibi"] = torch.rand(hq, generator=gen) * 0.3
    if ours.get("attn_mask") == "bool":
        keep = torch.rand(l, s, generator=gen) > 0.3
        keep[min(3, l - 1)] = False  # a row that sees no key
        ours["attn_mask"] = theirs["attn_mask"] = keep
    elif ours.get("attn_mask") == "float":
        ours["attn_mask"] = theirs["attn_mask"] = torch.randn(1, hq, l, s, generator=gen).to(q.dtype)
    return ours, theirs


def inputs(gen, l, s, e, ev, dtype, hq=4, hkv=2):
    """q, k, v in SDPA layout as views of (B, L, H, D) tensors (unit inner stride, strided rows)."""
    q = randn(gen, 1, l, hq, e, dtype=dtype).transpose(1, 2)
    k = randn(gen, 1, s, hkv, e, dtype=dtype).transpose(1, 2)
    v = randn(gen, 1, s, hkv, ev, dtype=dtype).transpose(1, 2)
    return q * 2, k, v  # scores of a few units, so softcap bends them


def reference_of(theirs, tensors, double):
    options = dict(theirs)
    mask = options.get("attn_mask")
    if double and mask is not None and mask.dtype != torch.bool:
        options["attn_mask"] = mask.double()
    return reference(*[t.double() if double else t for t in tensors], **options)


def assert_close_to_golden(actual, tensors, theirs):
    golden, same_dtype = reference_of(theirs, tensors, True), reference_of(theirs, tensors, False)
    assert actual.shape == golden.shape and actual.dtype == tensors[0].dtype
    error, reference_error = max_error(actual, golden), max_error(same_dtype, golden)
    assert error <= max(1e-5, 5 * reference_error), (error, reference_error)


FORWARD_CASES = sample_product(
    [HEAD_DIMS, sorted(VARIANTS), ALL_DTYPES, ["forward", "simple"]],
    count=22,
    seed=22,
    cost=lambda c: sum(c[0]),
    per_value=2,
    max_cost=1100,
)


@pytest.mark.parametrize("dims, variant, dtype, kernel", FORWARD_CASES)
def test_forward_and_simple_kernels(gen, dims, variant, dtype, kernel):
    q, k, v = inputs(gen, 33, 21, *dims, dtype)  # two query blocks, several key tiles
    ours, theirs = variant_options(gen, variant, q, k)
    out = flash_attention(q, k, v, kernel=kernel, **ours)
    assert_close_to_golden(out, (q, k, v), theirs)


@pytest.mark.parametrize(
    "dims, bd, bdv, blocks",
    [
        ((576, 512), 64, 256, 2),
        ((320, 320), 64, 160, 2),
        ((128, 512), 128, 256, 2),
        ((576, 64), 64, 64, 1),
        ((512, 576), 64, 192, 3),
        ((256, 256), 256, 256, 1),
        ((256, 512), 64, 256, 2),
    ],
)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_forward_blocking_plan(dims, bd, bdv, blocks, dtype):
    """E above 256 streams in 64-column blocks; Ev above 256 splits into equal column blocks, one
    threadgroup per block of each head; every blocked configuration is within the register budget
    and 32 KiB of threadgroup memory (Q of E in 128..256 streams beside a blocked Ev). At 256 and
    below the tiles are as they were."""
    q, k, v = (
        torch.zeros(1, 3, 40, dims[0], dtype=dtype),
        torch.zeros(1, 3, 50, dims[0], dtype=dtype),
        torch.zeros(1, 3, 50, dims[1], dtype=dtype),
    )
    [d] = explain_plan(q, k, v, kernel="forward")["dispatches"]
    assert (d["macros"]["FA_BD"], d["macros"]["FA_BDV"]) == (str(bd), str(bdv))
    assert d["grid"] == (2, 3 * blocks, 1)
    if max(dims) > 256:
        # at least 24 of Apple's ~128 registers per thread left for addresses, loop state, temporaries
        assert d["cost"]["registers"] <= 104 and d["cost"]["threadgroup_bytes"] <= 32768


DECODE_CASES = sample_product(
    [HEAD_DIMS[:4], ["none", "bottom-right causal", "bool mask", "float mask", "softcap", "alibi"], ALL_DTYPES],
    count=8,
    seed=5,
    cost=lambda c: sum(c[0]),
    per_value=1,
    max_cost=1100,
)


@pytest.mark.parametrize("dims, variant, dtype", DECODE_CASES)
def test_decode_with_split_k(gen, dims, variant, dtype):
    q, k, v = inputs(gen, 2, 700, *dims, dtype, hq=4, hkv=1)  # GQA 4: 8 rows on one kv head
    ours, theirs = variant_options(gen, variant, q, k)
    p = explain_plan(q, k, v, kernel="decode", **{n: o for n, o in ours.items() if n != "attn_mask"})
    assert p["split_count"] > 1
    cols = {320: 12, 448: 16, 512: 16, 576: 20}[max(dims)]
    assert p["dispatches"][0]["macros"]["FA_DECODE_COLS"] == str(cols)
    out = flash_attention(q, k, v, kernel="decode", **ours)
    assert_close_to_golden(out, (q, k, v), theirs)


def test_decode_registers_stay_in_budget():
    """20 columns per lane (E = 576): one row's query slice and accumulator, a batch of 16 partial
    scores and a K or V row in flight, 96 floats."""
    q, k, v = torch.zeros(1, 16, 1, 576), torch.zeros(1, 1, 300, 576), torch.zeros(1, 1, 300, 512)
    decode = explain_plan(q, k, v)["dispatches"][0]
    assert decode["macros"]["FA_DECODE_ROWS"] == "1" and decode["cost"]["registers"] == 2 * 20 + 16 + 2 * 20


GRADIENT_CASES = sample_product(
    [HEAD_DIMS, sorted(VARIANTS), ALL_DTYPES], count=12, seed=16, cost=lambda c: sum(c[0]), per_value=1, max_cost=1100
)


@pytest.mark.parametrize("dims, variant, dtype", GRADIENT_CASES)
def test_backward(gen, dims, variant, dtype):
    q, k, v = inputs(gen, 11, 35, *dims, dtype)  # key blocks of 32: two
    ours, theirs = variant_options(gen, variant, q, k)
    dout = randn(gen, 1, 4, 11, dims[1], dtype=dtype)

    def gradients(attention, tensors):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        attention(leaves).backward(dout.to(leaves[0].dtype))
        return [t.grad for t in leaves]

    actual = gradients(lambda t: flash_attention(*t, **ours), (q, k, v))
    golden = gradients(lambda t: reference_of(theirs, t, True), [t.double() for t in (q, k, v)])
    same_dtype = gradients(lambda t: reference_of(theirs, t, False), (q, k, v))
    for name, a, g, r in zip(("dq", "dk", "dv"), actual, golden, same_dtype):
        error, reference_error = max_error(a, g), max_error(r, g)
        assert error <= max(1e-5, FUDGE[name] * reference_error), (name, error, reference_error)


@pytest.mark.parametrize("e, ev, lq", [(576, 512, 40), (320, 320, 3), (512, 512, 9)])
def test_dropin_runs_the_kernels(gen, core_calls, e, ev, lq):
    q = randn(gen, 1, 2, lq, e).requires_grad_()
    k, v = randn(gen, 1, 2, 30, e).requires_grad_(), randn(gen, 1, 2, 30, ev).requires_grad_()
    assert explain(q, k, v, is_causal=True).startswith("flashattn_mps kernels")
    out = scaled_dot_product_attention(q, k, v, is_causal=True)
    out.sum().backward()
    assert core_calls["forward"] == 1 and core_calls["backward"] == 1
    golden = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert max_error(out, golden) < 1e-5


def test_dropin_falls_back_beyond_576():
    q, k, v = torch.randn(1, 2, 5, 600), torch.randn(1, 2, 6, 600), torch.randn(1, 2, 6, 8)
    assert f"head dims above {_C.MAX_HEAD_DIM}" in explain(q, k, v)
    with pytest.raises(ValueError, match="head dims up to 576 are supported, q has 600"):
        flash_attention(q, k, v)


@pytest.mark.parametrize(
    "e, dtype, blocks",
    [
        (128, torch.float16, 1),
        (128, torch.float32, 1),
        (192, torch.float32, 2),
        (256, torch.float16, 2),
        (256, torch.float32, 3),
    ],
)
def test_backward_blocks_above_128(e, dtype, blocks):
    """Above 128 the backward's accumulators take column blocks (its resident tiles would need up to
    twice the register budget at 256): dQ's grid carries Hq x E blocks, dK/dV's Hkv x blocks."""
    q, k, v = (torch.empty(1, h, n, e, dtype=dtype) for h, n in ((4, 40), (2, 70), (2, 70)))
    plan = explain_plan(q, k, v, backward=True)["dispatches"]
    dkdv, dq = plan[1], plan[2]
    assert dkdv["grid"] == (3, 2 * blocks, 1) and dq["grid"] == (2, 4 * blocks, 1)
    assert dkdv["cost"]["registers"] <= (114 if blocks > 1 else 136)  # fp32 at 128: 8 over, kept resident


@pytest.mark.parametrize(
    "gpu, e, dtype, kv_blocks, q_blocks",
    [
        ("apple9", 128, torch.float16, 1, 1),
        ("apple9", 128, torch.float32, 1, 1),
        ("apple9", 192, torch.float32, 2, 2),
        ("apple9", 256, torch.float16, 2, 2),
        ("apple9", 256, torch.float32, 3, 3),
        ("apple7", 128, torch.float16, 2, 1),
        ("apple7", 128, torch.float32, 2, 2),
        ("apple7", 192, torch.float32, 3, 2),
        ("apple7", 256, torch.float16, 3, 2),
        ("apple7", 256, torch.float32, 4, 3),
    ],
)
def test_backward_blocks_to_the_family_budget(gpu, e, dtype, kv_blocks, q_blocks):
    """The backward's accumulators take the widest column blocks (128, or 96 for a blocked dim with
    float operands, then 32 fewer) whose fragment registers fit the family's budget (96 on
    Apple7/8, 144 on Apple9/10): dQ's grid carries Hq x its E blocks, dK/dV's Hkv x its blocks,
    each kernel blocked on its own."""
    q, k, v = (torch.empty(1, h, n, e, dtype=dtype) for h, n in ((4, 40), (2, 70), (2, 70)))
    plan = explain_plan(q, k, v, backward=True, gpu=gpu)["dispatches"]
    dkdv, dq = plan[1], plan[2]
    assert dkdv["grid"] == (3, 2 * kv_blocks, 1) and dq["grid"] == (2, 4 * q_blocks, 1)
    budget = 96 if gpu == "apple7" else 144
    assert dkdv["cost"]["registers"] <= budget and dq["cost"]["registers"] <= budget
