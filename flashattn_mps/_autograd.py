"""Attention's gradients and its torch.library ops, one family for dense, packed (varlen) and
cached (KV-cache, paged too) calls.

`flashattn_mps::attention_forward(q, k, v, attn_mask, causal, scale, band, seq_major, softcap,
alibi_slopes, dropout_p, rng_state, sinks, sequences, max_q_len, max_kv_len, block_table,
num_splits) -> (out, lse)` runs the forward kernels and keeps the float32 log-sum-exp of each row
(rng_state: dropout's generator state, drawn by the caller outside the op so the fake
implementations need none). `flashattn_mps::attention_backward(dout, q, k, v, out, lse, attn_mask,
causal, scale, band, softcap, alibi_slopes, dropout_p, rng_state, sinks, sequences, max_q_len,
max_kv_len) -> (dq, dk, dv, dsinks)` (dsinks empty without sinks) runs the fused backward
(csrc/fa_backward.c). `flashattn_mps::attention_probs(...)` is return_attn_probs' probability pass.
band is None or the ints (bottom_right, left, right) of _options._band_of; seq_major allocates out
as flash-attn's (B, L, H, Ev). sequences is None or the (B, 6) int32 sequence table of a packed or
cached call over (B, H, L, D) views (metal/fa_sequence.h), with the grid's max_q_len and max_kv_len
(max_kv_len < 0: the table's longest key range, read from the table when the op runs) and a paged
cache's block_table (forward only); attention_forward checks the table's contents on the host
(check_sequences) before it runs, since traced entry points cannot. All have fake implementations,
so torch.compile traces them without graph breaks (dynamic shapes too), and register_autograd
joins them.

A call's options travel as one checked `_options.AttentionOptions` value from its entry point
through attention_through_torch and `_Attention` to the cores; an op builds it from its flat
arguments (`_op_options`), its autograd formula once from its inputs (`_setup_context`).

A custom op's eager dispatch costs tens of microseconds in PyTorch, so eager calls that need
gradients take `_Attention`, an autograd.Function over the same cores (`_core.forward_core`,
`_core.backward_core`); both save the same context and differentiate with `_gradients`, so the
gradients, the refusal of double backward and the sinks' gradient exist once. The backward is
itself not differentiable: asking for a graph of the gradients (create_graph=True, double
backward) raises instead of returning wrong second derivatives.
"""

# No `from __future__ import annotations` here: torch 2.4's custom_op reads the ops' annotations as
# objects (it does not evaluate strings) and knows typing.List[int], not list[int].
from typing import List, NamedTuple, Optional  # noqa: UP035

import torch

from . import _C
from ._core import backward_core, forward_core, probs_core, sequence_args
from ._options import (
    AttentionOptions,
    FlashAttnInputError,
    alibi_view,
    check_alibi,
    check_call,
    check_mask,
    check_sinks,
    scale_value,
)


class Sequences(NamedTuple):
    """The sequences of a packed or cached call: the (B, 6) int32 table on q's device, the grid's
    lengths (max_kv_len < 0: the table's longest key range) and a paged cache's block table."""

    table: torch.Tensor
    max_q_len: int
    max_kv_len: int
    block_table: Optional[torch.Tensor] = None


