"""flash-attention's own test cases (tests/test_flash_attn.py of Dao-AILab/flash-attention), run
through the flash_attn shim as code written for flash-attn would call it: the same reference
construction (a float32 "upcast" reference and a same-dtype "pt" one with reordered operations),
the same assertions and tolerances (the error of out, of the probabilities and of each gradient
at most 2x, or 3x for the separate dq/dk/dv, the pt reference's error; the dropout fraction
within 0.01, 0.025 with a window, of dropout_p). Written here from the test's description,
sampled to stay lean (the products of its parametrisations are far larger), on the CPU Metal
device. The dropout mask is read from S_dmask as the test reads it (>= 0 kept); S_dmask here is
exactly (B, H, L, S), so the test's conversion from flash-attn's padded layout is not needed."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

import flashattn_mps


@pytest.fixture(scope="module")
def fa():
    flashattn_mps.install_flash_attn_shim()
    import flash_attn
    from flash_attn import bert_padding

    assert getattr(flash_attn, "IS_FLASHATTN_MPS_SHIM", False)
    yield flash_attn, bert_padding
    flashattn_mps.uninstall_flash_attn_shim()


def visible_entries(batch, lq, lk, q_mask=None, k_mask=None, causal=False, window=(-1, -1)):
    """(B, L, S) bool: the keys each query sees, bottom-right aligned on each sequence's actual
    lengths (masks (B, L) / (B, S) True for valid tokens), and each row's diagonal."""
    q_len = torch.full((batch,), lq) if q_mask is None else q_mask.sum(-1)
    k_len = torch.full((batch,), lk) if k_mask is None else k_mask.sum(-1)
    rows = torch.arange(lq).view(1, lq, 1)
    cols = torch.arange(lk).view(1, 1, lk)
    diagonal = rows + (k_len - q_len).view(batch, 1, 1)
    visible = torch.ones(batch, lq, lk, dtype=torch.bool)
    left, right = window
    if causal:
        right = 0
    if right >= 0:
        visible &= cols <= diagonal + right
    if left >= 0:
        visible &= cols >= diagonal - left
    if k_mask is not None:
        visible &= k_mask.view(batch, 1, lk)
    if q_mask is not None:
        visible &= q_mask.view(batch, lq, 1)
    return visible, (diagonal - cols).abs()


def reference(
    q,
    k,
    v,
    q_mask=None,
    k_mask=None,
    causal=False,
    window=(-1, -1),
    softcap=0.0,
    alibi=None,
    upcast=True,
    reorder_ops=False,
    dropout_p=0.0,
    dropout_mask=None,
    with_probs=False,
):
    """Attention of (B, L, H, D) tensors from materialised scores, flash-attn's conventions:
    bottom-right causal and windows per sequence (visible_entries), softcap then ALiBi, rows with
    no key and padded queries give 0; dropout_mask (B, H, L, S) True where kept, the kept
    probabilities scaled by 1 / (1 - dropout_p). upcast: float32, else the inputs' dtype.
    reorder_ops: the scale applied to k instead of q. with_probs: also the (undropped)
    probabilities."""
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
    scale = 1 / math.sqrt(q.shape[-1])
    if reorder_ops:
        scores = torch.einsum("bthd,bshd->bhts", q, k * scale)
    else:
        scores = torch.einsum("bthd,bshd->bhts", q * scale, k)
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    b, lq, lk = q.shape[0], q.shape[1], k.shape[1]
    visible, distance = visible_entries(b, lq, lk, q_mask, k_mask, causal, window)
    if alibi is not None:
        slopes = alibi if alibi.dim() == 2 else alibi.expand(b, -1)
        scores = scores - slopes.view(b, -1, 1, 1).to(scores.dtype) * distance.unsqueeze(1).to(scores.dtype)
    scores = scores.masked_fill(~visible.unsqueeze(1), -math.inf)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    probs = probs.masked_fill(~visible.any(-1).view(b, 1, lq, 1), 0.0)
    dropped = probs if dropout_mask is None else probs.masked_fill(~dropout_mask, 0.0)
    out = torch.einsum("bhts,bshd->bthd", dropped, v * (1.0 / (1 - dropout_p)))
    if q_mask is not None:
        out = out.masked_fill(~q_mask.view(b, lq, 1, 1), 0.0)
    return (out.to(dtype), probs.to(dtype)) if with_probs else out.to(dtype)


