"""flash_attn_func (flash-attn 2's API) and the options of flash_attention beyond SDPA: bottom-right
causal, sliding windows, softcap and ALiBi, in every kernel (prefill, decode with split-K, simple, backward), against
float64 references written in plain torch on materialised scores."""

from __future__ import annotations

import pytest
import torch

import flashattn_mps
from flashattn_mps import explain_plan, flash_attention, flash_attn_func
from helpers import (
    ALL_DTYPES,
    FORWARD_NAMES,
    KERNELS,
    LENGTHS,
    VARIANTS,
    assert_gradients_match,
    check,
    core_options,
    flash_inputs,
    forward_case,
    max_error,
    randn,
    reference,
    sample_product,
    sdpa_view,
    slopes,
    slots,
)

FORWARD_CASES = sample_product(
    [LENGTHS, VARIANTS, ALL_DTYPES, KERNELS],
    count=40,
    seed=16,
    cost=lambda c: c[0][0] * c[0][1],
    per_value=3,
    max_cost=4000,
)


@pytest.mark.parametrize("lengths, variant, dtype, kernel", FORWARD_CASES)
def test_forward_matches_reference(gen, lengths, variant, dtype, kernel):
    (l, _), (causal, window, softcap, _) = lengths, variant
    q, k, v, alibi = forward_case(gen, lengths, variant, dtype)
    if kernel == "auto":
        out = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi)
        assert out.shape == (2, l, 4, 24) and out.is_contiguous()
        out, bottom_right = out.transpose(1, 2), True
    else:  # flash_attention's options with a chosen kernel: without causal the window is top-left
        out = flash_attention(
            *sdpa_view(q, k, v),
            causal="bottom_right" if causal else False,
            window_size=window,
            kernel=kernel,
            softcap=softcap,
            alibi_slopes=alibi,
        )
        bottom_right = causal
    check(
        out, sdpa_view(q, k, v), causal=causal, bottom_right=bottom_right, window=window, softcap=softcap, alibi=alibi
    )


GRADIENT_CASES = sample_product(
    [LENGTHS[:3] + [(24, 24)], VARIANTS[:4] + VARIANTS[-7:], ALL_DTYPES],
    count=12,
    seed=61,
    cost=lambda c: c[0][0] * c[0][1],
    per_value=2,
    max_cost=3000,
)


@pytest.mark.parametrize("lengths, variant, dtype", GRADIENT_CASES)
def test_gradients_match_reference(gen, lengths, variant, dtype):
    (l, s), (causal, window, softcap, alibi_kind) = lengths, variant
    q, k, v = flash_inputs(gen, 1, l, s, 4, 2, 32, 16, dtype)
    inputs = [t.requires_grad_() for t in (q * 3, k, v)]
    dout = randn(gen, 1, l, 4, 16, dtype=dtype)
    alibi = slopes(gen, alibi_kind, 1, 4)
    out = flash_attn_func(*inputs, causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi)
    grads = torch.autograd.grad(out, inputs, dout)
    assert_gradients_match(
        grads,
        lambda *t: reference(
            *sdpa_view(*t), causal=causal, bottom_right=True, window=window, softcap=softcap, alibi=alibi
        ).transpose(1, 2),
        inputs,
        dout,
    )


@pytest.mark.parametrize("window, splits", [((300, 0), 1), ((700, 200), 2), ((1500, -1), 5)])
def test_decode_split_k_over_the_window(gen, window, splits):
    """Decode rows far into a long cache: the splits share only the window's keys (at least 256
    each), not S."""
    q, k, v = flash_inputs(gen, 1, 2, 3000, 4, 1, 32, 32, torch.float32)
    plan = explain_plan(*sdpa_view(q, k, v), causal="bottom_right", window_size=window)
    assert plan["split_count"] == splits
    check(
        flash_attn_func(q, k, v, causal=True, window_size=window).transpose(1, 2),
        sdpa_view(q, k, v),
        causal=True,
        bottom_right=True,
        window=window,
    )


