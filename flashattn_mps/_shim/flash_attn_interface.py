"""FlashAttention-3's flash_attn_interface (Dao-AILab/flash-attention's hopper/), served by
flashattn_mps: its signatures (softmax_scale 4th positional, no dropout, page_table, seqused_k,
num_splits, pack_gqa) and return conventions (out, or (out, softmax_lse) with return_attn_probs /
return_softmax_lse). What it accepts but flashattn_mps does not run (qv, fp8 descales,
attention_chunk, sm_margin other than 0, seqused_q, scheduler_metadata, a varlen q in the KV
cache call, rotary_seqlens) raises NotImplementedError naming the argument. num_splits, pack_gqa
and deterministic are tuning choices with the same result: accepted (num_splits also steers the
KV cache call's split-K, as flashattn_mps's own)."""

from flashattn_mps._flash_attn import dense_attention
from flashattn_mps._kvcache import flash_attn_with_kvcache as _with_kvcache
from flashattn_mps._options import FlashAttnInputError, given
from flashattn_mps._shim.common import refuse, varlen_attention

MIRRORS = "3.0.0"  # flash-attention's hopper/ (FlashAttention-3) interface, as of its current sources


def _refuse_fa3(who, qv=None, q_descale=None, k_descale=None, v_descale=None, attention_chunk=0, sm_margin=0, **more):
    refuse(
        who,
        qv=qv is not None,
        q_descale=q_descale is not None,
        k_descale=k_descale is not None,
        v_descale=v_descale is not None,
        attention_chunk=attention_chunk != 0,
        sm_margin=sm_margin != 0,
        **more,
    )


def flash_attn_qkvpacked_func(
    qkv,
    softmax_scale=None,
    causal=False,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    deterministic=False,
    num_heads_q=None,
    sm_margin=0,
    return_attn_probs=False,
):
    """qkv (batch, seqlen, 3, nheads, headdim), or with num_heads_q (batch, seqlen, nheads_q + 2 *
    nheads_k, headdim) (GQA: q's heads, then k's, then v's)."""
    who = "flash_attn_qkvpacked_func"
    _refuse_fa3(who, None, q_descale, k_descale, v_descale, attention_chunk, sm_margin)
    if not hasattr(qkv, "dim") or qkv.dim() not in (4, 5):
        raise FlashAttnInputError(
            f"{who}: qkv must be 5-D (batch, seqlen, 3, nheads, headdim) or 4-D, got {given(qkv)}"
        )
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise FlashAttnInputError(f"{who}: qkv must be (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
        q, k, v = qkv.unbind(2)
    else:
        heads_k = None if num_heads_q is None else (qkv.shape[2] - num_heads_q) // 2
        if heads_k is None or heads_k < 1 or num_heads_q + 2 * heads_k != qkv.shape[2]:
            raise FlashAttnInputError(
                f"{who}: a 4-D qkv (batch, seqlen, nheads_q + 2 * nheads_k, headdim) needs num_heads_q that "
                f"leaves two equal key and value parts, got qkv {tuple(qkv.shape)} and num_heads_q={num_heads_q}"
            )
        q, k, v = qkv.split([num_heads_q, heads_k, heads_k], dim=2)
    return flash_attn_func(
        q,
        k,
        v,
        softmax_scale,
        causal,
        window_size=window_size,
        softcap=softcap,
        deterministic=deterministic,
        return_attn_probs=return_attn_probs,
    )


def flash_attn_func(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
):
    """q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_k, headdim[_v]);
    out, or (out, softmax_lse (batch, nheads, seqlen_q) float32) with return_attn_probs."""
    _refuse_fa3("flash_attn_func", qv, q_descale, k_descale, v_descale, attention_chunk, sm_margin)
    return dense_attention(
        "flash_attn_func",
        q,
        k,
        v,
        0.0,
        softmax_scale,
        causal,
        window_size,
        softcap,
        None,
        deterministic,
        None,
        with_lse=return_attn_probs,
    )


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_q=None,
    seqused_k=None,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
):
    """Packed q (total_q, nheads, headdim), k and v (total_k, nheads_k, headdim[_v]); seqused_k:
    None, or (batch,) int32, the keys each sequence uses from its start in cu_seqlens_k. out, or
    (out, softmax_lse (nheads, total_q) float32) with return_attn_probs."""
    who = "flash_attn_varlen_func"
    _refuse_fa3(who, qv, q_descale, k_descale, v_descale, attention_chunk, sm_margin, seqused_q=seqused_q is not None)
    return varlen_attention(
        who,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        seqused_k,
        softmax_scale,
        causal,
        window_size,
        softcap,
        None,
        deterministic,
        return_attn_probs,
    )


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    qv=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    page_table=None,
    cu_seqlens_q=None,
    cu_seqlens_k_new=None,
    max_seqlen_q=None,
    rotary_seqlens=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
    return_softmax_lse=False,
):
    """flash-attn 2's flash_attn_with_kvcache with page_table for block_table: the new keys and
    values appended in place, then attention over the cache; out, or (out, softmax_lse (batch,
    nheads, seqlen_q) float32) with return_softmax_lse."""
    who = "flash_attn_with_kvcache"
    _refuse_fa3(
        who,
        qv,
        q_descale,
        k_descale,
        v_descale,
        attention_chunk,
        sm_margin,
        cu_seqlens_q=cu_seqlens_q is not None,
        cu_seqlens_k_new=cu_seqlens_k_new is not None,
        max_seqlen_q=max_seqlen_q is not None,
        rotary_seqlens=rotary_seqlens is not None,
        scheduler_metadata=scheduler_metadata is not None,
    )
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
        page_table,
        softmax_scale,
        causal,
        window_size,
        softcap,
        rotary_interleaved,
        None,
        num_splits,
        return_softmax_lse,
    )


__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]