def check_sequences(
    table: torch.Tensor, q: torch.Tensor, k: torch.Tensor, max_q_len: int, max_kv_len: int, block_table=None
) -> None:
    """The sequence table's contents against the (B, H, L, D) views and the grid's lengths, read on
    the host: what the entry points check on their own arguments before tracing, checked again when
    an op runs (a compiled call's only check). max_kv_len < 0: not bounded."""
    who = "flashattn_mps::attention_forward"
    rows = table.tolist()
    pages = None if block_table is None else block_table.tolist()
    page_size = k.shape[2]
    for b, (_, q_start, q_len, k_batch, k_start, k_len) in enumerate(rows):
        if q_len < 0 or k_len < 0 or q_start < 0 or k_start < 0 or q_start + q_len > q.shape[2]:
            raise FlashAttnInputError(
                f"{who}: sequence {b} ({rows[b]}) is outside q's {q.shape[2]} rows or has a negative length"
            )
        if q_len > max_q_len or 0 <= max_kv_len < k_len:
            raise FlashAttnInputError(
                f"{who}: sequence {b} has {q_len} query rows and {k_len} keys, past max_q_len = "
                f"{max_q_len} or max_kv_len = {max_kv_len}"
            )
        if pages is None and (not 0 <= k_batch < k.shape[0] or k_start + k_len > k.shape[2]):
            raise FlashAttnInputError(f"{who}: sequence {b}'s keys ({rows[b]}) are outside k's {tuple(k.shape)} view")
        if pages is not None:
            used = pages[b][: -(-(k_start + k_len) // page_size)] if k_start + k_len else []
            if k_start + k_len > page_size * len(pages[b]) or any(not 0 <= p < k.shape[0] for p in used):
                raise FlashAttnInputError(
                    f"{who}: sequence {b}'s {k_start + k_len} key positions are past its block_table "
                    f"row or name a page outside the pool of {k.shape[0]}"
                )


def _core_sequences(table, max_q_len: int, max_kv_len: int, block_table=None):
    """sequence_args for an op's sequence arguments (None without a table)."""
    if table is None:
        return None
    if max_kv_len < 0:  # the caller could not read the table (a traced call): the op can
        max_kv_len = int(table[:, 5].max()) if table.shape[0] else 0
    return sequence_args(table, max_q_len, max(max_kv_len, 0), block_table)


def _save(
    ctx,
    q,
    k,
    v,
    out,
    lse,
    mask,
    options: AttentionOptions,
    rng_state,
    table=None,
    max_q_len=0,
    max_kv_len=0,
    block_table=None,
) -> None:
    """What the gradients need, the same for _Attention and the ops: the tensors (the options'
    ALiBi slopes and sinks among them) saved for backward, the options' other fields on ctx."""
    alibi, sinks = options.alibi, options.sinks
    ctx.save_for_backward(q, k, v, out, lse, mask, alibi, rng_state, sinks, table)
    # (Without tensors, the common case, the value itself: no copy on the forward's path.)
    ctx.options = options if alibi is None and sinks is None else options._replace(alibi=None, sinks=None)
    ctx.sequence_lengths = (max_q_len, max_kv_len)
    ctx.paged = block_table is not None
    ctx.mark_non_differentiable(lse)


def _gradients(ctx, dout, traced: bool):
    """(dq, dk, dv, dsinks or None) of a saved call: through the attention_backward op when traced
    (the op's autograd formula), else straight through backward_core."""
    q, k, v, out, lse, mask, alibi, rng_state, sinks, table = ctx.saved_tensors
    who = "flash_attention" if table is None else "flash_attn_varlen_func"
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{who}: double backward is not supported; its gradients cannot be differentiated (create_graph=True)"
        )
    if ctx.paged:
        raise NotImplementedError(
            f"{who}: block_table (a paged KV cache) has no backward, as in flash-attn: the forward ran, but "
            "gradients cannot flow through it (detach q, k, v and sinks, or call it under torch.no_grad())"
        )
    options = ctx.options if alibi is None and sinks is None else ctx.options._replace(alibi=alibi, sinks=sinks)
    max_q_len, max_kv_len = ctx.sequence_lengths
    if traced:
        dq, dk, dv, dsinks = attention_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            mask,
            options.causal,
            options.scale,
            _band_list(options.band),
            options.softcap,
            alibi,
            options.dropout_p,
            rng_state,
            sinks,
            table,
            max_q_len,
            max_kv_len,
        )
        return dq, dk, dv, None if sinks is None else dsinks
    grads = backward_core(
        dout, q, k, v, out, lse, mask, options, rng_state, _core_sequences(table, max_q_len, max_kv_len)
    )
    return grads[0], grads[1], grads[2], grads[3] if sinks is not None else None


class _Attention(torch.autograd.Function):
    """Eager autograd: (q, k, v, the (B, Hq, L, S) mask view or None, the call's AttentionOptions
    (checked: the (B, Hq) ALiBi view, float32 sinks), seq_major, rng_state, options.sinks again,
    Sequences or None) -> (out, lse). The sinks are an argument of their own because autograd
    differentiates only the tensors passed directly, not those inside a tuple."""

    @staticmethod
    def forward(ctx, q, k, v, mask, options, seq_major, rng_state, _sinks, sequences):
        if sequences is None:
            out, lse = forward_core(q, k, v, mask, options, True, seq_major, rng_state)
            _save(ctx, q, k, v, out, lse, mask, options, rng_state)
            return out, lse
        table, max_q, max_kv, block_table = sequences
        out, lse = forward_core(
            q, k, v, mask, options, True, seq_major, rng_state, _core_sequences(table, max_q, max_kv, block_table)
        )
        _save(ctx, q, k, v, out, lse, mask, options, rng_state, table, max_q, max_kv, block_table)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        dq, dk, dv, dsinks = _gradients(ctx, dout, traced=False)
        return dq, dk, dv, None, None, None, None, dsinks, None


def _is_traced() -> bool:
    return torch.compiler.is_compiling() or torch.jit.is_tracing() or torch._C._len_torch_dispatch_stack() > 0


