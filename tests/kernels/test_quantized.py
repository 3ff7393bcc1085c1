"""Quantized K/V read in place (flashattn_mps.quantize_kv, QuantizedKV): the format (MLX's affine
rule, the nibble order, constant groups), views, bad input named by argument, and the decode (with
split-K) and prefill kernels against float64 attention on the DEQUANTIZED K/V, over a sampled
product of bits, group sizes, dtypes, which operand is quantized, the options, GQA and cache
layouts (slices of preallocated caches, read through their strides)."""

from __future__ import annotations

import random

import pytest
import torch

from flashattn_mps import (
    _C,
    QuantizedKV,
    _sources,
    explain_plan,
    flash_attention,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    quantize_kv,
)
from helpers import (
    ALL_DTYPES,
    FORWARD_NAMES,
    check,
    check_packed,
    core_options,
    max_error,
    packed_inputs,
    prefix_sums,
    randn,
    reference,
    slots,
)


def test_quantize_kv_follows_the_affine_rule():
    gen = torch.Generator().manual_seed(0)
    x = randn(gen, 3, 5, 128)
    x[0, 0, :64] = 0.25  # a constant group: scale 0, exact
    for bits in (8, 4):
        for group in (32, 64, 128):
            kq = quantize_kv(x, bits=bits, group_size=group)
            levels = 2**bits - 1
            groups = x.unflatten(-1, (128 // group, group))
            assert kq.shape == x.shape and kq.dtype == x.dtype and kq.device == x.device
            assert kq.data.dtype == torch.uint8 and kq.data.shape == (3, 5, 128 * bits // 8)
            assert kq.scales.shape == kq.biases.shape == (3, 5, 128 // group)
            assert torch.equal(kq.biases, groups.amin(-1))
            torch.testing.assert_close(kq.scales, (groups.amax(-1) - groups.amin(-1)) / levels)
            error = (kq.dequantize() - x).abs().unflatten(-1, (128 // group, group)).amax(-1)
            assert (error <= kq.scales * 0.5001 + 1e-6).all()  # round to nearest
            if group <= 64:
                assert (
                    torch.equal(kq.dequantize()[0, 0, :64], x[0, 0, :64])
                    and (kq.scales[0, 0, : 64 // group] == 0).all()
                )
    four = quantize_kv(torch.arange(32.0).repeat(2), bits=4, group_size=32)  # q = round(i * 15 / 31)
    assert four.data[0].item() == 0 | (round(1 * 15 / 31) << 4) and four.data[1].item() == 1 | (1 << 4)


def test_scales_keep_the_dtype_and_views_share_storage():
    gen = torch.Generator().manual_seed(1)
    for dtype in ALL_DTYPES:
        cache = quantize_kv(randn(gen, 2, 3, 40, 64, dtype=dtype), bits=4, group_size=32)
        assert cache.scales.dtype == cache.biases.dtype == cache.dtype == dtype
        rows = cache.narrow(2, 5, 20)
        assert (
            rows.shape == (2, 3, 20, 64)
            and rows.data.untyped_storage().data_ptr() == cache.data.untyped_storage().data_ptr()
        )
        assert torch.equal(rows.dequantize(), cache.dequantize()[:, :, 5:25])
        half = cache.narrow(-1, 32, 32)
        assert half.shape == (2, 3, 40, 32) and torch.equal(half.dequantize(), cache.dequantize()[..., 32:])
        swapped = cache.transpose(1, 2)
        assert swapped.shape == (2, 40, 3, 64) and torch.equal(swapped.dequantize(), cache.dequantize().transpose(1, 2))


def test_bad_input_is_named():
    x = torch.randn(1, 2, 8, 64)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        quantize_kv(x, bits=3)
    with pytest.raises(ValueError, match="group_size must be 32, 64 or 128"):
        quantize_kv(x, group_size=16)
    with pytest.raises(ValueError, match="multiple of group_size 128"):
        quantize_kv(torch.randn(2, 96), group_size=128)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        quantize_kv(x.to(torch.int32))
    kq = quantize_kv(x)
    with pytest.raises(TypeError, match="data must be uint8"):
        QuantizedKV(kq.data.to(torch.int16), kq.scales, kq.biases, 8, 64)
    with pytest.raises(ValueError, match=r"scales and biases must be \(1, 2, 8, 1\)"):
        QuantizedKV(kq.data, kq.scales[..., :0], kq.biases, 8, 64)
    with pytest.raises(ValueError, match="one device"):
        QuantizedKV(kq.data, kq.scales.to("meta"), kq.biases, 8, 64)
    with pytest.raises(ValueError, match="multiples of the group size"):
        kq.narrow(-1, 0, 32)
    q = torch.randn(1, 4, 1, 64)
    with pytest.raises(TypeError, match="only k and v may be a QuantizedKV"):
        flash_attention(kq, kq, kq)
    with pytest.raises(TypeError, match="share one dtype"):
        flash_attention(q.half(), kq, kq)
    with pytest.raises(ValueError, match="same head dim"):
        flash_attention(torch.randn(1, 4, 1, 32), kq, kq)
    with pytest.raises(ValueError, match="one device"):
        flash_attention(q.to("meta"), kq, kq)
    with pytest.raises(ValueError, match="no gradient flows through quantized K/V"):
        flash_attention(q.requires_grad_(), kq, kq)
    with pytest.raises(ValueError, match="no gradient flows through quantized K/V"):
        flash_attention(q.detach(), kq, kq, sinks=torch.zeros(4, requires_grad=True))
    with pytest.raises(ValueError, match="quantized K/V are read by the prefill and decode kernels only"):
        flash_attention(q.detach(), kq, kq, kernel="simple")


def test_the_core_refuses_disagreeing_tensors():
    """The C layer's own checks, for callers that bypass the Python ones: never a wrong read."""
    x = torch.randn(1, 2, 8, 64)
    q, kq = torch.randn(1, 2, 1, 64), quantize_kv(x, bits=4, group_size=32)
    out = torch.empty(1, 2, 1, 64)
    tensors = slots(FORWARD_NAMES, (q, kq.data, x, out), k_scales=kq.scales, k_biases=kq.biases)
    quant = dict(k_bits=4, k_group_size=32)
    _C.forward(_C.DEVICE_CPU, tensors, core_options(scale=0.125, **quant))  # agrees: runs
    with pytest.raises(ValueError, match="k_scales .* must be"):
        _C.forward(_C.DEVICE_CPU, {**tensors, "k_scales": kq.scales[..., :1]}, core_options(**quant))
    with pytest.raises(TypeError, match="must have q's dtype"):
        _C.forward(_C.DEVICE_CPU, {**tensors, "k_biases": kq.biases.half()}, core_options(**quant))
    with pytest.raises(ValueError, match="k_bits: must be 0"):
        _C.forward(_C.DEVICE_CPU, tensors, core_options(k_bits=2, k_group_size=32))
    with pytest.raises(ValueError, match="k_group_size: must be 32, 64 or 128"):
        _C.forward(_C.DEVICE_CPU, tensors, core_options(k_bits=4, k_group_size=48))
    with pytest.raises(ValueError, match="k_scales and k_biases: required"):
        _C.forward(_C.DEVICE_CPU, {**tensors, "k_biases": None}, core_options(**quant))
    with pytest.raises(TypeError, match="quantized data must be uint8"):
        _C.forward(_C.DEVICE_CPU, {**tensors, "k": x}, core_options(**quant))
    with pytest.raises(ValueError, match="not quantized"):
        _C.forward(_C.DEVICE_CPU, slots(FORWARD_NAMES, (q, x, x, out), k_scales=kq.scales), core_options())
    with pytest.raises(TypeError, match="not an attention dtype"):
        _C.forward(_C.DEVICE_CPU, slots(FORWARD_NAMES, (kq.data, x, x, out)), core_options())


# (causal, window_size, softcap, ALiBi, sinks): each option alone and together.
VARIANTS = [
    (False, None, 0.0, False, False),
    (True, None, 0.0, False, False),
    ("bottom_right", (7, -1), 0.0, False, False),
    (False, None, 1.5, False, False),
    (True, None, 0.0, True, False),
    (False, None, 0.0, False, True),
    ("bottom_right", (5, -1), 2.0, True, True),
]


def sampled_cases():
    """Decode (L <= 8; S = 2000 splits the keys) and prefill lengths, each with bits, group size,
    dtype, the quantized operands, an option set, GQA and layout drawn at random (seeded)."""
    rng = random.Random(28)
    lengths = [("decode", 1, 67), ("decode", 3, 400), ("decode", 1, 2000), ("decode", 8, 129), ("decode", 2, 2000)]
    lengths += [("forward", 37, 53), ("forward", 70, 130), ("forward", 24, 24), ("forward", 40, 9)]
    cases = []
    for kernel, l, s in lengths * 2:
        cases.append(
            (
                kernel,
                l,
                s,
                rng.choice([8, 4]),
                rng.choice([32, 64]),
                rng.choice(ALL_DTYPES),
                rng.choice(["k", "v", "kv", "kv"]),
                rng.choice(VARIANTS),
                rng.choice([1, 4]),
                rng.choice(["contiguous", "cache", "cache_blhd"]),
            )
        )
    return cases


def quantized_operand(gen, b, hkv, s, d, dtype, bits, group, layout):
    """A QuantizedKV (b, hkv, s, d): whole, or the first s rows of layer 1 of a preallocated quantized
    cache ((layers, b, hkv, s_max, d), or (layers, b, s_max, hkv, d) seen as (b, hkv, s, d))."""
    if layout == "contiguous":
        return quantize_kv(randn(gen, b, hkv, s, d, dtype=dtype), bits=bits, group_size=group)
    s_max = s + 13
    shape = (2, b, hkv, s_max, d) if layout == "cache" else (2, b, s_max, hkv, d)
    cache = quantize_kv(randn(gen, *shape, dtype=dtype), bits=bits, group_size=group)
    layer = QuantizedKV(cache.data[1], cache.scales[1], cache.biases[1], bits, group)
    return layer.narrow(2, 0, s) if layout == "cache" else layer.narrow(1, 0, s).transpose(1, 2)


@pytest.mark.parametrize("case", sampled_cases(), ids=lambda c: "-".join(map(str, c[:8])))
def test_attention_matches_the_dequantized_reference(case):
    kernel, l, s, bits, group, dtype, which, variant, gqa, layout = case
    causal, window, softcap, alibi, with_sinks = variant
    gen = torch.Generator().manual_seed(hash(case[:3]) % 2**31)
    b, hkv, e = 1, 2, 64
    q = randn(gen, b, hkv * gqa, l, e, dtype=dtype) * 2
    k = quantized_operand(gen, b, hkv, s, e, dtype, bits, group, layout)
    v = quantized_operand(gen, b, hkv, s, e, dtype, bits, group, layout)
    k = k if "k" in which else k.dequantize()
    v = v if "v" in which else v.dequantize()
    slopes = torch.rand(hkv * gqa, generator=gen) * 0.3 if alibi else None
    sinks = torch.randn(hkv * gqa, generator=gen) if with_sinks else None
    out = flash_attention(
        q, k, v, causal=causal, kernel=kernel, window_size=window, softcap=softcap, alibi_slopes=slopes, sinks=sinks
    )
    dense = [t.dequantize() if isinstance(t, QuantizedKV) else t for t in (k, v)]
    check(
        out,
        (q, *dense),
        causal=causal is not False,
        bottom_right=causal == "bottom_right",
        window=window,
        softcap=softcap,
        alibi=slopes,
        sinks=sinks,
    )


def test_long_decode_splits_and_explain_counts_quantized_bytes():
    gen = torch.Generator().manual_seed(3)
    q = randn(gen, 1, 8, 1, 128, dtype=torch.float16)
    x = randn(gen, 1, 2, 4096, 128, dtype=torch.float16)
    plain = explain_plan(q, x, x)
    read = {}
    for bits in (8, 4):
        kq = quantize_kv(x, bits=bits, group_size=64)
        plan = explain_plan(q, kq, kq)
        assert plan["split_count"] > 1
        read[bits] = plan["dispatches"][0]["cost"]["min_bytes_read"]
    kv_rows = 2 * 2 * 4096
    q_bytes = 8 * 128 * 2
    assert plain["dispatches"][0]["cost"]["min_bytes_read"] == q_bytes + kv_rows * 128 * 2
    assert read[8] == q_bytes + kv_rows * (128 + 2 * 2 * 2)  # bytes, and a scale and a bias per group of 64
    assert read[4] == q_bytes + kv_rows * (64 + 2 * 2 * 2)


def cache_reference(q, k_cache, v_cache, seqlens, leftpad, **options):
    """Each batch entry against its keys leftpad .. seqlens - 1 of its cache row (flash-attn layout)."""
    outs = []
    for b in range(q.shape[0]):
        keys = slice(leftpad[b], seqlens[b])
        views = (q[b : b + 1], k_cache[b : b + 1, keys], v_cache[b : b + 1, keys])
        outs.append(reference(*[t.transpose(1, 2) for t in views], bottom_right=True, **options).transpose(1, 2))
    return torch.cat(outs)


def check_cache(out, q, k_cache, v_cache, seqlens, leftpad, **options):
    golden = cache_reference(q.double(), k_cache.double(), v_cache.double(), seqlens, leftpad, **options)
    same_dtype = cache_reference(q, k_cache, v_cache, seqlens, leftpad, **options)
    error, reference_error = max_error(out, golden), max_error(same_dtype, golden)
    assert error <= max(1e-5, 5 * reference_error), (error, reference_error)


@pytest.mark.parametrize("bits, dtype, paged", [(8, torch.float16, False), (4, torch.bfloat16, True)])
def test_kvcache_appends_quantize_in_place(bits, dtype, paged):
    """Appends over several calls (varlen keys: each sequence its own length and left padding) leave
    a cache equal to one quantized at once, every other row bitwise as it was; each call's output
    matches attention over the dequantized cache, decode (split-K) and prefill alike."""
    gen = torch.Generator().manual_seed(bits)
    b, hq, hkv, d, s_cache, page = 2, 8, 2, 64, 96, 16
    old_k, old_v = randn(gen, b, s_cache, hkv, d, dtype=dtype), randn(gen, b, s_cache, hkv, d, dtype=dtype)
    new_k_all, new_v_all = randn(gen, b, s_cache, hkv, d, dtype=dtype), randn(gen, b, s_cache, hkv, d, dtype=dtype)
    start, leftpad = torch.tensor([5, 17], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    written = torch.zeros(b, s_cache, dtype=torch.bool)
    order = torch.randperm(b * s_cache // page, generator=gen)  # paged: each sequence's pages scattered

    def layout(x):  # (b, s_cache, ...) as the cache holds it: rows, or a pool of pages
        if not paged:
            return x
        pages = x.reshape(b * s_cache // page, page, *x.shape[2:])
        return torch.empty_like(pages).index_copy_(0, order, pages)

    block_table = order.view(b, -1).int() if paged else None
    k_cache = quantize_kv(layout(old_k), bits=bits, group_size=32)
    v_cache = quantize_kv(layout(old_v), bits=bits, group_size=64)
    before = [t.clone() for t in (k_cache.data, k_cache.scales, k_cache.biases, v_cache.data, v_cache.scales)]
    seqlens = start.clone()
    for new, l in ((1, 1), (7, 7), (1, 3), (20, 20)):
        q = randn(gen, b, l, hq, d, dtype=dtype)
        rows = [range(int(seqlens[i]), int(seqlens[i]) + new) for i in range(b)]
        for i in range(b):
            written[i, rows[i]] = True
        out = flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            k=torch.stack([new_k_all[i, rows[i]] for i in range(b)]),
            v=torch.stack([new_v_all[i, rows[i]] for i in range(b)]),
            cache_seqlens=seqlens,
            cache_leftpad=leftpad,
            block_table=block_table,
            causal=True,
            num_splits=3 if l == 1 else 0,
        )
        seqlens += new
        dense_k, dense_v = k_cache.dequantize(), v_cache.dequantize()
        if paged:
            dense_k, dense_v = (x[block_table.long()].flatten(1, 2) for x in (dense_k, dense_v))
        check_cache(out, q, dense_k, dense_v, seqlens.tolist(), leftpad.tolist(), causal=True)
    mixed = [torch.where(written[:, :, None, None], new, old) for new, old in ((new_k_all, old_k), (new_v_all, old_v))]
    at_once = (
        quantize_kv(layout(mixed[0]), bits=bits, group_size=32),
        quantize_kv(layout(mixed[1]), bits=bits, group_size=64),
    )
    for cache, expected in zip((k_cache, v_cache), at_once):
        for part in ("data", "scales", "biases"):
            assert torch.equal(getattr(cache, part), getattr(expected, part))
    untouched = ~layout(written)
    for now, then in zip((k_cache.data, k_cache.scales, k_cache.biases, v_cache.data, v_cache.scales), before):
        assert torch.equal(now[untouched], then[untouched])


def test_the_quantization_is_part_of_the_plan_key():
    """Two calls whose K differs only in its group size (the same data, scales of another width)
    plan apart, and a repeated call finds its plan."""
    x = torch.randn(1, 2, 8, 64)
    q, out = torch.randn(1, 2, 1, 64), torch.empty(1, 2, 1, 64)
    _sources.ensure_registered()
    before = _C.plan_cache_counts()["forward_misses"]
    for group in (32, 64, 32, 64):
        kq = quantize_kv(x, bits=8, group_size=group)
        tensors = slots(FORWARD_NAMES, (q, kq.data, x, out), k_scales=kq.scales, k_biases=kq.biases)
        _C.forward_workspace_bytes(_C.DEVICE_CPU, tensors, core_options(scale=0.4375, k_bits=8, k_group_size=group))
    assert _C.plan_cache_counts()["forward_misses"] - before == 2


def test_quantized_plans_compile_no_library_the_strict_check_misses():
    """Quantization is function constants only: every library a quantized call plans (decode with
    its merge, prefill, head dims blocked above 256, each element type) is one of the
    specialisations the strict check and Apple's offline compile visit, and the plans carry the
    constants."""
    enumerated = {(source, tuple(sorted(macros))) for source, _, macros in _C.specialisations()}
    for dtype in ALL_DTYPES:
        for lq, s, e, kernel in ((1, 4096, 128, "decode"), (40, 64, 64, "forward"), (40, 64, 320, "forward")):
            q = torch.empty(1, 4, lq, e, dtype=dtype)
            kq = quantize_kv(torch.zeros(1, 2, s, e, dtype=dtype), bits=4, group_size=64)
            plan = explain_plan(q, kq, kq.dequantize(), kernel=kernel)
            for d in plan["dispatches"]:
                assert (d["source"], tuple(sorted(d["macros"].items()))) in enumerated
            assert plan["dispatches"][0]["constants"][_C.FC_K_BITS] == 4
            assert plan["dispatches"][0]["constants"][_C.FC_V_BITS] == 0


@pytest.mark.parametrize(
    "kernel, l, s, e", [("decode", 1, 1100, 64), ("forward", 40, 70, 64), ("forward", 33, 40, 320)]
)
def test_quantized_loads_run_clean_in_checked_mode(checked_core, kernel, l, s, e):
    """No out-of-bounds or uninitialised read in the quantized loads (split decode, prefill, head
    dims streamed in blocks), and the same bits as unchecked."""
    from flashattn_mps import metal_cpu as mc

    gen = torch.Generator().manual_seed(s)
    q = randn(gen, 1, 4, l, e)
    kq = quantize_kv(randn(gen, 1, 2, s, e), bits=4, group_size=64)
    vq = quantize_kv(randn(gen, 1, 2, s, 64), bits=8, group_size=32)
    out = flash_attention(q, kq, vq, causal="bottom_right", kernel=kernel)
    assert checked_core() >= 1
    mc.set_checked(False)
    assert torch.equal(out, flash_attention(q, kq, vq, causal="bottom_right", kernel=kernel))


@pytest.mark.parametrize("lens_q, lens_k, paged", [([1, 1, 1], [20, 7, 90], False), ([3, 12, 9], [20, 12, 40], True)])
def test_varlen_keys_read_quantized(lens_q, lens_k, paged):
    """flash_attn_varlen_func over packed quantized keys (each sequence its own length) and over a
    quantized page pool, decode and prefill: each sequence against the reference on its own
    dequantized keys."""
    gen = torch.Generator().manual_seed(len(lens_k) + paged)
    q, k, v = packed_inputs(gen, lens_q, lens_k, 8, 2, 64, 64, torch.float16)
    kq, vq = quantize_kv(k, bits=4, group_size=32), quantize_kv(v, bits=8, group_size=64)
    cu_q, cu_k = prefix_sums(lens_q), prefix_sums(lens_k)
    options = dict(causal=True, softcap=3.0)
    if not paged:
        out = flash_attn_varlen_func(q, kq, vq, cu_q, cu_k, max(lens_q), max(lens_k), **options)
    else:  # each sequence's keys in 8-row pages scattered through a pool
        page, pages = 8, 6
        order = torch.randperm(len(lens_k) * pages, generator=gen)
        block_table = order.view(len(lens_k), pages).int()
        pool = [torch.zeros(len(lens_k) * pages * page, 2, 64, dtype=torch.float16) for _ in range(2)]
        for b, (start, n) in enumerate(zip(cu_k[:-1].tolist(), lens_k)):
            rows = (block_table[b].long()[:, None] * page + torch.arange(page)).flatten()[:n]
            for target, source in zip(pool, (k, v)):
                target[rows] = source[start : start + n]
        pools = [
            quantize_kv(t.unflatten(0, (-1, page)), bits=b, group_size=g) for t, b, g in zip(pool, (4, 8), (32, 64))
        ]
        out = flash_attn_varlen_func(
            q, *pools, cu_q, cu_k, max(lens_q), max(lens_k), block_table=block_table, **options
        )
    check_packed(out, (q, kq.dequantize(), vq.dequantize()), lens_q, lens_k, **options)


@pytest.mark.parametrize("kernel, l", [("forward", 40), ("decode", 2)])
def test_wide_head_dims_stream_quantized_blocks(kernel, l):
    """E = Ev = 320: the prefill kernel streams K in 64-column blocks and splits the output into
    column blocks (a quantized V read from its block's first column on); the decode kernel holds
    12 columns per lane."""
    gen = torch.Generator().manual_seed(320)
    q = randn(gen, 1, 4, l, 320, dtype=torch.float16)
    kq = quantize_kv(randn(gen, 1, 2, 75, 320, dtype=torch.float16), bits=4, group_size=64)
    vq = quantize_kv(randn(gen, 1, 2, 75, 320, dtype=torch.float16), bits=8, group_size=32)
    out = flash_attention(q, kq, vq, causal="bottom_right", kernel=kernel)
    check(out, (q, kq.dequantize(), vq.dequantize()), causal=True, bottom_right=True)


@pytest.mark.parametrize("bits", [8, 4])
def test_decode_reads_aligned_bytes_as_vectors_and_others_element_by_element(bits):
    gen = torch.Generator().manual_seed(bits)
    q = randn(gen, 1, 4, 1, 128, dtype=torch.float16)
    aligned = quantize_kv(randn(gen, 1, 2, 300, 128, dtype=torch.float16), bits=bits, group_size=64)
    shifted = torch.empty(aligned.data.numel() + 1, dtype=torch.uint8)[1:].view(aligned.data.shape)
    shifted.copy_(aligned.data)  # the same bytes from an odd address: no vector loads
    unaligned = QuantizedKV(shifted, aligned.scales, aligned.biases, bits, 64)
    outs = []
    for kv, vectors in ((aligned, True), (unaligned, False)):
        plan = explain_plan(q, kv, kv)
        assert plan["dispatches"][0]["constants"][_C.FC_DECODE_VECTOR_LOADS] == vectors
        outs.append(flash_attention(q, kv, kv))
    check(outs[0], (q, aligned.dequantize(), aligned.dequantize()))
    assert torch.equal(outs[0], outs[1])
