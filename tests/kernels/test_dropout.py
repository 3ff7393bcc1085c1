"""Dropout in the kernels (metal/fa_dropout.h) and flash_attn_func's return_attn_probs: the generator
against Philox's published answers, the keep rate within binomial bounds, reproducibility under
torch.manual_seed, and outputs and gradients matching a float64 reference that applies the very mask
the kernels used (exposed through the probability pass), for prefill, decode with split-K, the simple
kernel, GQA, causal and windows, masks, every dtype, flash_attention, flash_attn_func and the SDPA
drop-in."""

from __future__ import annotations

import math
import struct

import pytest
import torch
import torch.nn.functional as F

import flashattn_mps
from flashattn_mps import _C, _api, _sources, explain_plan, flash_attention, flash_attn_func, metal_cpu
from flashattn_mps._options import AttentionOptions
from helpers import (
    ALL_DTYPES,
    FORWARD_NAMES,
    assert_gradients_match,
    core_options,
    max_error,
    randn,
    sample_product,
    slots,
    visible,
)
from helpers import reference as flash_reference


def keep_mask(q, k, v, rng_state, dropout_p):
    """(B, Hq, L, S) bool: which probabilities a call with this generator state keeps, read from the
    probability pass's signs (visiting every key: no band, no mask)."""
    lse = torch.zeros(q.shape[:-1], dtype=torch.float32)
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    probs = _api.probs_core(q, k, v, out, lse, None, AttentionOptions(1.0, False, dropout_p=dropout_p), rng_state)
    return ~torch.signbit(probs)


def seeded(seed):
    """The generator state a call on CPU tensors draws right after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    return _api.dropout_rng_state(torch.device("cpu"))


def reference(q, k, v, keep, dropout_p, **options):
    """test_flash_attn's reference with the probabilities outside `keep` dropped."""
    return flash_reference(q, k, v, dropout_mask=keep, dropout_p=dropout_p, **options)


def assert_close(actual, golden, same_dtype, what=""):
    """PyTorch's rule: error <= max(1e-5, 5 x the same-dtype reference's error)."""
    error, reference_error = max_error(actual, golden), max_error(same_dtype, golden)
    assert error <= max(1e-5, 5 * reference_error), (what, error, reference_error)


def check_forward(out, inputs, keep, dropout_p, **options):
    golden = reference(*[t.double() for t in inputs], keep, dropout_p, **options)
    assert out.shape == golden.shape and out.dtype == inputs[0].dtype
    assert_close(out, golden, reference(*inputs, keep, dropout_p, **options))


def check_gradients(leaves, out, dout, keep, dropout_p, sdpa_layout=lambda t: t, **options):
    """The gradients of out (SDPA layout) with respect to leaves, seen in SDPA layout."""
    grads = [sdpa_layout(g) for g in torch.autograd.grad(out, leaves, dout)]
    inputs = [sdpa_layout(t) for t in leaves]
    assert_gradients_match(grads, lambda *t: reference(*t, keep, dropout_p, **options), inputs, dout)


# --- the generator ---------------------------------------------------------------------------

PHILOX_KERNEL = """
kernel void philox(const device uint *input [[buffer(0)]], device uint *output [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  const uint4 words = fa_philox4x32_10(uint4(input[6 * i], input[6 * i + 1], input[6 * i + 2], input[6 * i + 3]),
                                       uint2(input[6 * i + 4], input[6 * i + 5]));
  for (int w = 0; w < 4; ++w) {
    output[4 * i + w] = words[w];
  }
}
"""