def padding_mask(gen, length, batch, mode):
    """(batch, length) bool: full, or each row's valid prefix of a random length (at least 1...)."""
    if mode == "full":
        return torch.ones(batch, length, dtype=torch.bool)
    lengths = torch.randint(max(1, length - 20), length + 1, (batch,), generator=gen)
    return torch.arange(length).view(1, -1) < lengths.view(-1, 1)


def randn(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen).to(dtype)


def random_window(gen, seqlen_k):
    return tuple(torch.randint(0, seqlen_k, (2,), generator=gen).tolist())


def grads_of(out, inputs, g):
    return torch.autograd.grad(out, inputs, g)


def assert_within(actual, ref, pt, factor, slack=0.0):
    error = (actual - ref).abs().max().item()
    bound = factor * (pt - ref).abs().max().item() + slack
    assert error <= bound, (error, bound)


def sampled(axes, count, seed):
    product = list(itertools.product(*axes))
    return random.Random(seed).sample(product, min(count, len(product)))


# test_flash_attn_qkvpacked: (seqlen, d, causal, local, alibi, dtype)
QKVPACKED = sampled(
    [[97, 128, 200], [32, 64, 96], [False, True], [False, True], [False, True], [torch.float16, torch.bfloat16]], 6, 1
)


@pytest.mark.parametrize("seqlen, d, causal, local, alibi, dtype", QKVPACKED)
def test_flash_attn_qkvpacked(fa, seqlen, d, causal, local, alibi, dtype):
    flash_attn, _ = fa
    gen = torch.Generator().manual_seed(0)
    batch, heads = 2, 3
    window = random_window(gen, seqlen) if local else (-1, -1)
    qkv = randn(gen, batch, seqlen, 3, heads, d, dtype=dtype).requires_grad_()
    slopes = torch.rand(batch, heads, generator=gen) * 0.3 if alibi else None
    out = flash_attn.flash_attn_qkvpacked_func(qkv, 0.0, causal=causal, window_size=window, alibi_slopes=slopes)
    q, k, v = qkv.unbind(2)
    options = dict(causal=causal, window=window, alibi=slopes)
    out_ref = reference(q, k, v, **options)
    out_pt = reference(q, k, v, upcast=False, reorder_ops=True, **options)
    assert_within(out, out_ref, out_pt, 2)
    g = torch.randn(out.shape, generator=gen).to(dtype)
    (dqkv,) = grads_of(out, qkv, g)
    (dqkv_ref,) = grads_of(out_ref, qkv, g)
    (dqkv_pt,) = grads_of(out_pt, qkv, g)
    assert_within(dqkv, dqkv_ref, dqkv_pt, 2)


# test_flash_attn_output (kvpacked and not): (seqlen_q, seqlen_k, d, mha_type, causal, local, alibi, softcap, kvpacked, dtype)
OUTPUT = sampled(
    [
        [(113, 203), (128, 217), (108, 256), (1, 239), (512, 256)],
        [32, 64, 128],
        ["mha", "mqa", "gqa"],
        [False, True],
        [False, True],
        [False, True],
        [0.0, 50.0],
        [False, True],
        [torch.float16, torch.bfloat16],
    ],
    7,
    2,
)


@pytest.mark.parametrize("lengths, d, mha_type, causal, local, alibi, softcap, kvpacked, dtype", OUTPUT)
def test_flash_attn_output(fa, lengths, d, mha_type, causal, local, alibi, softcap, kvpacked, dtype):
    flash_attn, _ = fa
    gen = torch.Generator().manual_seed(0)
    seqlen_q, seqlen_k = lengths
    batch, heads = 2, 6
    heads_k = {"mha": heads, "mqa": 1, "gqa": 2}[mha_type]
    window = random_window(gen, seqlen_k) if local else (-1, -1)
    q = randn(gen, batch, seqlen_q, heads, d, dtype=dtype).requires_grad_()
    slopes = torch.rand(batch, heads, generator=gen) * 0.3 if alibi else None
    options = dict(causal=causal, window=window, alibi=slopes, softcap=softcap)
    if kvpacked:
        kv = randn(gen, batch, seqlen_k, 2, heads_k, d, dtype=dtype).requires_grad_()
        k, v = kv.unbind(2)
        out = flash_attn.flash_attn_kvpacked_func(
            q, kv, 0.0, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes
        )
        leaves = (q, kv)
    else:
        k = randn(gen, batch, seqlen_k, heads_k, d, dtype=dtype).requires_grad_()
        v = randn(gen, batch, seqlen_k, heads_k, d, dtype=dtype).requires_grad_()
        out = flash_attn.flash_attn_func(
            q, k, v, 0.0, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes
        )
        leaves = (q, k, v)
    out_ref = reference(q, k, v, **options)
    out_pt = reference(q, k, v, upcast=False, reorder_ops=True, **options)
    assert_within(out, out_ref, out_pt, 2)
    g = torch.randn(out.shape, generator=gen).to(dtype)
    for got, ref, pt in zip(grads_of(out, leaves, g), grads_of(out_ref, leaves, g), grads_of(out_pt, leaves, g)):
        assert_within(got, ref, pt, 3)