def test_top_left_window_and_attn_mask(gen):
    """flash_attention's window is anchored on SDPA's top-left diagonal and combines with a mask."""
    q, k, v = (randn(gen, 1, 2, n, 16) for n in (30, 45, 45))
    mask = torch.rand(30, 45, generator=gen) > 0.3
    out = flash_attention(q, k, v, attn_mask=mask, window_size=(6, 2))
    check(out, (q, k, v), causal=False, bottom_right=False, window=(6, 2), attn_mask=mask)
    additive = randn(gen, 1, 1, 30, 45)
    out = flash_attention(q, k, v, causal=True, window_size=(4, -1), kernel="simple")
    check(out, (q, k, v), causal=True, bottom_right=False, window=(4, -1))
    out = flash_attention(q, k, v, attn_mask=additive, window_size=(3, 3), kernel="decode")
    check(out, (q, k, v), window=(3, 3), attn_mask=additive)


def test_bottom_right_causal_without_window_and_empty_rows(gen):
    """L > S: the first L - S rows see no key and give zeros, with zero gradients."""
    q, k, v = (t.requires_grad_() for t in flash_inputs(gen, 1, 20, 6, 2, 2, 16, 16, torch.float32))
    out = flash_attn_func(q, k, v, causal=True)
    assert (out[:, :14] == 0).all()
    out.sum().backward()
    assert (q.grad[:, :14] == 0).all() and q.grad[:, 14:].abs().sum() > 0
    check(
        flash_attention(*sdpa_view(q.detach(), k.detach(), v.detach()), causal="bottom_right"),
        sdpa_view(q.detach(), k.detach(), v.detach()),
        causal=True,
        bottom_right=True,
    )


def test_one_plan_per_band(gen):
    """The plan cache keys plans by the band: the same shapes with other windows get their own."""
    q, k, v = flash_inputs(gen, 1, 33, 33, 2, 2, 16, 16, torch.float32)
    per_head, per_batch_head = torch.tensor([0.3, 0.1]), torch.tensor([[0.1, 0.3]])
    for causal, window, softcap, alibi in [
        (False, (2, 2), 0.0, None),
        (False, (-1, -1), 0.0, None),
        (True, (4, 0), 0.0, None),
        (False, (2, 2), 0.0, None),
        (True, (4, 0), 0.3, None),
        (True, (-1, -1), 0.0, per_head),
        (True, (-1, -1), 0.0, per_batch_head),
        (True, (-1, -1), 0.0, per_head[:1].expand(2)),
        (True, (-1, -1), 0.0, None),
    ]:
        out = flash_attn_func(
            q * 3, k, v, causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi
        ).transpose(1, 2)
        check(
            out, sdpa_view(q * 3, k, v), causal=causal, bottom_right=True, window=window, softcap=softcap, alibi=alibi
        )


def test_any_input_strides(gen):
    """Sliced, permuted flash-layout views are read in place; the output is contiguous (B, L, H, Dv)."""
    base = randn(gen, 2, 40, 5, 3, 24)
    q, k, v = base[:, 3:, 1:5, 0, :16], base[:, :30, :2, 1, 2:18], base[:, :30, :2, 2, 4:12]
    out = flash_attn_func(q, k, v, causal=True, window_size=(9, -1), softmax_scale=0.3)
    assert out.shape == (2, 37, 4, 8) and out.is_contiguous()
    check(out.transpose(1, 2), sdpa_view(q, k, v), causal=True, bottom_right=True, window=(9, -1), scale=0.3)


def tiles(plan):
    return plan["dispatches"][0]["cost"]["tiles"]


def test_tiles_visited_grow_with_the_window_not_with_s():
    def plan(l, s, window, kernel="auto"):
        q, k = torch.empty(1, 1, l, 64), torch.empty(1, 1, s, 64)
        return explain_plan(q, k, k, causal="bottom_right", window_size=window, kernel=kernel)

    # Prefill: 256 queries at the end of 1024 or 8192 keys.
    short, long_ = tiles(plan(256, 1024, (128, 0))), tiles(plan(256, 8192, (128, 0)))
    assert short == long_ > 0
    assert tiles(plan(256, 8192, (512, 0))) > 2 * long_
    assert tiles(plan(256, 8192, (-1, -1))) > 10 * long_  # plain bottom-right causal sees all earlier keys
    # Decode (split-K and one split alike) and the simple kernel: scores computed.
    for kernel in ("decode", "simple"):
        assert tiles(plan(1, 4096, (256, 0), kernel)) == tiles(plan(1, 65536, (256, 0), kernel)) <= 2 * 258
        assert tiles(plan(1, 65536, (1024, 0), kernel)) > 3 * tiles(plan(1, 65536, (256, 0), kernel))


