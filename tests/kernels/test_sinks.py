"""Attention sinks (GPT-OSS, StreamingLLM): one logit per query head in every row's softmax, with no
value, in every kernel (prefill, decode with split-K, simple, backward) and with every other option,
against float64 references on materialised scores (helpers.reference with a sink column)."""

from __future__ import annotations

import pytest
import torch

import flashattn_mps
from flashattn_mps import _C, explain_plan, flash_attention, flash_attn_func
from helpers import (
    ALL_DTYPES,
    BACKWARD_NAMES,
    FORWARD_NAMES,
    KERNELS,
    LENGTHS,
    VARIANTS,
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
    variant_scores,
)


def sink_logits(gen, h, spread=2.0):
    """Sinks of a few units either way, so some rows put most of their weight on the sink."""
    return randn(gen, h) * spread


def reference_lse(q, k, sinks, causal=False, bottom_right=False, window=None, scale=None, softcap=0.0, alibi=None):
    """float64 log-sum-exp of each row's scores and its sink (SDPA layout, no attn_mask)."""
    scores, keep = variant_scores(
        q.double(), k.double(), causal, bottom_right, window, scale, softcap, None if alibi is None else alibi.double()
    )
    scores = scores.masked_fill(~keep, float("-inf"))
    column = sinks.double()[None, :, None, None].expand(*scores.shape[:-1], 1)
    return torch.logsumexp(torch.cat([scores, column], -1), -1)


FORWARD_CASES = sample_product(
    [LENGTHS, VARIANTS, ALL_DTYPES, KERNELS],
    count=24,
    seed=20,
    cost=lambda c: c[0][0] * c[0][1],
    per_value=2,
    max_cost=4000,
)


@pytest.mark.parametrize("lengths, variant, dtype, kernel", FORWARD_CASES)
def test_forward_and_lse_match_reference(gen, lengths, variant, dtype, kernel):
    causal, window, softcap, _ = variant
    q, k, v, alibi = forward_case(gen, lengths, variant, dtype)
    sinks = sink_logits(gen, 4)
    if kernel == "auto":
        out = flash_attn_func(
            q, k, v, causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi, sinks=sinks
        ).transpose(1, 2)
        bottom_right = True
        lse = None
    else:
        out, lse = flash_attention(
            *sdpa_view(q, k, v),
            causal="bottom_right" if causal else False,
            window_size=window,
            kernel=kernel,
            softcap=softcap,
            alibi_slopes=alibi,
            sinks=sinks,
            return_lse=True,
        )
        bottom_right = causal
    options = dict(causal=causal, bottom_right=bottom_right, window=window, softcap=softcap, alibi=alibi)
    check(out, sdpa_view(q, k, v), sinks=sinks, **options)
    if lse is not None:
        golden = reference_lse(*sdpa_view(q, k), sinks, **options)
        assert (lse - golden).abs().max().item() < 1e-4 * max(1.0, golden.abs().max().item())


def test_sinks_change_the_result(gen):
    """Without the sink column the reference differs: the test above cannot pass on a kernel that ignores sinks."""
    q, k, v = sdpa_view(*flash_inputs(gen, 1, 9, 12, 2, 2, 16, 16, torch.float32))
    sinks = torch.tensor([1.0, -0.5])
    for kernel in KERNELS:
        out = flash_attention(q, k, v, sinks=sinks, kernel=kernel)
        check(out, (q, k, v), sinks=sinks)
        assert max_error(out, reference(q.double(), k.double(), v.double())) > 1e-2


GRADIENT_CASES = sample_product(
    [LENGTHS[:4] + [(24, 24)], VARIANTS, ALL_DTYPES],
    count=12,
    seed=23,
    cost=lambda c: c[0][0] * c[0][1],
    per_value=1,
    max_cost=3000,
)