# test_flash_attn_output's dropout cases (dropout_p 0.17): (seqlen_q, seqlen_k, d, mha_type, causal, local, kvpacked, dtype)
DROPOUT = sampled(
    [
        [(113, 203), (128, 217), (108, 256)],
        [32, 64],
        ["mha", "gqa"],
        [False, True],
        [False, True],
        [False, True],
        [torch.float16, torch.bfloat16],
    ],
    3,
    5,
)


@pytest.mark.parametrize("lengths, d, mha_type, causal, local, kvpacked, dtype", DROPOUT)
def test_flash_attn_output_with_dropout(fa, lengths, d, mha_type, causal, local, kvpacked, dtype):
    flash_attn, _ = fa
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    seqlen_q, seqlen_k = lengths
    batch, heads, dropout_p = 2, 4, 0.17
    heads_k = {"mha": heads, "gqa": 2}[mha_type]
    window = random_window(gen, seqlen_k) if local else (-1, -1)
    q = randn(gen, batch, seqlen_q, heads, d, dtype=dtype).requires_grad_()
    flash = dict(causal=causal, window_size=window, return_attn_probs=True)
    if kvpacked:
        kv = randn(gen, batch, seqlen_k, 2, heads_k, d, dtype=dtype).requires_grad_()
        k, v = kv.unbind(2)
        out, _lse, s_dmask = flash_attn.flash_attn_kvpacked_func(q, kv, dropout_p, **flash)
        leaves = (q, kv)
    else:
        k = randn(gen, batch, seqlen_k, heads_k, d, dtype=dtype).requires_grad_()
        v = randn(gen, batch, seqlen_k, heads_k, d, dtype=dtype).requires_grad_()
        out, _lse, s_dmask = flash_attn.flash_attn_func(q, k, v, dropout_p, **flash)
        leaves = (q, k, v)
    dropout_mask = s_dmask >= 0
    attn = s_dmask.abs()
    visible, _ = visible_entries(batch, seqlen_q, seqlen_k, causal=causal, window=window)
    visible = visible.unsqueeze(1).expand_as(dropout_mask)
    dropout_fraction = (~dropout_mask & visible).sum().item() / visible.sum().item()
    options = dict(causal=causal, window=window, dropout_p=dropout_p, dropout_mask=dropout_mask, with_probs=True)
    out_ref, attn_ref = reference(q, k, v, **options)
    out_pt, attn_pt = reference(q, k, v, upcast=False, reorder_ops=True, **options)
    assert_within(out, out_ref, out_pt, 2)
    assert_within(attn, attn_ref, attn_pt, 2)
    assert abs(dropout_fraction - dropout_p) <= (0.01 if not local else 0.025)
    g = torch.randn(out.shape, generator=gen).to(dtype)
    for got, ref, pt in zip(grads_of(out, leaves, g), grads_of(out_ref, leaves, g), grads_of(out_pt, leaves, g)):
        assert_within(got, ref, pt, 3)


def unpadded(bert_padding, x, mask):
    """x (B, L, ...) as the packed rows of mask, a new leaf requiring grad, and its cu_seqlens/max."""
    rows, indices, cu, longest, _ = bert_padding.unpad_input(x.detach(), mask)
    return rows.detach().requires_grad_(), indices, cu, longest


# test_flash_attn_varlen_qkvpacked and test_flash_attn_varlen_output: (seqlen_q, seqlen_k, d,
# mha_type, causal, local, alibi, softcap, packing, dtype)
VARLEN = sampled(
    [
        [(113, 203), (128, 217), (108, 256), (1, 147), (128, 128)],
        [32, 64],
        ["mha", "gqa"],
        [False, True],
        [False, True],
        [False, True],
        [0.0, 50.0],
        ["none", "kv", "qkv"],
        [torch.float16, torch.bfloat16],
    ],
    7,
    3,
)


