"""FlashAttention-4's flash_attn.cute.interface (Dao-AILab/flash-attention's flash_attn/cute/),
served by flashattn_mps: its signatures and conventions: always a tuple (out, lse), lse None unless
return_lse or an input requires grad, -inf for a row that sees no key; window_size sides None for
unbounded (a pair summing below 0 is no window, as FA4 resolves it); learnable_sink (nheads,),
differentiable. FA4 also differentiates the lse; here a backward that reaches the lse raises
NotImplementedError (nothing is dropped silently). What it accepts but flashattn_mps does not run (qv, gather_kv_indices, score_mod,
score_mod_bwd, mask_mod, aux_tensors, aux_scalars, block_sparse_tensors(_bwd), seqused_q,
scheduler_metadata, a q in (batch, seqlen) layout for the varlen call) raises NotImplementedError
naming the argument; num_splits, pack_gqa, deterministic, min_seqlen_k, seqlen_k_per_split and
disable_scheduler_metadata are tuning choices with the same result: accepted."""

import math

import torch

from flashattn_mps._flash_attn import dense_attention
from flashattn_mps._options import FlashAttnInputError
from flashattn_mps._shim.common import refuse, varlen_attention
from flashattn_mps._varlen import _check_varlen, _paged_attention

MIRRORS = "4.0.0b27"  # flash-attention's flash_attn/cute (FlashAttention-4) at its tag fa4-v4.0.0.beta27


def _window(window_size, causal):
    """FA4's window (sides None: unbounded) as flash-attn 2's (left, right) with -1 for unbounded."""
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2):
        return window_size  # (the shared check names it)
    left, right = window_size
    if causal:
        right = 0
    if left is not None and right is not None and left + right < 0:
        left = right = None
    return (-1 if left is None else left, -1 if right is None else right)


def _refuse_fa4(who, qv, gather_kv_indices, score_mod, score_mod_bwd, mask_mod, aux_tensors, aux_scalars, **more):
    refuse(
        who,
        qv=qv is not None,
        gather_kv_indices=gather_kv_indices is not None,
        score_mod=score_mod is not None,
        score_mod_bwd=score_mod_bwd is not None,
        mask_mod=mask_mod is not None,
        aux_tensors=aux_tensors is not None,
        aux_scalars=aux_scalars is not None,
        **more,
    )