@pytest.mark.parametrize("lengths, variant, dtype", GRADIENT_CASES)
def test_gradients_match_reference(gen, lengths, variant, dtype):
    """dq, dk, dv and dsinks (float32 sinks) through flash_attn_func's eager autograd."""
    (l, s), (causal, window, softcap, alibi_kind) = lengths, variant
    q, k, v = flash_inputs(gen, 2, l, s, 4, 2, 32, 16, dtype)
    q = q * 3
    alibi = slopes(gen, alibi_kind, 2, 4)
    sinks = sink_logits(gen, 4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = flash_attn_func(
        *leaves[:3], causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi, sinks=leaves[3]
    )
    dout = randn(gen, *out.shape, dtype=dtype)
    grads = torch.autograd.grad(out, leaves, dout)

    def reference_grads(tensors):
        refs = [t.detach().clone().requires_grad_() for t in tensors]
        out = reference(
            *sdpa_view(*refs[:3]),
            causal=causal,
            bottom_right=True,
            window=window,
            softcap=softcap,
            alibi=alibi,
            sinks=refs[3],
        ).transpose(1, 2)
        return torch.autograd.grad(out, refs, dout.to(out.dtype))

    golden = reference_grads([t.double() for t in (q, k, v, sinks)])
    same_dtype = reference_grads((q, k, v, sinks))
    for name, ours, gold, ref in zip(["dq", "dk", "dv", "dsinks"], grads, golden, same_dtype):
        assert ours.dtype == ref.dtype
        error, reference_error = max_error(ours, gold), max_error(ref, gold)
        assert error <= max(1e-5, 5 * reference_error), (name, error, reference_error)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_every_option_with_attn_mask_gqa_and_gradients(gen, dtype):
    """flash_attention's top-left window, softcap, ALiBi, an additive mask and sinks at once, with
    the sinks given in q's dtype (converted to float32, the gradient reaching the given tensor)."""
    q, k, v = (randn(gen, 1, 4, n, 24, dtype=dtype) for n in (29, 41, 41))
    k, v = k[:, :2], v[:, :2]
    q = q * 3
    mask = randn(gen, 1, 1, 29, 41, dtype=dtype)
    alibi, sinks = torch.rand(4, generator=gen), sink_logits(gen, 4).to(dtype)
    options = dict(window=(5, 7), softcap=1.5, alibi=alibi)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = flash_attention(
        *leaves[:3], window_size=(5, 7), softcap=1.5, alibi_slopes=alibi, attn_mask=mask, sinks=leaves[3]
    )
    check(out.detach(), (q, k, v), attn_mask=mask, sinks=sinks, **options)
    dout = randn(gen, *out.shape, dtype=dtype)
    grads = torch.autograd.grad(out, leaves, dout)
    assert grads[3].dtype == dtype

    def reference_grads(tensors, attn_mask):
        refs = [t.detach().clone().requires_grad_() for t in tensors]
        out = reference(*refs[:3], attn_mask=attn_mask, sinks=refs[3], **options)
        return torch.autograd.grad(out, refs, dout.to(refs[0].dtype))

    golden = reference_grads([t.double() for t in (q, k, v, sinks)], mask.double())
    same_dtype = reference_grads((q, k, v, sinks), mask)
    for name, ours, gold, ref in zip(["dq", "dk", "dv", "dsinks"], grads, golden, same_dtype):
        error, reference_error = max_error(ours, gold), max_error(ref, gold)
        assert error <= max(1e-5, 5 * reference_error), (name, error, reference_error)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("window", [None, (700, 0)])
def test_decode_split_k_counts_the_sink_once(gen, dtype, window):
    """Long caches are split over threadgroups; the sink enters once, in the merge (a sink counted
    per split would weigh it split_count times)."""
    q, k, v = (randn(gen, 1, h, n, 32, dtype=dtype) for h, n in ((4, 2), (1, 3000), (1, 3000)))
    sinks = torch.tensor([3.0, 0.0, -2.0, 6.0])
    causal = "bottom_right" if window else False
    assert explain_plan(q, k, v, causal=causal, window_size=window, sinks=sinks)["split_count"] > 1
    out, lse = flash_attention(q, k, v, causal=causal, window_size=window, sinks=sinks, return_lse=True)
    options = dict(causal=bool(window), bottom_right=True, window=window)
    check(out, (q, k, v), sinks=sinks, **options)
    golden = reference_lse(q, k, sinks, **options)
    assert (lse - golden).abs().max().item() < 1e-4 * golden.abs().max().item()


@pytest.mark.parametrize("kernel", KERNELS)
def test_rows_without_keys_give_zeros_and_the_sink_as_lse(gen, kernel):
    """GPT-OSS's eager softmax puts a row's whole weight on the sink when every key is masked: the
    output is 0 and the log-sum-exp is the sink; such rows add nothing to any gradient."""
    q, k, v = (randn(gen, 1, 2, n, 16) for n in (6, 10, 10))
    mask = torch.ones(6, 10, dtype=torch.bool)
    mask[2] = False
    sinks = torch.tensor([0.5, -1.5])
    out, lse = flash_attention(q, k, v, attn_mask=mask, sinks=sinks, kernel=kernel, return_lse=True)
    assert (out[:, :, 2] == 0).all()
    assert torch.equal(lse[0, :, 2], sinks)
    check(out, (q, k, v), attn_mask=mask, sinks=sinks)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = flash_attention(*leaves[:3], attn_mask=mask, sinks=leaves[3])
    out.sum().backward()
    assert (leaves[0].grad[:, :, 2] == 0).all()


def test_gradient_to_sinks_alone_and_unbatched(gen):
    """Only the sinks require grad (q, k, v do not): autograd still runs the backward; 3-D inputs too."""
    q, k, v = (randn(gen, 3, n, 16) for n in (7, 11, 11))
    sinks = sink_logits(gen, 3).requires_grad_()
    out = flash_attention(q, k, v, causal=True, sinks=sinks)
    assert out.shape == (3, 7, 16)
    dout = randn(gen, 3, 7, 16)
    (ours,) = torch.autograd.grad(out, [sinks], dout)
    leaf = sinks.detach().double().requires_grad_()
    golden = reference(q[None].double(), k[None].double(), v[None].double(), causal=True, sinks=leaf)[0]
    (gold,) = torch.autograd.grad(golden, [leaf], dout.double())
    assert max_error(ours, gold) < 1e-5


def test_one_plan_with_and_without_sinks(gen):
    """The plan cache keys the sinks' presence and strides: alternating calls stay right."""
    q, k, v = sdpa_view(*flash_inputs(gen, 1, 12, 12, 2, 2, 16, 16, torch.float32))
    base = torch.tensor([0.0, 2.0, 0.0, -1.0])
    for sinks in (None, base[1::2], None, base[:2], torch.tensor([9.0, 9.0])):
        out = flash_attention(q, k, v, causal=True, sinks=sinks)
        check(out, (q, k, v), causal=True, sinks=sinks)


def test_opcheck_with_sinks(gen):
    """The torch.library ops carry the sinks and return dsinks (empty without sinks)."""
    q, k, v = (t.requires_grad_() for t in sdpa_view(*flash_inputs(gen, 1, 9, 12, 2, 1, 16, 8, torch.float32)))
    sinks = torch.tensor([0.3, -0.7], requires_grad=True)
    torch.library.opcheck(
        torch.ops.flashattn_mps.attention_forward,
        (q, k, v, None, True, 0.25, [1, 3, 0], True, 0.5, None, 0.0, None, sinks),
    )
    out, lse = torch.ops.flashattn_mps.attention_forward(
        q.detach(), k.detach(), v.detach(), None, False, 0.25, sinks=sinks.detach()
    )
    dout = torch.randn(out.shape, generator=gen)
    for extra in ({"sinks": sinks.detach()}, {}):
        torch.library.opcheck(
            torch.ops.flashattn_mps.attention_backward,
            (dout, q.detach(), k.detach(), v.detach(), out, lse, None, False, 0.25),
            extra,
        )


def test_torch_compile_gradients_reach_sinks(gen):
    q, k, v = (randn(gen, 1, 2, n, 16).requires_grad_() for n in (8, 8, 8))
    sinks = torch.tensor([0.5, -0.5], requires_grad=True)

    def f(q, k, v, sinks):
        return flash_attention(q, k, v, causal=True, sinks=sinks).square().sum()

    torch._dynamo.reset()
    torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, sinks).backward()
    compiled = sinks.grad.clone()
    sinks.grad = None
    f(q, k, v, sinks).backward()
    torch._dynamo.reset()
    assert torch.allclose(compiled, sinks.grad, atol=1e-6)