def attention_through_torch(
    q,
    k,
    v,
    attn_mask,
    options: AttentionOptions,
    return_lse: bool,
    seq_major=False,
    rng_state=None,
    sequences: Optional[Sequences] = None,
):
    """Attention for calls that need autograd or are being traced (torch.compile, export, make_fx,
    fake tensors): traced calls record the attention_forward op, eager ones run _Attention.
    options: the call's checked AttentionOptions (scale resolved, or None for the default while
    traced; the (B, Hq) ALiBi view, float32 sinks); attn_mask: the user's mask (checked here);
    sequences: a packed or cached call's (q, k, v then (B, H, L, D) views)."""
    if _is_traced():
        if sequences is None:  # traced once; fake tensors are never checked by C
            check_call(q, k, v, options.causal, options.scale, attn_mask)
        table, max_q, max_kv, block_table = (None, 0, 0, None) if sequences is None else sequences
        out, lse = torch.ops.flashattn_mps.attention_forward(
            q,
            k,
            v,
            attn_mask,
            options.causal,
            options.scale,
            _band_list(options.band),
            seq_major,
            options.softcap,
            options.alibi,
            options.dropout_p,
            rng_state,
            options.sinks,
            table,
            max_q,
            max_kv,
            block_table,
            options.num_splits,
        )
    else:
        mask = None if attn_mask is None else check_mask(attn_mask, q, k)
        if q.is_neg() or k.is_neg() or v.is_neg():  # resolved here, so autograd sees the copy
            q, k, v = q.resolve_neg(), k.resolve_neg(), v.resolve_neg()
        out, lse = _Attention.apply(q, k, v, mask, options, seq_major, rng_state, options.sinks, sequences)
    return (out, lse) if return_lse else out


def attention_probabilities(
    q, k, v, out, lse, options: AttentionOptions, rng_state=None, sequences: Optional[Sequences] = None
) -> torch.Tensor:
    """return_attn_probs' probabilities of the call that returned out and lse (detached): the
    attention_probs op when traced, else _core.probs_core. options: the call's, checked."""
    table, max_q, max_kv, _ = (None, 0, 0, None) if sequences is None else sequences
    if _is_traced():
        return torch.ops.flashattn_mps.attention_probs(
            q,
            k,
            v,
            out,
            lse,
            options.causal,
            options.scale,
            _band_list(options.band),
            options.softcap,
            options.alibi,
            options.dropout_p,
            rng_state,
            table,
            max_q,
            max_kv,
        )
    return probs_core(q, k, v, out, lse, None, options, rng_state, _core_sequences(table, max_q, max_kv))


def _op_alibi(slopes, q, table):
    """The (B, Hq) ALiBi view of a call: B is q's batch, or the sequences' number."""
    if table is None:
        return check_alibi(slopes, q)
    return alibi_view(slopes, table.shape[0], q.shape[1], q.device, "flash_attention")


def _op_options(
    q,
    causal: bool,
    scale: Optional[float],
    band,
    softcap: float,
    alibi_slopes,
    dropout_p: float,
    sinks,
    table,
    num_splits: int = 0,
) -> AttentionOptions:
    """The AttentionOptions of an op's flat arguments, its ALiBi slopes and sinks checked (the op
    may be called with anything); scale None is the default 1/sqrt(E), resolved on the real q."""
    return AttentionOptions(
        scale_value(q.shape[-1], scale),
        causal,
        None if band is None else tuple(band),
        softcap,
        None if alibi_slopes is None else _op_alibi(alibi_slopes, q, table),
        None if sinks is None else check_sinks(sinks, q),
        dropout_p,
        _C.KERNEL_AUTO,
        num_splits,
    )


def _band_list(band) -> Optional[list[int]]:
    """An AttentionOptions band as the ops' band argument."""
    return None if band is None else list(band)


@torch.library.custom_op("flashattn_mps::attention_forward", mutates_args=())
def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    causal: bool,
    scale: Optional[float],
    band: Optional[List[int]] = None,  # noqa: UP006
    seq_major: bool = False,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    rng_state: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    sequences: Optional[torch.Tensor] = None,
    max_q_len: int = 0,
    max_kv_len: int = 0,
    block_table: Optional[torch.Tensor] = None,
    num_splits: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    mask = None if attn_mask is None else check_mask(attn_mask, q, k)
    options = _op_options(q, causal, scale, band, softcap, alibi_slopes, dropout_p, sinks, sequences, num_splits)
    if sequences is not None:
        check_sequences(sequences, q, k, max_q_len, max_kv_len, block_table)
    return forward_core(
        q,
        k,
        v,
        mask,
        options,
        True,
        seq_major,
        rng_state,
        _core_sequences(sequences, max_q_len, max_kv_len, block_table),
    )


