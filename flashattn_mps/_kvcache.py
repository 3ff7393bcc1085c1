"""flash-attn 2's `flash_attn_with_kvcache`: decoding against a preallocated KV cache.

The new keys and values are written into the cache in place with torch ops (one indexed store
per tensor: the cache is never copied), after rotary embedding of q and the new k when given (torch
ops in float32 on the few new rows: too little work to justify a kernel). The attention itself is
the kernels reading the cache in place through a sequence table (metal/fa_sequence.h; a paged cache
through its block table too, function constant 13, in the prefill and decode kernels): query rows
of batch b attend to cache row cache_batch_idx[b], keys cache_leftpad[b] .. cache_seqlens[b] + new
- 1, causal bottom-right per sequence; the decode kernel (split-K as usual) for few query rows.

As flash-attn's kernel, positions are cache indices: new key n of batch b goes to (and is rotated
at) position cache_seqlens[b] + n; q row i is rotated at cache_seqlens[b] + i when causal or
windowed, else at cache_seqlens[b]. The lengths are validated on the host before any kernel runs
(one read of the small int32 tensors on MPS), and the table kernel clamps them again. Under
torch.compile (and other tracing) the call compiles without a graph break: the cache is appended to
with indexed stores torch.compile understands, the sequence table is built with torch ops, the
attention is the flashattn_mps::attention_forward op (which reads the table's longest key range
itself), and the checks that would read the lengths, the block table or the rotary positions on the
host are skipped."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ._api import _flash_attn_lse
from ._autograd import Sequences, _is_traced, attention_through_torch
from ._core import plan_run, run_forward, sequence_args
from ._options import (
    AttentionOptions,
    FlashAttnInputError,
    FlashAttnTypeError,
    alibi_view,
    check_bool,
    check_common,
    check_int,
    check_lengths_tensor,
    check_scale,
    check_sinks,
    given,
)
from ._quantized import QuantizedKV, quantize_rows
from ._quantized import operand as quantized_operand
from ._varlen import block_table_rows, check_block_table, check_pages_used


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool):
    """x (B, L, H, D) with its first rotary_dim = 2 * cos.shape[1] dims rotated at positions (B, L),
    in float32, returned in x's dtype (a new tensor: x is the caller's)."""
    half = cos.shape[1]
    c = cos[positions].float().unsqueeze(2)  # (B, L, 1, half)
    s = sin[positions].float().unsqueeze(2)
    rot = x[..., : 2 * half].float()
    if interleaved:  # pairs (0, 1), (2, 3), ...
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:  # GPT-NeoX: pairs (i, i + half)
        x1, x2 = rot[..., :half], rot[..., half:]
        rotated = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([rotated.to(x.dtype), x[..., 2 * half :]], dim=-1)


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
    *,
    sinks=None,
):
    """flash-attn 2's flash_attn_with_kvcache.

    Args, as flash-attn's:
        q: (batch, seqlen_q, nheads, headdim).
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim[_v]); updated in place
            when k and v are given.
        k, v: None, or the new (batch, seqlen_new, nheads_k, headdim[_v]) keys and values, written
            into the cache at cache_seqlens (before attention, after rotary on k).
        rotary_cos, rotary_sin: None, or (seqlen_ro, rotary_dim / 2) applied to q and the new k
            (rotary_interleaved: pairs (0, 1), (2, 3)... when True, (i, i + rotary_dim / 2) when
            False). q row i at position cache_seqlens + i when causal or windowed, else all at
            cache_seqlens.
        cache_seqlens: int, or (batch,) int32: the valid keys of each cache row before the update.
        cache_batch_idx: None, or (batch,) int32: the cache row of each batch entry.
        cache_leftpad: None, or (batch,) int32: the first valid key of each cache row.
        softmax_scale, causal (bottom-right), window_size, softcap, alibi_slopes: as
            flash_attn_func, per sequence of keys cache_leftpad .. cache_seqlens + seqlen_new - 1.
        num_splits: as flash-attn's: 0 lets the planner choose the decode kernel's split-K, 1 does
            not split the keys, n > 1 splits them into n shares (at most 128, and fewer when the
            keys are too few for n shares of whole key-pair turns), merged exactly. It applies to
            the decode kernel (seqlen_q <= 8, paged or not); the prefill kernel never splits.
            Results agree whatever it is, to rounding.
        return_softmax_lse: also return the (batch, nheads, seqlen_q) float32 log-sum-exp.
        block_table: None, or (batch, max_num_blocks) int32 for a paged cache: k_cache and v_cache
            are then the pool (num_blocks, page_block_size, nheads_k, headdim) and position t of
            batch b lives in page block_table[b, t // page_block_size] (any page size; the decode
            kernel, or the prefill kernel for seqlen_q > 8, reads the pages through the table in
            place). Not with cache_batch_idx.
        sinks: keyword only, None or (nheads,) attention-sink logits as in flash_attn_func.

    k_cache, v_cache (either or both) may be a QuantizedKV (flashattn_mps.quantize_kv; a page pool
    too): the kernels read it in place, and new keys and values are quantized into it by
    quantize_kv's rule (rows outside the append untouched), so a cache built by appends equals one
    quantized at once. Eager calls only.

    Returns out (batch, seqlen_q, nheads, headdim_v) (and the lse). Not differentiable, as
    flash-attn's. explain_kvcache_plan, given the same arguments, shows what it launches.
    """
    call = _check_cache_call(
        "flash_attn_with_kvcache",
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
        sinks,
    )
    q = _update_cache(call)
    if _is_traced():  # the attention op (no gradient, as flash-attn's)
        views = [t.detach().transpose(1, 2) for t in (q, call.k_cache, call.v_cache)]
        out, lse = attention_through_torch(
            *views,
            None,
            call.options,
            True,
            True,
            None,
            Sequences(call.table, q.shape[1], call.max_keys, call.block_table),
        )
        out = out.transpose(1, 2)
    else:
        args, out, lse = _attention_arguments(call, q)
        run_forward(*args)
    return (out, _flash_attn_lse(lse)) if return_softmax_lse else out


def explain_kvcache_plan(
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
    *,
    sinks=None,
) -> dict:
    """What `flash_attn_with_kvcache` with exactly these arguments would launch, without running it:
    its checks (the same host reads of the length and block tables), and nothing written: the cache
    is not appended to, q is not rotated (the kernels would read the rotation's new contiguous q,
    so the plan reads one of that layout).

    Returns explain_plan's dict: {"dispatches": [...], "split_count", "workspace_bytes", "empty"}
    (and "metal_stream" on MPS), the dispatches in launch order: the sequence table's kernel
    (fa_sequence_table_*), then the attention kernel (fa_decode_* for seqlen_q <= 8, paged or not,
    followed by fa_decode_merge_* when split_count > 1; else the prefill fa_forward_*)."""
    call = _check_cache_call(
        "explain_kvcache_plan",
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
        sinks,
    )
    rotated = q if call.rotary is None else torch.empty_like(q, memory_format=torch.contiguous_format)
    args, _, _ = _attention_arguments(call, rotated)
    return plan_run(*args)


class _CacheCall(NamedTuple):
    """A flash_attn_with_kvcache call after its checks, before it touches anything."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k: Optional[torch.Tensor]
    v: Optional[torch.Tensor]
    rotary: Optional[tuple]  # (cos, sin, interleaved, steps of q's rows) or None
    starts: torch.Tensor  # (batch,) int64: each sequence's cache position of its first new key
    rows: torch.Tensor  # (batch,) int32: the cache row of each batch entry (unpaged)
    page_size: int  # with a block table, else 0
    block_table: Optional[torch.Tensor]
    table: torch.Tensor  # the (batch, 6) int32 sequence table on q's device
    max_keys: int  # the longest key range; -1 when traced (the op reads it from the table)
    options: AttentionOptions
    return_softmax_lse: bool