@pytest.mark.parametrize(
    "option, value, error",
    [
        ("dropout_p", 1.5, ValueError),
        ("softcap", -1.0, ValueError),
        ("softcap", "1", TypeError),
        ("alibi_slopes", torch.ones(3), ValueError),
        ("alibi_slopes", torch.ones(2, dtype=torch.float64), TypeError),
        ("return_attn_probs", 1, TypeError),
        ("window_size", (3,), TypeError),
        ("window_size", (-2, 0), ValueError),
        ("window_size", (1.0, 2), TypeError),
        ("causal", "yes", TypeError),
    ],
)
def test_flash_attn_func_refuses_clearly(gen, option, value, error):
    q, k, v = flash_inputs(gen, 1, 4, 4, 2, 2, 16, 16, torch.float32)
    with pytest.raises(error, match=option.split("_p")[0].split("_s")[0]):
        flash_attn_func(q, k, v, **{option: value})


def test_flash_attention_refuses_bad_band_options(gen):
    q = randn(gen, 1, 2, 4, 16)
    with pytest.raises(ValueError, match="bottom_right"):
        flash_attention(q, q, q, causal="bottom_left")
    with pytest.raises(ValueError, match="window_size"):
        flash_attention(q, q, q, window_size=(0, -3))
    with pytest.raises(ValueError, match="window_size"):
        flashattn_mps._C.forward(
            flashattn_mps._C.DEVICE_CPU,
            slots(FORWARD_NAMES, (q, q, q, torch.empty_like(q))),
            core_options(window_left=-5, window_right=0),
        )


def test_opcheck_with_band(gen):
    """The torch.library ops carry the band and flash_attn_func's output layout."""
    q, k, v = (t.requires_grad_() for t in sdpa_view(*flash_inputs(gen, 1, 9, 12, 2, 1, 16, 8, torch.float32)))
    torch.library.opcheck(
        torch.ops.flashattn_mps.attention_forward,
        (q, k, v, None, True, 0.25, [1, 3, 0], True, 0.5, torch.tensor([0.2, 0.4])),
    )


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_every_option_with_attn_mask_and_gradients(gen, dtype):
    """flash_attention with a window, softcap, ALiBi and an additive mask at once, forward and backward
    (top-left diagonal), against the float64 reference."""
    q, k, v = (randn(gen, 1, 4, n, 24, dtype=dtype) for n in (29, 41, 41))
    k, v = k[:, :2], v[:, :2]
    q = q * 3
    mask = randn(gen, 1, 1, 29, 41, dtype=dtype)
    alibi = torch.rand(4, generator=gen)
    options = dict(window=(5, 7), softcap=1.5, alibi=alibi, attn_mask=mask)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, window_size=(5, 7), softcap=1.5, alibi_slopes=alibi, attn_mask=mask)
    check(out.detach(), (q, k, v), **options)
    dout = randn(gen, *out.shape, dtype=dtype)
    grads = torch.autograd.grad(out, leaves, dout)

    def reference_grads(tensors, **extra):
        refs = [t.detach().clone().requires_grad_() for t in tensors]
        return torch.autograd.grad(reference(*refs, **extra), refs, dout.to(refs[0].dtype))

    golden = reference_grads([t.double() for t in (q, k, v)], **{**options, "attn_mask": mask.double()})
    same_dtype = reference_grads((q, k, v), **options)
    for name, ours, gold, ref in zip("qkv", grads, golden, same_dtype):
        error, reference_error = max_error(ours, gold), max_error(ref, gold)
        assert error <= max(1e-5, 5 * reference_error), (name, error, reference_error)


