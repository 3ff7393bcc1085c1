"""flash-attn 2.8's flash_attn.flash_attn_interface: its seven functions with its signatures, each
a thin layer over flashattn_mps's flash_attn_func, flash_attn_varlen_func and
flash_attn_with_kvcache (the packed variants split their packed tensor into views: no copy, and
gradients reach the packed tensor)."""

import torch

from flashattn_mps._flash_attn import dense_attention
from flashattn_mps._kvcache import flash_attn_with_kvcache as _with_kvcache
from flashattn_mps._options import FlashAttnInputError, given
from flashattn_mps._varlen import flash_attn_varlen_func as _varlen


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """qkv (batch, seqlen, 3, nheads, headdim) -> flash_attn_func's result."""
    q, k, v = _unpacked(qkv, 2, 3, "flash_attn_qkvpacked_func", "qkv", "(batch, seqlen, 3, nheads, headdim)")
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs
    )


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q (batch, seqlen_q, nheads, headdim), kv (batch, seqlen_k, 2, nheads_k, headdim)."""
    k, v = _unpacked(kv, 2, 2, "flash_attn_kvpacked_func", "kv", "(batch, seqlen_k, 2, nheads_k, headdim)")
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs
    )


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flashattn_mps.flash_attn_func (without its sinks keyword, which flash-attn 2 lacks)."""
    return dense_attention(
        "flash_attn_func",
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        None,
        with_lse=return_attn_probs,
        with_probs=return_attn_probs,
    )


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """qkv (total, 3, nheads, headdim), one set of prefix sums for queries and keys."""
    q, k, v = _unpacked(qkv, 1, 3, "flash_attn_varlen_qkvpacked_func", "qkv", "(total, 3, nheads, headdim)")
    return _varlen(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q (total_q, nheads, headdim), kv (total_k, 2, nheads_k, headdim)."""
    k, v = _unpacked(kv, 1, 2, "flash_attn_varlen_kvpacked_func", "kv", "(total_k, 2, nheads_k, headdim)")
    return _varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """flashattn_mps.flash_attn_varlen_func (without its sinks keyword)."""
    return _varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        block_table,
    )


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """flashattn_mps.flash_attn_with_kvcache (without its sinks keyword)."""
    return _with_kvcache(
        q,
        k_cache,
        v_cache,
        k,
        v,
        rotary_cos,
        rotary_sin,
        cache_seqlens,
        cache_batch_idx,
        cache_leftpad,
        block_table,
        softmax_scale,
        causal,
        window_size,
        softcap,
        rotary_interleaved,
        alibi_slopes,
        num_splits,
        return_softmax_lse,
    )


def _unpacked(packed, dim: int, count: int, who: str, name: str, layout: str):
    """The packed tensor's `count` parts along `dim`, as views."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{who}: {name} must be a torch.Tensor {layout}, got {given(packed)}")
    if packed.dim() != len(layout.split(",")) or packed.shape[dim] != count:
        raise FlashAttnInputError(f"{who}: {name} must be {layout}, got {tuple(packed.shape)}")
    return packed.unbind(dim)