def _wants_lse(return_lse, tensors) -> bool:
    return bool(return_lse) or (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def _fa4_lse(lse, inputs):
    """flash-attn 2's +inf for a row without keys as FA4's -inf; when an input requires grad, an
    lse whose backward refuses (the kernels' backward has no lse term)."""
    lse = lse.masked_fill(lse == math.inf, -math.inf)
    needing = [t for t in inputs if t is not None and t.requires_grad]
    return _LseWithoutGradient.apply(lse, needing[0]) if needing and torch.is_grad_enabled() else lse


class _LseWithoutGradient(torch.autograd.Function):
    """The lse, joined to the graph of an input that requires grad only so that a gradient
    reaching it is refused instead of ignored."""

    @staticmethod
    def forward(ctx, lse, _anchor):
        return lse.clone()

    @staticmethod
    def backward(ctx, grad_lse, *_):
        raise NotImplementedError(
            "flash_attn.cute: a gradient through lse is not supported by flashattn_mps's flash_attn shim "
            "(out, q, k, v and learnable_sink are differentiable; detach lse)"
        )


def flash_attn_func(
    q,
    k,
    v,
    qv=None,
    gather_kv_indices=None,
    softmax_scale=None,
    causal=False,
    window_size=(None, None),
    learnable_sink=None,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    score_mod=None,
    score_mod_bwd=None,
    mask_mod=None,
    aux_tensors=None,
    aux_scalars=None,
    block_sparse_tensors=None,
    block_sparse_tensors_bwd=None,
    return_lse=False,
):
    """q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_k, headdim[_v]) ->
    (out, lse (batch, nheads, seqlen_q) float32 or None)."""
    who = "flash_attn_func"
    _refuse_fa4(
        who,
        qv,
        gather_kv_indices,
        score_mod,
        score_mod_bwd,
        mask_mod,
        aux_tensors,
        aux_scalars,
        block_sparse_tensors=block_sparse_tensors is not None,
        block_sparse_tensors_bwd=block_sparse_tensors_bwd is not None,
    )
    with_lse = _wants_lse(return_lse, (q, k, v, learnable_sink))
    result = dense_attention(
        who,
        q,
        k,
        v,
        0.0,
        softmax_scale,
        causal,
        _window(window_size, causal),
        softcap,
        None,
        deterministic,
        learnable_sink,
        with_lse=with_lse,
    )
    return (result[0], _fa4_lse(result[1], (q, k, v, learnable_sink))) if with_lse else (result, None)


def flash_attn_varlen_func(
    q,
    k,
    v,
    qv=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    min_seqlen_k=None,
    seqused_q=None,
    seqused_k=None,
    gather_kv_indices=None,
    page_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(None, None),
    learnable_sink=None,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    score_mod=None,
    score_mod_bwd=None,
    mask_mod=None,
    block_sparse_tensors=None,
    aux_tensors=None,
    aux_scalars=None,
    return_lse=False,
    scheduler_metadata=None,
    seqlen_k_per_split=None,
    disable_scheduler_metadata=False,
):
    """Packed q (total_q, nheads, headdim) with cu_seqlens_q; k and v packed (total_k, nheads_k,
    headdim[_v]) with cu_seqlens_k (and optionally seqused_k), or with page_table the pool
    (num_pages, page_size, nheads_k, headdim[_v]) with seqused_k (batch,) keys per sequence
    (forward only: a backward reaching it raises, naming block_table). max_seqlen_q/k None: read
    from the prefix sums (one host read). -> (out (total_q, nheads, headdim_v), lse (nheads,
    total_q) float32 or None)."""
    who = "flash_attn_varlen_func"
    _refuse_fa4(
        who,
        qv,
        gather_kv_indices,
        score_mod,
        score_mod_bwd,
        mask_mod,
        aux_tensors,
        aux_scalars,
        block_sparse_tensors=block_sparse_tensors is not None,
        seqused_q=seqused_q is not None,
        scheduler_metadata=scheduler_metadata is not None,
        **{"cu_seqlens_q=None (q in the (batch, seqlen, nheads, headdim) layout)": cu_seqlens_q is None},
    )
    window = _window(window_size, causal)
    with_lse = _wants_lse(return_lse, (q, k, v, learnable_sink))
    if max_seqlen_q is None:
        max_seqlen_q = _longest(cu_seqlens_q)
    if page_table is not None:
        if seqused_k is None:
            raise FlashAttnInputError(f"{who}: page_table needs seqused_k, the keys of each sequence")
        refuse(who, return_lse=bool(return_lse))  # the paged forward writes no lse
        cu_seqlens_k = torch.nn.functional.pad(seqused_k.cumsum(0, dtype=torch.int32), (1, 0))
        if max_seqlen_k is None:
            max_seqlen_k = _longest(cu_seqlens_k)
        call = _check_varlen(
            who,
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            0.0,
            softmax_scale,
            causal,
            window,
            softcap,
            None,
            deterministic,
            False,
            page_table,
            learnable_sink,
        )
        return _paged_attention(call, who), None
    refuse(who, **{"cu_seqlens_k=None without page_table (k in the (batch, seqlen) layout)": cu_seqlens_k is None})
    if max_seqlen_k is None:
        max_seqlen_k = _longest(cu_seqlens_k)
    result = varlen_attention(
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
        window,
        softcap,
        learnable_sink,
        deterministic,
        with_lse,
    )
    return (result[0], _fa4_lse(result[1], (q, k, v, learnable_sink))) if with_lse else (result, None)


def _longest(cu_seqlens) -> int:
    """The longest sequence of prefix sums (a host read)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        return cu_seqlens  # (the varlen checks name it)
    return int(cu_seqlens.diff().max()) if cu_seqlens.shape[0] > 1 else 0


__all__ = ["flash_attn_func", "flash_attn_varlen_func"]
