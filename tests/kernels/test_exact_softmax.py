"""A row's largest score gets weight exactly exp2(0): a row with one visible key attends to it with
probability exactly 1 in every kernel (forward, decode with and without split-K, simple, the
probability pass, the backward's recomputed P), whatever the variants. Inputs are small integers
where a sum is compared, so every order of summation gives the same float and only P can differ."""

from __future__ import annotations

import pytest
import torch

from flashattn_mps import explain_plan, flash_attention, flash_attn_func


def small_integers(gen, *shape, low=-2, high=3, nonzero=False):
    values = torch.randint(low, high, shape, generator=gen).float()
    if nonzero:
        values = torch.where(values == 0, torch.ones_like(values), values)
    return values


def one_key_per_row(gen, layout, lq, s, hq):
    """Call options under which row i of (1, hq, lq, s) sees one key, and that key's index per row.
    "argmax" (flash_attn_func's arguments): two keys, the other one ALiBi's distance 1 away at a
    slope so steep that its weight vanishes (the row's softmax sum is exactly 1), and scores large
    enough that converting them between bases rounds."""
    rows = torch.arange(lq)
    if layout == "single key":  # S = 1
        return {"alibi_slopes": torch.rand(hq, generator=gen) * 0.3}, torch.zeros(lq, dtype=torch.long)
    if layout == "window":  # L = S, window (0, 0): the diagonal only
        return {"window_size": (0, 0), "softcap": 5.0}, rows
    if layout == "argmax":  # L = S, keys i - 1 and i
        return {"window_size": (1, 0), "alibi_slopes": torch.full((hq,), 1000.0), "softmax_scale": 1.3}, rows
    keys = torch.randint(0, s, (lq,), generator=gen)
    if layout == "bool mask":
        mask = torch.zeros(lq, s, dtype=torch.bool)
        mask[rows, keys] = True
        return {"attn_mask": mask, "scale": 1.3}, keys
    if layout == "additive mask":  # every other key -inf, the kept one shifted by 0.5
        mask = torch.full((lq, s), float("-inf"))
        mask[rows, keys] = 0.5
        return {"attn_mask": mask, "alibi_slopes": torch.rand(hq, generator=gen)}, keys
    if layout == "sink -inf":  # a sink that takes no weight leaves the sum at 1
        mask = torch.zeros(lq, s, dtype=torch.bool)
        mask[rows, keys] = True
        return {"attn_mask": mask, "sinks": torch.full((hq,), float("-inf"))}, keys
    raise AssertionError(layout)


def length_of_keys(layout, lq, s):
    return 1 if layout == "single key" else lq if layout in ("window", "argmax") else s


# (kernel, query rows, keys, layout): each forward kernel and the split-K merge under each way a
# row can end up with one visible key.
FORWARD_CASES = [
    ("forward", 37, 1, "single key"),
    ("forward", 37, 37, "window"),
    ("forward", 20, 45, "additive mask"),
    ("decode", 3, 1, "single key"),
    ("decode", 5, 60, "bool mask"),
    ("decode", 2, 1500, "sink -inf"),  # long enough to split the keys over threadgroups
    ("simple", 9, 9, "window"),
    ("simple", 9, 30, "additive mask"),
]


# Each case in float32, and each kernel's first case in bfloat16 (fewer specialisations to compile).
FIRST_OF_EACH_KERNEL = [case for i, case in enumerate(FORWARD_CASES) if i == 0 or FORWARD_CASES[i - 1][0] != case[0]]
DTYPE_CASES = [(*case, torch.float32) for case in FORWARD_CASES] + [
    (*case, torch.bfloat16) for case in FIRST_OF_EACH_KERNEL
]


@pytest.mark.parametrize("kernel, lq, s, layout, dtype", DTYPE_CASES)
def test_one_visible_key_gives_its_value_exactly(gen, kernel, lq, s, layout, dtype):
    hq, e = 2, 32
    s = length_of_keys(layout, lq, s)
    options, keys = one_key_per_row(gen, layout, lq, s, hq)
    q = torch.randn(1, hq, lq, e, generator=gen).to(dtype)
    k = torch.randn(1, hq, s, e, generator=gen).to(dtype)
    v = torch.randn(1, hq, s, e, generator=gen).to(dtype)
    if s == 1500:
        assert explain_plan(q, k, v, kernel=kernel, **options)["split_count"] > 1
    out = flash_attention(q, k, v, kernel=kernel, **options)
    assert torch.equal(out, v[:, :, keys]), (out - v[:, :, keys]).abs().max()


@pytest.mark.parametrize("layout", ["single key", "window", "argmax"])
@pytest.mark.parametrize("lq", [5, 70])  # the decode forward, then the prefill's
def test_probability_pass_gives_the_largest_score_exp2_0(gen, layout, lq):
    """return_attn_probs: the row's visible key has probability exactly 1 (with "argmax", the
    larger of its two keys), whichever kernel ran the forward."""
    h, e = 2, 16
    s = length_of_keys(layout, lq, 40)
    options, keys = one_key_per_row(gen, layout, lq, s, h)
    q, k, v = (torch.randn(1, n, h, e, generator=gen) for n in (lq, s, s))
    _, _, probs = flash_attn_func(q, k, v, return_attn_probs=True, **options)
    assert torch.equal(probs[0, :, torch.arange(lq), keys], torch.ones(h, lq))