# Random123's known-answer vectors of philox4x32_10: (counter, key) -> output.
PHILOX_ANSWERS = [
    ((0, 0, 0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 6, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344, 0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def test_the_generator_is_philox4x32_10():
    root = _sources.metal_dir()
    lib = metal_cpu.compile_library(
        _sources.inline_includes(root / "fa_dropout.h", root) + PHILOX_KERNEL, name="philox.metal"
    )
    words = [w for inputs, _ in PHILOX_ANSWERS for w in inputs]
    input = torch.tensor(struct.unpack(f"{len(words)}i", struct.pack(f"{len(words)}I", *words)), dtype=torch.int32)
    output = torch.zeros(4 * len(PHILOX_ANSWERS), dtype=torch.int32)
    lib.dispatch(
        "philox",
        grid=(1, 1, 1),
        threadgroup=(len(PHILOX_ANSWERS), 1, 1),
        buffers=[input, output],
        constants={_C.FC_DROPOUT: _C.DROPOUT_APPLY},
    )
    got = struct.unpack(f"{output.numel()}I", struct.pack(f"{output.numel()}i", *output.tolist()))
    assert got == tuple(w for _, answer in PHILOX_ANSWERS for w in answer)


@pytest.mark.parametrize("dropout_p", [0.1, 0.5])
def test_keep_rate_within_binomial_bounds(gen, dropout_p):
    """2^18 probabilities: the kept fraction, and that of each of the four words of a Philox block
    (rows and keys even or odd), within 6 standard deviations of 1 - p."""
    q, k = randn(gen, 2, 4, 128, 8), randn(gen, 2, 2, 256, 8)
    keep = keep_mask(q, k, k, seeded(3), dropout_p)
    for part in (keep, keep[:, :, 0::2, 0::2], keep[:, :, 0::2, 1::2], keep[:, :, 1::2, 0::2], keep[:, :, 1::2, 1::2]):
        n = part.numel()
        bound = 6 * math.sqrt(n * dropout_p * (1 - dropout_p))
        assert abs(part.sum().item() - n * (1 - dropout_p)) <= bound, (part.shape, part.float().mean().item())


def test_the_mask_is_a_function_of_the_state_and_the_position(gen):
    q, k = randn(gen, 2, 3, 20, 8), randn(gen, 2, 3, 30, 8)
    first, again, other = (
        keep_mask(q, k, k, seeded(1), 0.5),
        keep_mask(q, k, k, seeded(1), 0.5),
        keep_mask(q, k, k, seeded(2), 0.5),
    )
    assert torch.equal(first, again) and not torch.equal(first, other)
    # A smaller problem with the same state sees the same decisions at the same (b, h, i, j).
    assert torch.equal(
        keep_mask(q[:1, :2, :10], k[:1, :2, :17], k[:1, :2, :17], seeded(1), 0.5), first[:1, :2, :10, :17]
    )
    # Heads, batches and rows get different decisions.
    assert not torch.equal(first[0, 0], first[0, 1]) and not torch.equal(first[0], first[1])
    assert not torch.equal(first[..., 0::2, :], first[..., 1::2, :])


def test_seeds_reproduce_and_consecutive_calls_differ(gen):
    q, k, v = randn(gen, 1, 2, 24, 16), randn(gen, 1, 2, 40, 16), randn(gen, 1, 2, 40, 16)
    torch.manual_seed(7)
    first = flash_attention(q, k, v, dropout_p=0.3)
    second = flash_attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(7)
    assert torch.equal(flash_attention(q, k, v, dropout_p=0.3), first)
    assert not torch.equal(first, second)
    torch.manual_seed(7)
    out = flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=0.3, return_attn_probs=True
    )[0]
    torch.manual_seed(7)  # asking for the probabilities changes nothing else
    assert torch.equal(flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=0.3), out)


# --- exact references with the exposed mask ---------------------------------------------------

# (causal, window, Hq, Hkv): flash-attn's bottom-right options and GQA.
FLASH_VARIANTS = [(False, (-1, -1), 2, 2), (True, (-1, -1), 4, 2), (False, (5, 3), 4, 1), (True, (7, -1), 2, 1)]
FLASH_LENGTHS = [(37, 53), (53, 37), (3, 70), (24, 24)]
FLASH_CASES = sample_product(
    [FLASH_LENGTHS, FLASH_VARIANTS, ALL_DTYPES, [0.2, 0.6]],
    count=8,
    seed=21,
    cost=lambda c: c[0][0] * c[0][1],
    per_value=1,
    max_cost=3000,
)


@pytest.mark.parametrize("lengths, variant, dtype, dropout_p", FLASH_CASES)
def test_flash_attn_func_matches_the_exposed_mask(gen, lengths, variant, dtype, dropout_p):
    """Output, softmax_lse, S_dmask and the gradients of q, k, v: exact against the reference applying
    the mask S_dmask shows (the backward regenerates the forward's mask, or the gradients differ)."""
    (l, s), (causal, window, hq, hkv) = lengths, variant
    q, k, v = (
        randn(gen, 1, l, hq, 32, dtype=dtype),
        randn(gen, 1, s, hkv, 32, dtype=dtype),
        randn(gen, 1, s, hkv, 16, dtype=dtype),
    )
    inputs = [t.requires_grad_() for t in (q * 2, k, v)]
    out, lse, probs = flash_attn_func(
        *inputs, dropout_p=dropout_p, causal=causal, window_size=window, return_attn_probs=True
    )
    assert probs.shape == (1, hq, l, s) and probs.dtype == dtype and lse.shape == (1, hq, l)
    keep = ~torch.signbit(probs)
    sdpa_inputs = [t.transpose(1, 2) for t in inputs]
    options = dict(causal=causal, bottom_right=True, window=window)
    check_forward(out.transpose(1, 2), sdpa_inputs, keep, dropout_p, **options)
    # |S_dmask| is the undropped softmax, lse its normaliser.
    scores = (
        sdpa_inputs[0].detach().double()
        @ sdpa_inputs[1].detach().double().repeat_interleave(hq // hkv, 1).transpose(-1, -2)
    ) * 32**-0.5
    seen = visible(l, s, causal, True, window)
    golden_probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1).nan_to_num(0.0)
    assert max_error(probs.abs(), golden_probs) <= {torch.float32: 1e-5}.get(dtype, 1e-2)
    golden_lse = torch.logsumexp(scores.masked_fill(~seen, float("-inf")), -1)
    rows = seen.any(-1)
    assert max_error(lse[..., rows], golden_lse[..., rows]) <= 1e-4 * max(1.0, golden_lse[..., rows].abs().max().item())
    dout = randn(gen, 1, l, hq, 16, dtype=dtype)
    check_gradients(
        inputs, out.transpose(1, 2), dout.transpose(1, 2), keep, dropout_p, lambda t: t.transpose(1, 2), **options
    )


def test_dropout_with_softcap_and_alibi(gen):
    """Dropout after every score variant: softcap and ALiBi (bottom-right), forward and gradients."""
    q, k, v = randn(gen, 2, 19, 4, 32), randn(gen, 2, 27, 2, 32), randn(gen, 2, 27, 2, 16)
    inputs = [t.requires_grad_() for t in (q * 3, k, v)]
    alibi = torch.rand(2, 4, generator=gen)
    out, _, probs = flash_attn_func(
        *inputs, dropout_p=0.3, window_size=(9, 4), softcap=1.5, alibi_slopes=alibi, return_attn_probs=True
    )
    keep = ~torch.signbit(probs)
    options = dict(bottom_right=True, window=(9, 4), softcap=1.5, alibi=alibi)
    check_forward(out.transpose(1, 2), [t.transpose(1, 2) for t in inputs], keep, 0.3, **options)
    check_gradients(
        inputs, out.transpose(1, 2), randn(gen, 2, 4, 19, 16), keep, 0.3, lambda t: t.transpose(1, 2), **options
    )


KERNEL_CASES = sample_product(
    [
        [(40, 56), (5, 33), (2, 1100)],
        ["forward", "decode", "simple"],
        ALL_DTYPES,
        ["none", "causal", "window", "bool", "additive"],
    ],
    count=10,
    seed=4,
    cost=lambda c: c[0][0] * c[0][1],
    per_value=2,
    max_cost=4000,
)
KERNEL_CASES += [((2, 1100), "decode", torch.float16, "bool"), ((2, 1100), "decode", torch.bfloat16, "additive")]


def kernel_mask(gen, kind, l, s, dtype):
    if kind == "bool":
        return torch.rand(l, s, generator=gen) > 0.3
    if kind == "additive":
        return randn(gen, 1, 1, l, s, dtype=dtype)
    return None


@pytest.mark.parametrize("lengths, kernel, dtype, masking", KERNEL_CASES)
def test_every_forward_kernel_matches_the_mask(gen, lengths, kernel, dtype, masking):
    """flash_attention's forward kernels (split-K decode for S = 1100) with dropout, SDPA layout and
    top-left causal, against the reference applying the generator's mask for the same seed."""
    l, s = lengths
    q, k, v = (
        randn(gen, 1, 4, l, 40, dtype=dtype),
        randn(gen, 1, 2, s, 40, dtype=dtype),
        randn(gen, 1, 2, s, 24, dtype=dtype),
    )
    mask = kernel_mask(gen, masking, l, s, dtype)
    options = dict(causal=masking == "causal", window=(6, 2) if masking == "window" else None, attn_mask=mask)
    if kernel == "decode" and s == 1100 and masking in ("none", "bool", "additive"):
        assert explain_plan(q, k, v, attn_mask=mask, kernel="decode")["split_count"] > 1
    torch.manual_seed(11)
    out = flash_attention(
        q, k, v, options["causal"], attn_mask=mask, window_size=options["window"], kernel=kernel, dropout_p=0.4
    )
    check_forward(out, (q, k, v), keep_mask(q, k, v, seeded(11), 0.4), 0.4, **options)


@pytest.mark.parametrize(
    "lengths, masking, dtype",
    [
        ((3, 600), "none", torch.float32),
        ((3, 600), "causal", torch.bfloat16),
        ((33, 47), "bool", torch.float16),
        ((29, 41), "additive", torch.float32),
        ((40, 40), "causal", torch.float16),
        ((40, 40), "none", torch.bfloat16),
    ],
)
def test_flash_attention_gradients_match_the_mask(gen, lengths, masking, dtype):
    """The backward (dK/dV and dQ kernels, delta of the dropped output) against the reference with the
    forward's mask; L = 3 runs the decode kernel forward (split-K at S = 600)."""
    l, s = lengths
    q, k, v = (
        randn(gen, 1, 4, l, 16, dtype=dtype),
        randn(gen, 1, 2, s, 16, dtype=dtype),
        randn(gen, 1, 2, s, 8, dtype=dtype),
    )
    mask = kernel_mask(gen, masking, l, s, dtype)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    torch.manual_seed(5)
    out = flash_attention(*inputs, masking == "causal", attn_mask=mask, dropout_p=0.25)
    keep = keep_mask(q.detach(), k.detach(), v.detach(), seeded(5), 0.25)
    check_gradients(
        inputs, out, randn(gen, 1, 4, l, 8, dtype=dtype), keep, 0.25, causal=masking == "causal", attn_mask=mask
    )


def test_every_kernel_is_specialised_for_dropout(gen):
    """Function constant FA_FC_DROPOUT, not a macro: no new library per rate, and off without dropout."""
    q = randn(gen, 1, 2, 40, 16)
    for kernel in ("forward", "decode", "simple"):
        plain, dropped = (explain_plan(q, q, q, kernel=kernel, dropout_p=p)["dispatches"] for p in (0.0, 0.1))
        assert [d["constants"][_C.FC_DROPOUT] for d in plain] == [_C.DROPOUT_NONE] * len(plain)
        assert [d["constants"][_C.FC_DROPOUT] for d in dropped] == [_C.DROPOUT_APPLY] * len(dropped)
        assert [d["macros"] for d in plain] == [d["macros"] for d in dropped]


def test_unbatched_inputs(gen):
    """(H, L, E) inputs drop as batch 0 of the batched call with the same state."""
    q, k, v = randn(gen, 2, 9, 16), randn(gen, 2, 13, 16), randn(gen, 2, 13, 16)
    torch.manual_seed(4)
    out = flash_attention(q, k, v, dropout_p=0.5)
    keep = keep_mask(q[None], k[None], v[None], seeded(4), 0.5)
    assert torch.equal(keep_mask(q, k, v, seeded(4), 0.5), keep[0])
    check_forward(out[None], (q[None], k[None], v[None]), keep, 0.5)


def test_extreme_rates(gen):
    """p = 1 drops everything (zeros, as torch's dropout); a tiny p keeps (nearly) everything."""
    q, k, v = randn(gen, 1, 2, 12, 16), randn(gen, 1, 2, 20, 16), randn(gen, 1, 2, 20, 16)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*inputs, dropout_p=1.0)
    assert torch.equal(out, torch.zeros_like(out))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in torch.autograd.grad(out.sum(), inputs))
    assert max_error(flash_attention(q, k, v, dropout_p=1e-12), F.scaled_dot_product_attention(q, k, v).double()) < 1e-5