def _check_cache_call(
    who,
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
    sinks,
) -> _CacheCall:
    """flash_attn_with_kvcache's checks (explain_kvcache_plan's too), every one before the cache is
    written; the host reads of the small length and block tables are the function's own."""
    band, softcap = check_common(who, causal, window_size, softcap, False)
    check_bool(return_softmax_lse, "return_softmax_lse", who)
    check_bool(rotary_interleaved, "rotary_interleaved", who)
    check_int(num_splits, "num_splits", who)
    if (isinstance(k_cache, QuantizedKV) or isinstance(v_cache, QuantizedKV)) and _is_traced():
        raise NotImplementedError(f"{who}: quantized caches are read by eager calls only, not under torch.compile")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t is None and name in ("k", "v"):
            continue
        if not isinstance(t, torch.Tensor) and not (name.endswith("_cache") and isinstance(t, QuantizedKV)):
            raise TypeError(f"{who}: {name} must be a torch.Tensor, got {given(t)}")
        if t.dim() != 4:
            raise FlashAttnInputError(
                f"{who}: {name} must be 4-D (batch, seqlen, heads, headdim), got {tuple(t.shape)}"
            )
        if t.device != q.device or t.dtype != q.dtype:
            raise FlashAttnTypeError(
                f"{who}: {name} must share q's dtype and device ({q.dtype}, {q.device}), got {t.dtype}, {t.device}"
            )
    if (k is None) != (v is None):
        raise FlashAttnInputError(f"{who}: k and v must be given together")
    batch, seqlen_q = q.shape[0], q.shape[1]
    cache_batch, cache_len = k_cache.shape[0], k_cache.shape[1]
    new = 0 if k is None else k.shape[1]
    paged = block_table is not None
    if paged:  # k_cache is the pool (pages, page_size, nheads_k, headdim)
        if cache_batch_idx is not None:
            raise FlashAttnInputError(
                f"{who}: cache_batch_idx cannot be combined with block_table (the table picks the pages)"
            )
        pool, page_size = check_block_table(block_table, batch, k_cache, v_cache, q.device, who, ("k_cache", "v_cache"))
        cache_batch, cache_len = batch, page_size * block_table.shape[1]  # each sequence's positions
    if k is not None and (
        k.shape[0] != batch
        or v.shape[:2] != k.shape[:2]
        or k.shape[2:] != k_cache.shape[2:]
        or v.shape[2:] != v_cache.shape[2:]
    ):
        raise FlashAttnInputError(
            f"{who}: k {tuple(k.shape)} and v {tuple(v.shape)} must be (batch, seqlen_new) rows of "
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} for q {tuple(q.shape)}"
        )

    # The lengths as (batch,) tensors on q's device: the table and the cache's update are torch ops.
    device = q.device
    if cache_seqlens is None or (isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool)):
        length = cache_len if cache_seqlens is None else cache_seqlens  # None: a full cache
        starts = torch.full((batch,), length, dtype=torch.int64, device=device)
    else:
        check_lengths_tensor(cache_seqlens, "cache_seqlens", who, device, batch)
        starts = cache_seqlens.long()
    for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if t is not None:
            check_lengths_tensor(t, name, who, device, batch)
    rows = torch.arange(batch, dtype=torch.int32, device=device) if cache_batch_idx is None else cache_batch_idx
    leftpad = torch.zeros(batch, dtype=torch.int32, device=device) if cache_leftpad is None else cache_leftpad
    keys = starts + new - leftpad  # each sequence's keys, leftpad .. starts + new - 1
    rotates_rows = causal or band[1:] != (-1, -1)  # q row i at cache_seqlens + i, else all at cache_seqlens
    lengths = None
    if _is_traced():  # the host reads below would break the graph: unchecked, the table's longest range read later
        max_keys = -1
    else:
        lengths, row_list, pads = starts.tolist(), rows.tolist(), leftpad.tolist()
        pages = block_table_rows(block_table) if paged else None
        for b in range(batch):
            if pages is not None and 0 <= lengths[b] <= cache_len - new:
                check_pages_used(pages, b, lengths[b] + new, page_size, pool, who)
            if not 0 <= row_list[b] < cache_batch:
                raise FlashAttnInputError(
                    f"{who}: cache_batch_idx[{b}] = {row_list[b]} is outside the cache's {cache_batch} rows"
                )
            if not 0 <= lengths[b] <= cache_len - new:
                raise FlashAttnInputError(
                    f"{who}: cache_seqlens[{b}] = {lengths[b]} with {new} new keys is past the cache's "
                    f"{cache_len} positions"
                )
            if not 0 <= pads[b] <= lengths[b]:
                raise FlashAttnInputError(
                    f"{who}: cache_leftpad[{b}] = {pads[b]} must be in [0, cache_seqlens[{b}] = {lengths[b]}]"
                )
        max_keys = max([lengths[b] + new - pads[b] for b in range(batch)], default=0)

    rotary = None
    if rotary_cos is not None or rotary_sin is not None:
        if not (isinstance(rotary_cos, torch.Tensor) and isinstance(rotary_sin, torch.Tensor)):
            raise TypeError(f"{who}: rotary_cos and rotary_sin must be given together as tensors")
        if rotary_cos.dim() != 2 or rotary_sin.shape != rotary_cos.shape or 2 * rotary_cos.shape[1] > q.shape[3]:
            raise FlashAttnInputError(
                f"{who}: rotary_cos and rotary_sin must be (seqlen_ro, rotary_dim / 2) with rotary_dim "
                f"<= headdim {q.shape[3]}, got {tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}"
            )
        reach = None if lengths is None else max(lengths, default=0) + max(new, seqlen_q if rotates_rows else 1)
        if batch and reach is not None and reach > rotary_cos.shape[0]:
            raise FlashAttnInputError(
                f"{who}: rotary_cos has {rotary_cos.shape[0]} positions, the rotated rows reach {reach}"
            )
        steps = (
            torch.arange(seqlen_q, device=device)
            if rotates_rows
            else torch.zeros(seqlen_q, dtype=torch.int64, device=device)
        )
        rotary = (rotary_cos, rotary_sin, rotary_interleaved, steps)

    # One row per sequence (metal/fa_sequence.h): q batch, first q row, q rows, k batch, first key, keys.
    zeros = torch.zeros(batch, dtype=torch.int32, device=device)
    table = torch.stack(
        [
            torch.arange(batch, dtype=torch.int32, device=device),
            zeros,
            zeros + seqlen_q,
            zeros if paged else rows.int(),
            leftpad.int(),
            keys.int(),
        ],
        dim=1,
    ).contiguous()
    scale = check_scale(softmax_scale, q.shape[-1], who)
    alibi = alibi_view(alibi_slopes, batch, q.shape[2], device, who)
    sinks = None if sinks is None else check_sinks(sinks, q.transpose(1, 2), who).detach()
    return _CacheCall(
        q,
        k_cache,
        v_cache,
        k,
        v,
        rotary,
        starts,
        rows,
        page_size if paged else 0,
        block_table,
        table,
        max_keys,
        AttentionOptions(scale, causal, band, softcap, alibi, sinks, 0.0, num_splits=num_splits),
        return_softmax_lse,
    )