@pytest.mark.parametrize("lengths, d, mha_type, causal, local, alibi, softcap, packing, dtype", VARLEN)
def test_flash_attn_varlen_output(fa, lengths, d, mha_type, causal, local, alibi, softcap, packing, dtype):
    flash_attn, bert_padding = fa
    gen = torch.Generator().manual_seed(0)
    seqlen_q, seqlen_k = lengths
    if packing == "qkv":  # one set of lengths and heads for all three
        seqlen_k, mha_type = seqlen_q, "mha"
    batch, heads = 3, 4
    heads_k = {"mha": heads, "gqa": 2}[mha_type]
    window = random_window(gen, seqlen_k) if local else (-1, -1)
    q_mask = padding_mask(gen, seqlen_q, batch, "random")
    k_mask = q_mask if packing == "qkv" else padding_mask(gen, seqlen_k, batch, "random")
    q = randn(gen, batch, seqlen_q, heads, d, dtype=dtype)
    k = randn(gen, batch, seqlen_k, heads_k, d, dtype=dtype)
    v = randn(gen, batch, seqlen_k, heads_k, d, dtype=dtype)
    slopes = torch.rand(batch, heads, generator=gen) * 0.3 if alibi else None
    flash = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    if packing == "qkv":
        qkv_unpad, indices_q, cu_q, max_q = unpadded(bert_padding, torch.stack([q, k, v], 2), q_mask)
        out_unpad = flash_attn.flash_attn_varlen_qkvpacked_func(qkv_unpad, cu_q, max_q, 0.0, **flash)
        leaves_unpad = (qkv_unpad,)
        qkv = bert_padding.pad_input(qkv_unpad.detach(), indices_q, batch, seqlen_q).requires_grad_()
        q, k, v = qkv.unbind(2)
        leaves = (qkv,)
    else:
        q_unpad, indices_q, cu_q, max_q = unpadded(bert_padding, q, q_mask)
        q = bert_padding.pad_input(q_unpad.detach(), indices_q, batch, seqlen_q).requires_grad_()
        if packing == "kv":
            kv_unpad, indices_k, cu_k, max_k = unpadded(bert_padding, torch.stack([k, v], 2), k_mask)
            out_unpad = flash_attn.flash_attn_varlen_kvpacked_func(
                q_unpad, kv_unpad, cu_q, cu_k, max_q, max_k, 0.0, **flash
            )
            leaves_unpad = (q_unpad, kv_unpad)
            kv = bert_padding.pad_input(kv_unpad.detach(), indices_k, batch, seqlen_k).requires_grad_()
            k, v = kv.unbind(2)
            leaves = (q, kv)
        else:
            k_unpad, indices_k, cu_k, max_k = unpadded(bert_padding, k, k_mask)
            v_unpad, _, _, _ = unpadded(bert_padding, v, k_mask)
            out_unpad = flash_attn.flash_attn_varlen_func(
                q_unpad, k_unpad, v_unpad, cu_q, cu_k, max_q, max_k, 0.0, **flash
            )
            leaves_unpad = (q_unpad, k_unpad, v_unpad)
            k = bert_padding.pad_input(k_unpad.detach(), indices_k, batch, seqlen_k).requires_grad_()
            v = bert_padding.pad_input(v_unpad.detach(), indices_k, batch, seqlen_k).requires_grad_()
            leaves = (q, k, v)
    out = bert_padding.pad_input(out_unpad, indices_q, batch, seqlen_q)
    options = dict(q_mask=q_mask, k_mask=k_mask, causal=causal, window=window, alibi=slopes, softcap=softcap)
    out_ref = reference(q, k, v, **options)
    out_pt = reference(q, k, v, upcast=False, reorder_ops=True, **options)
    assert_within(out, out_ref, out_pt, 2)
    g = torch.randn(out.shape, generator=gen).to(dtype)
    grads = grads_of(out, leaves_unpad, g)
    indices = [indices_q] if packing == "qkv" else [indices_q] + [indices_k] * (len(leaves) - 1)
    lengths_of = [seqlen_q] + [seqlen_k] * (len(leaves) - 1)
    padded = [bert_padding.pad_input(d_, i, batch, n) for d_, i, n in zip(grads, indices, lengths_of)]
    factor = 2 if packing == "qkv" else 3
    for got, ref, pt in zip(padded, grads_of(out_ref, leaves, g), grads_of(out_pt, leaves, g)):
        assert_within(got, ref, pt, factor)