# --- the SDPA drop-in, compile, the ops -------------------------------------------------------


def test_sdpa_drop_in_runs_dropout_in_the_kernels(gen, core_calls):
    q, k, v = randn(gen, 2, 3, 17, 16), randn(gen, 2, 3, 23, 16), randn(gen, 2, 3, 23, 16)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    assert flashattn_mps.explain(q, k, v, dropout_p=0.3).startswith("flashattn_mps kernels")
    torch.manual_seed(9)
    out = flashattn_mps.scaled_dot_product_attention(*inputs, dropout_p=0.3, is_causal=True)
    assert core_calls["forward"] == 1
    keep = keep_mask(q.detach(), k.detach(), v.detach(), seeded(9), 0.3)
    check_forward(out.detach(), [t.detach() for t in inputs], keep, 0.3, causal=True)
    check_gradients(inputs, out, randn(gen, 2, 3, 17, 16), keep, 0.3, causal=True)
    assert core_calls["backward"] == 1


def test_compiled_dropout_reproduces_eager(gen):
    q, k, v = randn(gen, 1, 2, 16, 16), randn(gen, 1, 2, 16, 16), randn(gen, 1, 2, 16, 16)

    def attention(q, k, v):
        return flash_attention(q, k, v, dropout_p=0.5) * 2

    torch._dynamo.reset()
    compiled = torch.compile(attention, backend="aot_eager", fullgraph=True)
    torch.manual_seed(3)
    got = compiled(q, k, v)
    torch.manual_seed(3)
    assert torch.equal(got, attention(q, k, v))