def _update_cache(call: _CacheCall) -> torch.Tensor:
    """Rotates q and the new keys (when rotary is given) and writes the new keys and values into the
    cache in place; returns the q the kernels read."""
    q, k = call.q, call.k
    batch, new = q.shape[0], 0 if k is None else k.shape[1]
    if call.rotary is not None:
        cos, sin, interleaved, steps = call.rotary
        q = _rotate(q, cos, sin, call.starts[:, None] + steps, interleaved)
        if k is not None:
            k = _rotate(k, cos, sin, call.starts[:, None] + torch.arange(new, device=q.device), interleaved)
    if k is not None and new > 0 and batch > 0:
        positions = call.starts[:, None] + torch.arange(new, device=q.device)
        if call.block_table is None:
            index = (call.rows.long()[:, None].expand(batch, new), positions)
        else:  # the page of each position, and its row in the page
            index = (call.block_table.long().gather(1, positions // call.page_size), positions % call.page_size)
        _append(call.k_cache, index, k)  # in place: only these rows of the cache are written
        _append(call.v_cache, index, call.v)
    return q


def _append(cache, index: tuple, rows: torch.Tensor) -> None:
    """Writes rows into the cache at index, a QuantizedKV's quantized by quantize_kv's rule."""
    if isinstance(cache, QuantizedKV):
        for part, values in zip(
            (cache.data, cache.scales, cache.biases), quantize_rows(rows, cache.bits, cache.group_size)
        ):
            part.index_put_(index, values)
    else:
        cache.index_put_(index, rows)


def _attention_arguments(call: _CacheCall, q: torch.Tensor):
    """run_forward's (and plan_forward's) arguments for the attention over the updated cache, with
    the out and lse (or None) they fill."""
    batch, seqlen_q = q.shape[0], q.shape[1]
    out = q.new_empty((batch, seqlen_q, q.shape[2], call.v_cache.shape[3]))
    lse = (
        torch.empty((batch, q.shape[2], seqlen_q), dtype=torch.float32, device=q.device)
        if call.return_softmax_lse
        else None
    )
    views = [t.transpose(1, 2) for t in (q, call.k_cache, call.v_cache, out)]
    options = call.options
    if isinstance(call.k_cache, QuantizedKV) or isinstance(call.v_cache, QuantizedKV):
        options = options._replace(kv_quant=tuple(t if isinstance(t, QuantizedKV) else None for t in views[1:3]))
        views[1], views[2] = quantized_operand(views[1]), quantized_operand(views[2])
    args = (*views, lse, options, sequence_args(call.table, seqlen_q, call.max_keys, call.block_table))
    return args, out, lse