@attention_forward.register_fake
def _(
    q,
    k,
    v,
    attn_mask,
    causal,
    scale,
    band=None,
    seq_major=False,
    softcap=0.0,
    alibi_slopes=None,
    dropout_p=0.0,
    rng_state=None,
    sinks=None,
    sequences=None,
    max_q_len=0,
    max_kv_len=0,
    block_table=None,
    num_splits=0,
):
    if seq_major:
        out = q.new_empty((q.shape[0], q.shape[2], q.shape[1], v.shape[-1])).transpose(1, 2)
    else:
        out = q.new_empty(q.shape[:-1] + v.shape[-1:])
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    return out, lse


@torch.library.custom_op("flashattn_mps::attention_backward", mutates_args=())
def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    causal: bool,
    scale: Optional[float],
    band: Optional[List[int]] = None,  # noqa: UP006
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    rng_state: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    sequences: Optional[torch.Tensor] = None,
    max_q_len: int = 0,
    max_kv_len: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = None if attn_mask is None else check_mask(attn_mask, q, k)
    options = _op_options(q, causal, scale, band, softcap, alibi_slopes, dropout_p, sinks, sequences)
    grads = backward_core(
        dout, q, k, v, out, lse, mask, options, rng_state, _core_sequences(sequences, max_q_len, max_kv_len)
    )
    return (*grads, _no_sink_gradient(q)) if sinks is None else grads


def _no_sink_gradient(q: torch.Tensor) -> torch.Tensor:
    """attention_backward's dsinks without sinks: an empty float32 tensor (an op returns tensors)."""
    return q.new_empty((0,), dtype=torch.float32)


@attention_backward.register_fake
def _(
    dout,
    q,
    k,
    v,
    out,
    lse,
    attn_mask,
    causal,
    scale,
    band=None,
    softcap=0.0,
    alibi_slopes=None,
    dropout_p=0.0,
    rng_state=None,
    sinks=None,
    sequences=None,
    max_q_len=0,
    max_kv_len=0,
):
    dsinks = _no_sink_gradient(q) if sinks is None else q.new_empty(sinks.shape, dtype=torch.float32)
    if sequences is not None:  # zeros_like in the op: q's strides
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup_context(ctx, inputs, output) -> None:
    (
        q,
        k,
        v,
        attn_mask,
        causal,
        scale,
        band,
        _seq_major,
        softcap,
        alibi_slopes,
        dropout_p,
        rng_state,
        sinks,
        sequences,
        max_q_len,
        max_kv_len,
        block_table,
        _num_splits,
    ) = inputs
    out, lse = output  # the options as the op got them: attention_backward checks the slopes and sinks again
    options = AttentionOptions(
        scale, causal, None if band is None else tuple(band), softcap, alibi_slopes, sinks, dropout_p
    )
    _save(ctx, q, k, v, out, lse, attn_mask, options, rng_state, sequences, max_q_len, max_kv_len, block_table)


def _backward(ctx, dout: torch.Tensor, _dlse: Optional[torch.Tensor]):
    dq, dk, dv, dsinks = _gradients(ctx, dout, traced=True)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, dsinks, None, None, None, None, None


attention_forward.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("flashattn_mps::attention_probs", mutates_args=())
def attention_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: Optional[float],
    band: Optional[List[int]] = None,  # noqa: UP006
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    rng_state: Optional[torch.Tensor] = None,
    sequences: Optional[torch.Tensor] = None,
    max_q_len: int = 0,
    max_kv_len: int = 0,
) -> torch.Tensor:
    """return_attn_probs' probabilities of the call that returned out and lse (_core.probs_core),
    an op so that compiled and exported code can ask for them too."""
    options = _op_options(q, causal, scale, band, softcap, alibi_slopes, dropout_p, None, sequences)
    return probs_core(q, k, v, out, lse, None, options, rng_state, _core_sequences(sequences, max_q_len, max_kv_len))


@attention_probs.register_fake
def _(
    q,
    k,
    v,
    out,
    lse,
    causal,
    scale,
    band=None,
    softcap=0.0,
    alibi_slopes=None,
    dropout_p=0.0,
    rng_state=None,
    sequences=None,
    max_q_len=0,
    max_kv_len=0,
):
    if sequences is not None:
        return q.new_empty((sequences.shape[0], q.shape[-3], max_q_len, max_kv_len), dtype=torch.float32)
    return q.new_empty((*q.shape[:-1], k.shape[-2]), dtype=torch.float32)