@pytest.mark.parametrize(
    "sinks, error, message",
    [
        ([0.0, 1.0], TypeError, "sinks must be a torch.Tensor"),
        (torch.zeros(3), ValueError, r"sinks must be \(Hq,\) = \(2,\).*\(3,\)"),
        (torch.zeros(1, 2), ValueError, r"sinks must be \(Hq,\)"),
        (torch.zeros(2, dtype=torch.float64), TypeError, "sinks must be float32 or q's dtype"),
        (torch.zeros(2, dtype=torch.float16), TypeError, "sinks must be float32 or q's dtype"),
    ],
)
def test_bad_sinks_are_refused_clearly(gen, sinks, error, message):
    q = randn(gen, 1, 2, 4, 16)
    with pytest.raises(error, match=message):
        flash_attention(q, q, q, sinks=sinks)
    with pytest.raises(error, match=message):
        flash_attn_func(*sdpa_view(q, q, q), sinks=sinks)


def test_c_layer_refuses_malformed_sinks(gen):
    """A 0-D sinks descriptor with storage is refused, not taken for "no sinks"; so are other shapes,
    dtypes, and a backward with sinks but no sink_grad."""
    flashattn_mps._sources.ensure_registered()
    q = randn(gen, 1, 2, 4, 16)
    sinks = torch.ones(2)
    storage = sinks.untyped_storage()
    zero_d = (storage.data_ptr(), storage.nbytes(), 0, _C.DTYPE_FLOAT32, (), ())
    for bad, kind, message in (
        (zero_d, ValueError, "sinks"),
        (torch.ones(3), ValueError, r"sinks: must be \(Hq,\)"),
        (torch.ones(2, dtype=torch.float16), TypeError, "sinks: must be float32"),
    ):
        with pytest.raises(kind, match=message):
            _C.forward(_C.DEVICE_CPU, slots(FORWARD_NAMES, (q, q, q, torch.empty_like(q)), sinks=bad), core_options())
    out, lse = torch.empty_like(q), torch.empty(1, 2, 4)
    _C.forward(_C.DEVICE_CPU, slots(FORWARD_NAMES, (q, q, q, out, lse), sinks=sinks), core_options())
    grads = [torch.empty_like(q) for _ in range(3)]
    with pytest.raises(ValueError, match="sink_grad"):
        _C.backward(
            _C.DEVICE_CPU,
            slots(BACKWARD_NAMES, (q, q, q, out, lse, out, torch.empty(1, 2, 4), *grads), sinks=sinks),
            core_options(),
        )
    with pytest.raises(ValueError, match="sink_grad"):
        _C.backward(
            _C.DEVICE_CPU,
            slots(
                BACKWARD_NAMES,
                (q, q, q, out, lse, out, torch.empty(1, 2, 4), *grads),
                sinks=sinks,
                sink_grad=torch.empty(1, 2, 3),
            ),
            core_options(),
        )