# test_flash_attn_kvcache (the cache appended in place, rotary, paged): (seqlen_q, seqlen_k, d,
# new_kv, rotary_interleaved, paged_block, causal, local, alibi, dtype)
KVCACHE = sampled(
    [
        [(1, 128), (3, 339), (64, 800), (1, 1)],
        [64],
        [False, True],
        [False, True],
        [None, 64],
        [False, True],
        [False, True],
        [False, True],
        [torch.float16, torch.bfloat16],
    ],
    6,
    4,
)


@pytest.mark.parametrize("lengths, d, new_kv, interleaved, paged_block, causal, local, alibi, dtype", KVCACHE)
def test_flash_attn_kvcache(fa, lengths, d, new_kv, interleaved, paged_block, causal, local, alibi, dtype):
    flash_attn, _ = fa
    from flash_attn.layers.rotary import apply_rotary_emb

    gen = torch.Generator().manual_seed(0)
    seqlen_q, seqlen_k = lengths
    batch, heads, heads_k = 2, 6, 2
    seqlen_new = seqlen_q if new_kv else 0
    window = random_window(gen, seqlen_k) if local else (-1, -1)
    q = randn(gen, batch, seqlen_q, heads, d, dtype=dtype)
    k_new = randn(gen, batch, seqlen_new, heads_k, d, dtype=dtype) if new_kv else None
    v_new = randn(gen, batch, seqlen_new, heads_k, d, dtype=dtype) if new_kv else None
    k_cache = randn(gen, batch, seqlen_k, heads_k, d, dtype=dtype)
    v_cache = randn(gen, batch, seqlen_k, heads_k, d, dtype=dtype)
    cache_seqlens = torch.randint(0, seqlen_k - seqlen_new + 1, (batch,), generator=gen, dtype=torch.int32)
    rotary_dim = d // 2
    angle = torch.rand(seqlen_k + seqlen_q, rotary_dim // 2, generator=gen) * 2 * math.pi
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    slopes = torch.rand(batch, heads, generator=gen) * 0.3 if alibi else None
    # The reference: rotate, append, then attention over each sequence's valid keys.
    if causal or local:
        q_ro = apply_rotary_emb(q, cos, sin, seqlen_offsets=cache_seqlens, interleaved=interleaved)
    else:
        q_ro = apply_rotary_emb(
            q.reshape(batch, 1, seqlen_q * heads, d), cos, sin, seqlen_offsets=cache_seqlens, interleaved=interleaved
        ).reshape(q.shape)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    if new_kv:
        k_ro = apply_rotary_emb(k_new, cos, sin, seqlen_offsets=cache_seqlens, interleaved=interleaved)
        for b in range(batch):
            at = int(cache_seqlens[b])
            k_ref[b, at : at + seqlen_new], v_ref[b, at : at + seqlen_new] = k_ro[b], v_new[b]
    k_mask = torch.arange(seqlen_k).view(1, -1) < (cache_seqlens + seqlen_new).view(-1, 1)
    if paged_block is None or seqlen_k % paged_block:
        k_cache_in, v_cache_in, table = k_cache, v_cache, None
    else:
        pages = batch * (seqlen_k // paged_block)
        order = torch.randperm(pages, generator=gen)
        table = order.view(batch, -1).to(torch.int32)
        k_cache_in = torch.empty(pages, paged_block, heads_k, d, dtype=dtype)
        v_cache_in = torch.empty_like(k_cache_in)
        k_cache_in[order] = k_cache.reshape(pages, paged_block, heads_k, d)
        v_cache_in[order] = v_cache.reshape(pages, paged_block, heads_k, d)
    out = flash_attn.flash_attn_with_kvcache(
        q,
        k_cache_in,
        v_cache_in,
        k_new,
        v_new,
        cos,
        sin,
        cache_seqlens,
        None,
        None,
        table,
        causal=causal,
        window_size=window,
        rotary_interleaved=interleaved,
        alibi_slopes=slopes,
    )
    options = dict(k_mask=k_mask, causal=causal, window=window, alibi=slopes)
    out_ref = reference(q_ro, k_ref, v_ref, **options)
    out_pt = reference(q_ro, k_ref, v_ref, upcast=False, reorder_ops=True, **options)
    if new_kv:  # the cache was appended in place
        k_now = k_cache_in if table is None else k_cache_in[table.long().flatten()].reshape(k_cache.shape)
        v_now = v_cache_in if table is None else v_cache_in[table.long().flatten()].reshape(v_cache.shape)
        assert torch.allclose(k_now, k_ref, rtol=1e-3, atol=1e-3)
        assert torch.equal(v_now, v_ref)
    mult = 3 if not alibi else 5
    assert_within(out, out_ref, out_pt, mult, 1e-5)