@pytest.mark.parametrize(
    "layout, dtype",
    [(layout, torch.float32) for layout in ("single key", "window", "argmax")]
    + [("single key", torch.float16), ("single key", torch.bfloat16)],  # their dV rounds P's error away
)
def test_backward_gives_the_visible_key_all_of_the_gradient(gen, layout, dtype):
    """dV of a key is the sum of dO over the rows whose one visible (or largest) key it is, to the
    last bit: the backward's recomputed P is exactly 1 there (the prefill forward and the backward
    compute a score alike); dQ and dK are exactly 0, since dP = D for such a row."""
    h, e, lq = 2, 16, 339
    s = length_of_keys(layout, lq, 0)
    options, keys = one_key_per_row(gen, layout, lq, s, h)
    # Integer q and k keep every score exact.
    q = small_integers(gen, 1, lq, h, e, low=-1, high=2).to(dtype).requires_grad_()
    k = small_integers(gen, 1, s, h, e, low=-1, high=2).to(dtype).requires_grad_()
    v = small_integers(gen, 1, s, h, e).to(dtype).requires_grad_()
    out = flash_attn_func(q, k, v, **options)
    dout = small_integers(gen, *out.shape, low=-3, high=4, nonzero=True).to(dtype)
    out.backward(dout)
    expected = torch.zeros(1, s, h, e).index_add_(1, keys, dout.float()).to(dtype)
    assert torch.equal(v.grad, expected), (v.grad.float() - expected.float()).abs().max()
    assert torch.equal(q.grad, torch.zeros_like(q)) and torch.equal(k.grad, torch.zeros_like(k))


def alibi_reference(q, k, v, slopes, upcast):
    """flash-attn's test reference for ALiBi without causal, (B, L, H, D) layout: in float32 from the
    inputs (upcast) or in their own dtype; the output in the inputs' dtype."""
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    lq, s = q.shape[1], k.shape[1]
    distance = (torch.arange(lq)[:, None] + s - lq - torch.arange(s)[None, :]).abs()
    bias = -slopes[:, :, None, None] * distance
    scores = torch.einsum("bthd,bshd->bhts", q / q.shape[-1] ** 0.5, k) + bias.to(q.dtype)
    attention = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.einsum("bhts,bshd->bthd", attention, v).to(dtype)


def test_339_queries_on_one_key_meet_flash_attns_gradient_rule():
    """flash-attn's own test asserts |dV - dV_ref| <= 2 |dV_pt - dV_ref| against a float32 reference
    (dV_ref) and one in bfloat16 (dV_pt). With one key both references give every row P = 1 and the
    same dV, so the rule allows no error at all."""
    torch.manual_seed(0)
    b, lq, s, h, d = 2, 339, 1, 3, 64
    q, k, v = (torch.randn(b, n, h, d, dtype=torch.bfloat16, requires_grad=True) for n in (lq, s, s))
    slopes = torch.rand(b, h) * 0.3
    out = flash_attn_func(q, k, v, alibi_slopes=slopes)
    dout = torch.randn_like(out)
    (dv,) = torch.autograd.grad(out, v, dout)
    (dv_ref,) = torch.autograd.grad(alibi_reference(q, k, v, slopes, upcast=True), v, dout)
    (dv_pt,) = torch.autograd.grad(alibi_reference(q, k, v, slopes, upcast=False), v, dout)
    allowed = 2 * (dv_pt - dv_ref).abs().max().item()
    assert (dv - dv_ref).abs().max().item() <= allowed


@pytest.mark.parametrize("layout", ["bool mask", "additive mask"])
def test_backward_under_a_mask_gives_the_visible_key_all_of_the_gradient(gen, layout):
    """As above, with the one visible key chosen by attn_mask (the backward's masked tiles)."""
    h, e, lq, s = 2, 16, 339, 40
    options, keys = one_key_per_row(gen, layout, lq, s, h)
    q = small_integers(gen, 1, h, lq, e, low=-1, high=2).requires_grad_()
    k = small_integers(gen, 1, h, s, e, low=-1, high=2).requires_grad_()
    v = small_integers(gen, 1, h, s, e).requires_grad_()
    out = flash_attention(q, k, v, **options)
    dout = small_integers(gen, *out.shape, low=-3, high=4, nonzero=True)
    out.backward(dout)
    expected = torch.zeros(1, h, s, e).index_add_(2, keys, dout)
    assert torch.equal(v.grad, expected), (v.grad - expected).abs().max()
    assert torch.equal(q.grad, torch.zeros_like(q)) and torch.equal(k.grad, torch.zeros_like(k))