def test_sdpa_drop_in_takes_the_bottom_right_path_for_a_lower_right_causal_bias(gen):
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = randn(gen, 1, 2, 7, 16), randn(gen, 1, 2, 20, 16), randn(gen, 1, 2, 20, 16)
    bias = causal_lower_right(7, 20)
    assert "causal (CausalBias, lower right)" in flashattn_mps.explain(q, k, v, attn_mask=bias)
    out = flashattn_mps.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    check(out, (q, k, v), causal=True, bottom_right=True)


def test_c_layer_refuses_malformed_alibi_slopes(gen):
    """A 0-D slopes descriptor with storage is refused, not taken for "no ALiBi"; so are other shapes."""
    q = randn(gen, 1, 2, 4, 16)
    slopes = torch.ones(2)
    storage = slopes.untyped_storage()
    zero_d = (storage.data_ptr(), storage.nbytes(), 0, flashattn_mps._C.DTYPE_FLOAT32, (), ())
    for bad, message in ((zero_d, "alibi_slopes"), (slopes[None, :1], r"alibi_slopes: must be \(B, Hq\)")):
        with pytest.raises(ValueError, match=message):
            flashattn_mps._C.forward(
                flashattn_mps._C.DEVICE_CPU,
                slots(FORWARD_NAMES, (q, q, q, torch.empty_like(q)), alibi_slopes=bad),
                core_options(),
            )


@pytest.mark.parametrize("kernel", KERNELS)
def test_window_align_bottom_right_without_causal(gen, kernel):
    """flash_attention's window_align="bottom_right" with causal=False: flash_attn_func's
    bidirectional window (anchored on i + S - L), in every kernel; ALiBi takes the same diagonal."""
    q, k, v = flash_inputs(gen, 1, 9, 30, 2, 1, 16, 16, torch.float32)
    alibi = torch.tensor([0.3, 0.1])
    out = flash_attention(
        *sdpa_view(q, k, v), window_size=(5, 3), window_align="bottom_right", kernel=kernel, alibi_slopes=alibi
    )
    check(out, sdpa_view(q, k, v), bottom_right=True, window=(5, 3), alibi=alibi)
    if kernel == "auto":
        expected = flash_attn_func(q, k, v, window_size=(5, 3), alibi_slopes=alibi).transpose(1, 2)
        assert torch.equal(out, expected)
        top_left = flash_attention(*sdpa_view(q, k, v), window_size=(5, 3), window_align="top_left")
        check(top_left, sdpa_view(q, k, v), window=(5, 3))


def test_window_align_refuses_contradictions(gen):
    q = randn(gen, 1, 2, 4, 16)
    for causal, align in ((True, "bottom_right"), ("bottom_right", "top_left")):
        with pytest.raises(ValueError, match="window_align.*contradicts causal"):
            flash_attention(q, q, q, causal=causal, window_size=(2, 0), window_align=align)
    with pytest.raises(ValueError, match="window_align must be"):
        flash_attention(q, q, q, window_size=(2, 0), window_align="bottom")


def test_flash_attn_layout_lse_is_plus_infinity_for_rows_without_keys(gen):
    """flash-attn's convention on its API (the seq_major path flash_attn_func's lse-returning
    options take): +inf where a row sees no key or its sum is NaN; flash_attention keeps SDPA's -inf."""
    from flashattn_mps._api import attend

    q, k, v = flash_inputs(gen, 1, 6, 3, 2, 2, 16, 16, torch.float32)  # L > S: rows 0..2 see no key
    k[0, 1, 1, 0] = float("nan")  # key 1 of head 1: rows that see it get a NaN sum
    for grad in (False, True):
        inputs = [t.clone().requires_grad_(grad) for t in (q, k, v)]
        out, lse = attend(
            *(t.transpose(1, 2) for t in inputs), None, True, None, return_lse=True, band=(1, -1, -1), seq_major=True
        )
        assert (lse[0, :, :3] == float("inf")).all() and lse[0, 0, 3:].isfinite().all()
        assert (lse[0, 1, 4:] == float("inf")).all()
        _, sdpa_lse = flash_attention(*sdpa_view(q, k, v), causal="bottom_right", return_lse=True)
        assert (sdpa_lse[0, :, :3] == float("-inf")).all() and sdpa_lse[0, 1, 4:].isnan().all()
        assert torch.equal(lse[0, 0, 3:], sdpa_lse[0, 0, 3:])