def test_opcheck_with_dropout(gen):
    q, k, v = randn(gen, 1, 4, 10, 16), randn(gen, 1, 2, 14, 16), randn(gen, 1, 2, 14, 8)
    rng = seeded(0)
    torch.library.opcheck(
        torch.ops.flashattn_mps.attention_forward.default,
        (q.requires_grad_(), k, v, None, True, 0.25, None, False, 0.0, None, 0.5, rng),
    )
    out, lse = torch.ops.flashattn_mps.attention_forward(
        q.detach(), k, v, None, True, 0.25, None, False, 0.0, None, 0.5, rng
    )
    dout = randn(gen, 1, 4, 10, 8)
    torch.library.opcheck(
        torch.ops.flashattn_mps.attention_backward.default,
        (dout, q.detach(), k, v, out, lse, None, True, 0.25, None, 0.0, None, 0.5, rng),
    )
    torch.library.opcheck(
        torch.ops.flashattn_mps.attention_probs.default,
        (q.detach(), k, v, out, lse, True, 0.25, [0, -1, -1], 0.0, None, 0.5, rng),
    )


def test_bad_dropout_arguments_are_refused(gen):
    q = randn(gen, 1, 2, 8, 16)
    for value, error in (
        (1.5, ValueError),
        (-0.1, ValueError),
        (float("nan"), ValueError),
        ("0.1", TypeError),
        (True, TypeError),
    ):
        with pytest.raises(error, match="dropout_p"):
            flash_attention(q, q, q, dropout_p=value)
        with pytest.raises(error, match="dropout_p"):
            flash_attn_func(q, q, q, dropout_p=value)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="rng_state"):  # the core insists on a generator state
        _C.forward(_C.DEVICE_CPU, slots(FORWARD_NAMES, (q, q, q, out)), core_options(scale=0.25, dropout_p=0.5))
    with pytest.raises(ValueError, match="rng_state: must hold 4 words"):
        _C.forward(
            _C.DEVICE_CPU,
            slots(FORWARD_NAMES, (q, q, q, out), rng_state=torch.zeros(3, dtype=torch.float32)),
            core_options(scale=0.25, dropout_p=0.5),
        )
    with pytest.raises(ValueError, match="dropout_p"):
        _C.forward(_C.DEVICE_CPU, slots(FORWARD_NAMES, (q, q, q, out)), core_options(scale=0.25, dropout_p=2.0))
    with pytest.raises(ValueError, match="write_probs: the probability pass runs the simple kernel"):
        _C.forward(
            _C.DEVICE_CPU,
            slots(FORWARD_NAMES, (q, q, q, out), rng_state=torch.zeros(4, dtype=torch.float32)),
            core_options(scale=0.25, dropout_p=0.5, write_probs=True, kernel=_C.KERNEL_DECODE),
        )
