"""flash-attn 2's `flash_attn_varlen_func`: packed sequences of different lengths in one launch.

q (total_q, H, D), k and v (total_k, Hkv, D) hold the sequences back to back; `cu_seqlens_q/k`
(batch + 1, int32) are their prefix sums. The kernels get a sequence table, one row per sequence
(q batch, first q row, q rows, k batch, first key, keys; metal/fa_sequence.h), built here with
torch ops on the tensors' device, and map threadgroups to (sequence, query block): one launch
over every sequence, no padding, no per-sequence loop. The packed tensors are viewed as
(1, H, total, D) (a transpose, no copy). With a block_table, k and v are a paged pool viewed as
(pages, Hkv, page_size, D), and the kernels read each sequence's keys through the table in place
(function constant 13; forward only, as flash-attn).

The table's contents are validated on the host before any kernel runs (flash-attn's errors, named
arguments): on MPS that reads the small int32 prefix sums back, one synchronisation per call. Under
torch.compile (and other tracing) those host reads are skipped, so that the call compiles without a
graph break: the prefix sums and the block table's pages are then not checked. The kernels never
trust the table anyway: a kernel clamps every entry into the views (csrc/fa_core.h,
fa_sequence_args), so even unvalidated contents could only cut a sequence short.

Eager calls without gradients run the core directly; calls that need gradients or are traced go
through flashattn_mps._autograd (the attention ops and their autograd, shared with every entry
point)."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from . import _C
from ._api import _flash_attn_lse, _routes_through_torch, _sinks_need_grad
from ._autograd import Sequences, _is_traced, attention_probabilities, attention_through_torch
from ._core import (
    _rng_words,
    dropout_rng_state,
    explained,
    plan_backward,
    plan_forward,
    plan_run,
    planning_rng_state,
    probs_arguments,
    probs_pass_runs,
    run_forward,
    sequence_args,
)
from ._options import (
    AttentionOptions,
    FlashAttnInputError,
    FlashAttnTypeError,
    alibi_view,
    check_bool,
    check_common,
    check_dropout,
    check_int,
    check_lengths_tensor,
    check_scale,
    check_sinks,
    given,
)
from ._quantized import QuantizedKV
from ._quantized import batched as quantized_batched
from ._quantized import operand as quantized_operand

_NOT_HERE = "{}: {} is not supported by flashattn_mps yet (got {})"


def _check_prefix_sums(cu: torch.Tensor, name: str, total, max_len: int, max_name: str, who: str) -> list:
    """cu_seqlens: starts at 0, never decreases, ends within the packed rows (`total`; None: no
    bound), and no sequence is longer than max_seqlen (one host read of the small tensor).
    Returns the sequences' lengths."""
    values = cu.tolist()
    if values[0] != 0:
        raise FlashAttnInputError(f"{who}: {name} must start at 0, got {values[0]}")
    lengths = [b - a for a, b in zip(values, values[1:])]
    if any(n < 0 for n in lengths):
        at = next(i for i, n in enumerate(lengths) if n < 0)
        raise FlashAttnInputError(
            f"{who}: {name} must be non-decreasing, got {values[at]} then {values[at + 1]} at {at}"
        )
    if total is not None and values[-1] > total:
        raise FlashAttnInputError(f"{who}: {name} ends at {values[-1]}, past the {total} packed rows")
    if lengths and max(lengths) > max_len:
        raise FlashAttnInputError(f"{who}: {max_name} = {max_len}, but {name} holds a sequence of {max(lengths)}")
    return lengths


def check_block_table(
    block_table, batch: int, k_pool: torch.Tensor, v_pool: torch.Tensor, device, who: str, names=("k", "v")
):
    """A paged KV cache as flash-attn takes it: k_pool and v_pool (num_blocks, page_block_size,
    nheads_k, headdim[_v]; the caller's `names`) sharing their pages, block_table a (batch,
    max_num_blocks) int32 tensor on `device`. Returns the pool's pages and the page size (no host
    read: block_table_rows reads the table)."""
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32:
        raise FlashAttnTypeError(f"{who}: block_table must be an int32 torch.Tensor, got {given(block_table)}")
    if (
        block_table.dim() != 2
        or block_table.shape[0] != batch
        or block_table.shape[1] < 1
        or block_table.device != device
    ):
        raise FlashAttnInputError(
            f"{who}: block_table must be (batch, max_num_blocks) = ({batch}, >= 1) on {device}, "
            f"got {tuple(block_table.shape)} on {block_table.device}"
        )
    if v_pool.shape[:2] != k_pool.shape[:2]:
        raise FlashAttnInputError(
            f"{who}: the paged {names[0]} {tuple(k_pool.shape)} and {names[1]} {tuple(v_pool.shape)} "
            "must share their pages (num_blocks, page_block_size)"
        )
    return k_pool.shape[0], k_pool.shape[1]


def block_table_rows(block_table: torch.Tensor) -> list:
    """The block table's rows, for check_pages_used (one host read)."""
    return block_table.tolist()


def check_pages_used(pages: list, b: int, keys: int, page_size: int, pool: int, who: str) -> None:
    """The pages sequence b's first `keys` positions live in (row b of the block table) are
    inside the pool."""
    bad = [page for page in pages[b][: -(-keys // page_size)] if not 0 <= page < pool]
    if bad:
        raise FlashAttnInputError(f"{who}: block_table[{b}] names page {bad[0]}, outside the pool of {pool} pages")


def packed_view(t: torch.Tensor) -> torch.Tensor:
    """A packed (total, H, D) tensor as the kernels' (1, H, total, D) view (a transpose, no copy)."""
    return t.transpose(0, 1).unsqueeze(0)


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
    *,
    sinks=None,
):
    """flash-attn 2's flash_attn_varlen_func: attention within each of `batch` packed sequences.

    Args, as flash-attn's:
        q: (total_q, nheads, headdim); k: (total_k, nheads_k, headdim); v: (total_k, nheads_k,
            headdim_v); nheads a multiple of nheads_k (GQA). Any strides (nothing is copied).
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 on q's device, the prefix sums of the
            sequences' lengths: sequence b is rows cu[b] .. cu[b + 1] - 1. Starting at 0,
            non-decreasing, ending within total (checked, with one host read on MPS).
        max_seqlen_q, max_seqlen_k: ints at least every sequence's length (the grid is sized by
            them; blocks past a shorter sequence leave at once).
        dropout_p: dropout of the attention probabilities, as flash_attn_func's (Philox in the
            kernels, seeded from torch's generator; the backward regenerates the mask).
        softmax_scale: default 1 / sqrt(headdim).
        causal: bottom-right aligned per sequence: query i of a sequence of L_b queries and S_b keys
            sees keys j <= i + S_b - L_b.
        window_size, softcap, alibi_slopes ((nheads,) or (batch, nheads) float32): as in
            flash_attn_func, each sequence on its own diagonal.
        deterministic: accepted; the backward is always deterministic.
        return_attn_probs: also return softmax_lse and S_dmask (below), for tests, as flash-attn.
        sinks: keyword only, (nheads,) attention-sink logits as in flash_attn_func, differentiable.
        block_table: None, or (batch, max_num_blocks_per_seq) int32 on q's device for a paged KV
            cache: k and v are then the pool (num_blocks, page_block_size, nheads_k, headdim[_v])
            and sequence b's keys are its positions 0 .. cu_seqlens_k[b + 1] - cu_seqlens_k[b] - 1,
            position t in page block_table[b, t // page_block_size] (read in place, through the
            table, by the prefill and the decode kernel alike). Every page a sequence uses must be
            in the pool and its keys within the table's max_num_blocks_per_seq * page_block_size
            positions (checked, one host read). Any page size >= 1 (flash-attn requires a multiple
            of 256). Forward only, as in flash-attn: inputs may require grad, and a backward that
            reaches this call raises a RuntimeError naming block_table.

    Returns out (total_q, nheads, headdim_v) of q's dtype; differentiable in q, k and v (a fused
    backward over the same sequence table). Rows of q past cu_seqlens_q[-1] are left unwritten.
    With return_attn_probs, (out, softmax_lse, S_dmask), gradients still flowing through out:
    softmax_lse (nheads, total_q) float32, each row's log-sum-exp of its scaled scores (of the
    undropped probabilities, sinks included), +inf for a row that sees no key and for rows past
    cu_seqlens_q[-1]; S_dmask (batch, nheads, max_seqlen_q, max_seqlen_k) of q's dtype, sequence
    b's softmax probabilities in its top-left [L_b, S_b] block (0 for keys a row does not see and
    outside the block), negative where dropout dropped them (the keep mask is ~signbit(S_dmask)), the
    very mask the forward applied. flash-attn rounds the last two sizes up to multiples of 128 and
    returns an empty S_dmask without dropout; here they are exactly max_seqlen_q and max_seqlen_k,
    probabilities without dropout too (one probability pass of the simple kernel over every
    sequence). Not with block_table. explain_varlen_plan, given the same arguments, shows what it
    launches.
    """
    arguments = (
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
        sinks,
    )
    if isinstance(k, QuantizedKV) or isinstance(v, QuantizedKV):
        return _quantized_varlen(q, k, v, *arguments)
    call = _check_varlen("flash_attn_varlen_func", q, k, v, *arguments)
    if call.paged is not None:
        return _paged_attention(call, "flash_attn_varlen_func")
    return packed_attention(*call[:7], call.options, call.return_attn_probs)


class PagedKeys(NamedTuple):
    """A varlen call's paged KV cache: the block table and the positions a table row holds."""

    block_table: torch.Tensor
    capacity: int


class _VarlenCall(NamedTuple):
    """A flash_attn_varlen_func call after its checks."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_q: int
    max_k: int
    options: AttentionOptions
    return_attn_probs: bool
    paged: Optional[PagedKeys]  # with a block_table: k and v are the pool


def _check_varlen(
    who,
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
    sinks,
) -> _VarlenCall:
    """flash_attn_varlen_func's checks (explain_varlen_plan's too), raising as flash-attn does. The
    checks of the tables' contents read them on the host, so traced calls skip them."""
    band, softcap = check_common(who, causal, window_size, softcap, deterministic)
    dropout_p = check_dropout(dropout_p, who)
    check_bool(return_attn_probs, "return_attn_probs", who)
    if return_attn_probs and block_table is not None:  # the probability pass reads keys in place
        raise NotImplementedError(_NOT_HERE.format(who, "return_attn_probs=True with a block_table", "both"))
    paged = block_table is not None
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{who}: {name} must be a torch.Tensor, got {given(t)}")
        if not paged and t.dim() != 3:
            raise FlashAttnInputError(
                f"{who}: q, k, v must be 3-D (total, nheads, headdim), got {name} {tuple(t.shape)}"
            )
    if paged:
        _check_paged_views(q, k, v, who)
    max_q = check_int(max_seqlen_q, "max_seqlen_q", who)
    max_k = check_int(max_seqlen_k, "max_seqlen_k", who)
    check_lengths_tensor(cu_seqlens_q, "cu_seqlens_q", who, q.device)
    check_lengths_tensor(cu_seqlens_k, "cu_seqlens_k", who, q.device, cu_seqlens_q.shape[0])
    if cu_seqlens_q.shape[0] < 1:
        raise FlashAttnInputError(f"{who}: cu_seqlens_q must have batch + 1 >= 1 entries, got 0")
    traced = _is_traced()
    if not traced:
        _check_prefix_sums(cu_seqlens_q, "cu_seqlens_q", q.shape[0], max_q, "max_seqlen_q", who)
        key_lengths = _check_prefix_sums(
            cu_seqlens_k, "cu_seqlens_k", None if paged else k.shape[0], max_k, "max_seqlen_k", who
        )
    scale = check_scale(softmax_scale, q.shape[-1], who)
    alibi = alibi_view(alibi_slopes, cu_seqlens_q.shape[0] - 1, q.shape[1], q.device, who)
    sinks = None if sinks is None else check_sinks(sinks, q.transpose(0, 1), who)
    paging = None
    if paged:  # the pages each sequence's keys use: inside the pool, within its table row
        pool, page_size = check_block_table(block_table, cu_seqlens_q.shape[0] - 1, k, v, q.device, who)
        capacity = page_size * block_table.shape[1]
        if not traced:
            pages = block_table_rows(block_table)
            for b, keys in enumerate(key_lengths):
                if keys > capacity:
                    raise FlashAttnInputError(
                        f"{who}: cu_seqlens_k gives sequence {b} {keys} keys, past the {capacity} "
                        f"positions of its block_table row ({block_table.shape[1]} pages of {page_size})"
                    )
                check_pages_used(pages, b, keys, page_size, pool, who)
        paging = PagedKeys(block_table, capacity)
    return _VarlenCall(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_q,
        max_k,
        AttentionOptions(scale, causal, band, softcap, alibi, sinks, dropout_p),
        return_attn_probs,
        paging,
    )


def packed_table(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, paged: bool = False, key_lengths=None
) -> torch.Tensor:
    """The (batch, 6) int32 sequence table of packed sequences (metal/fa_sequence.h), built on the
    prefix sums' device (no host read). paged: every sequence's keys start at position 0 of its
    pages, not at its prefix sum. key_lengths: None, or (batch,) int32 keys each sequence uses from
    its start (flash-attn 3's seqused_k), instead of its prefix sums' length."""
    zeros = torch.zeros(cu_seqlens_q.shape[0] - 1, dtype=torch.int32, device=cu_seqlens_q.device)
    key_starts = zeros if paged else cu_seqlens_k[:-1]
    keys = cu_seqlens_k.diff() if key_lengths is None else key_lengths
    return torch.stack([zeros, cu_seqlens_q[:-1], cu_seqlens_q.diff(), zeros, key_starts, keys], dim=1).contiguous()


def packed_attention(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_q: int,
    max_k: int,
    options: AttentionOptions,
    return_attn_probs=False,
    return_lse=False,
    key_lengths=None,
):
    """flash_attn_varlen_func after its checks (prefix sums already known good, e.g. built by the
    caller; the kernels clamp the table whatever it holds): no host read of the tensors. options:
    the call's checked AttentionOptions (alibi the (batch, H) view or None, sinks a checked (H,)
    float32 tensor or None). return_lse: (out, lse) (lse as with return_attn_probs); key_lengths:
    packed_table's."""
    table = packed_table(cu_seqlens_q, cu_seqlens_k, key_lengths=key_lengths)
    sinks, dropout_p = options.sinks, options.dropout_p
    rng_state = dropout_rng_state(q.device) if dropout_p > 0.0 else None
    through_torch = _routes_through_torch(q, k, v) or (sinks is not None and _sinks_need_grad(sinks))
    if not through_torch and (q.is_neg() or k.is_neg() or v.is_neg()):  # (attention_through_torch resolves them)
        q, k, v = q.resolve_neg(), k.resolve_neg(), v.resolve_neg()
    views = [packed_view(t) for t in (q, k, v)]
    if through_torch:
        out4, lse = attention_through_torch(
            *views, None, options, True, True, rng_state, Sequences(table, max_q, max_k)
        )
        out = out4.squeeze(0).transpose(0, 1)  # (total_q, H, Dv), as allocated
    else:
        out = q.new_empty((*q.shape[:2], v.shape[2]))
        lse = torch.empty((1, q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
        out4 = packed_view(out)
        run_forward(*views, out4, lse, options, sequence_args(table, max_q, max_k), rng_state)
    if not (return_attn_probs or return_lse):
        return out
    past = torch.arange(q.shape[0], device=q.device) >= cu_seqlens_q[-1]  # rows of no sequence
    flash_lse = _flash_attn_lse(lse[0]).masked_fill(past, math.inf)
    if not return_attn_probs:
        return out, flash_lse
    # The probabilities are exp(s - lse): the lse includes the sinks, so they need no other input.
    probs = attention_probabilities(
        *(t.detach() for t in (*views, out4)), lse, options, rng_state, Sequences(table, max_q, max_k)
    )
    return out, flash_lse, probs.to(q.dtype)


def explain_varlen_plan(
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
    *,
    sinks=None,
    backward=False,
) -> dict:
    """What `flash_attn_varlen_func` with exactly these arguments would launch, without running it
    (its checks are the function's own, so a call it refuses is refused here, with the same host
    read of the prefix sums; no other element is read and torch's generator is not drawn from).

    Returns explain_plan's dict: {"dispatches": [...], "split_count", "workspace_bytes", "empty"}
    (and "metal_stream" on MPS), the dispatches in launch order: the sequence table's kernel
    (fa_sequence_table_*, one thread per sequence), then the attention kernel over (sequence,
    query block) (decode, with split-K and its merge, for max_seqlen_q <= 8, else prefill); with
    return_attn_probs, after them the probability pass (the table's kernel again and fa_simple).
    backward=True: the gradients' dispatches instead: the table's kernel, then explain_plan's
    delta, dkdv and dq, for a gradient of out laid out as out (a strided one may change the
    dkdv kernel's load path, function constant 3). With a block_table, the forward over the pages
    (forward only: backward=True raises)."""
    call = _check_varlen(
        "explain_varlen_plan",
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
        sinks,
    )
    check_bool(backward, "backward", "explain_varlen_plan")
    rng_state = planning_rng_state(q.device)
    if call.paged is not None:
        if backward:
            raise FlashAttnInputError(
                "explain_varlen_plan: block_table (a paged KV cache) is forward only, as in flash-attn: "
                "there is no backward to explain"
            )
        args, _ = _paged_arguments(call)
        return plan_run(*args, rng_state)
    table = packed_table(call.cu_seqlens_q, call.cu_seqlens_k)
    # The forward's out (total_q, H, Dv) and its (1, H, total_q) float32 lse, unwritten.
    out = q.new_empty((*q.shape[:2], v.shape[2]))
    lse = torch.empty((1, q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    views = [packed_view(t) for t in (q, k, v, out)]
    sequences = sequence_args(table, call.max_q, call.max_k)
    alibi, sinks = call.options.alibi, call.options.sinks
    if backward:  # planning reads no element: the gradients only carry shapes and strides
        q4, k4, v4, out4 = views
        tensors = {
            "q": q4,
            "k": k4,
            "v": v4,
            "out": out4,
            "lse": lse,
            "dout": out4,
            "delta": torch.empty_like(lse),
            "dq": torch.empty_like(q4),
            "dk": torch.empty_like(k4),
            "dv": torch.empty_like(v4),
            "alibi_slopes": alibi,
            "rng_state": _rng_words(rng_state),
            "sinks": sinks,
            "sink_grad": None if sinks is None else torch.empty_like(lse),
            "sequences": table,
            "sequence_scratch": sequences[1],
        }
        options = call.options.core(max_q_len=call.max_q, max_kv_len=call.max_k)
        return explained({"dispatches": plan_backward(_device(q), tensors, options)}, q.device)
    plan = plan_run(*views, lse, call.options, sequences, rng_state)
    if call.return_attn_probs and probs_pass_runs(lse):
        tensors, options, _ = probs_arguments(*views, None, call.options, rng_state, sequences)
        plan["dispatches"] += plan_forward(_device(q), tensors, options)["dispatches"]
    return plan


def _device(t: torch.Tensor) -> int:
    return _C.DEVICE_CPU if t.is_cpu else _C.DEVICE_MPS


def _check_paged_views(q, k, v, who: str) -> None:
    """q (total_q, nheads, headdim) and the pool k, v (num_blocks, page_block_size, nheads_k,
    headdim[_v]) of q's dtype and device."""
    if q.dim() != 3:
        raise FlashAttnInputError(f"{who}: q must be 3-D (total_q, nheads, headdim), got {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 4:
            raise FlashAttnInputError(
                f"{who}: with block_table, {name} must be the 4-D pool (num_blocks, page_block_size, "
                f"nheads_k, headdim), got {tuple(t.shape)}"
            )
        if t.dtype != q.dtype or t.device != q.device:
            raise FlashAttnTypeError(
                f"{who}: {name} must share q's dtype and device ({q.dtype}, {q.device}), got {t.dtype}, {t.device}"
            )
    if k.shape[2] != v.shape[2] or k.shape[3] != q.shape[2]:
        raise FlashAttnInputError(
            f"{who}: the paged k {tuple(k.shape)} and v {tuple(v.shape)} must share nheads_k, and k's "
            f"headdim must be q's {tuple(q.shape)}"
        )


def _paged_arguments(call: _VarlenCall):
    """run_forward's (and plan_run's) arguments for a varlen call over a paged pool (q rows from
    the prefix sums, keys from position 0 of each sequence's pages), and the out they fill."""
    q, k_pool, v_pool = call.q, call.k, call.v
    block_table, capacity = call.paged
    table = packed_table(call.cu_seqlens_q, call.cu_seqlens_k, paged=True)
    out = q.new_empty((*q.shape[:2], v_pool.shape[3]))
    views = [packed_view(q), k_pool.transpose(1, 2), v_pool.transpose(1, 2), packed_view(out)]
    sequences = sequence_args(table, call.max_q, min(call.max_k, capacity), block_table)
    return (*views, None, call.options, sequences), out


def _quantized_varlen(q, k, v, *args):
    """flash_attn_varlen_func with K, V or both a QuantizedKV (packed (total_k, Hkv, D), or a paged
    pool): the same checks on stand-ins of their logical shape (no storage: checks read no
    element), then one forward whose kernels read the quantized tensors in place. No gradient, no
    return_attn_probs (the probability pass's simple kernel does not read them)."""
    who = "flash_attn_varlen_func"
    for name, t in (("k", k), ("v", v)):
        if isinstance(t, QuantizedKV) and (t.dtype != q.dtype or t.device != q.device):
            raise TypeError(
                f"{who}: {name} must share q's dtype and device ({q.dtype}, {q.device}), got {t.dtype}, {t.device}"
            )
    stand_ins = [q.new_empty(()).expand(t.shape) if isinstance(t, QuantizedKV) else t for t in (k, v)]
    call = _check_varlen(who, q, *stand_ins, *args)
    if call.return_attn_probs:
        raise NotImplementedError(_NOT_HERE.format(who, "return_attn_probs=True with quantized K/V", "both"))
    if torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, call.options.sinks)
    ):
        raise ValueError(
            f"{who}: no gradient flows through quantized K/V; call it under torch.no_grad() or detach them"
        )
    if _is_traced():
        raise NotImplementedError(f"{who}: quantized K/V are read by eager calls only, not under torch.compile")
    rng_state = dropout_rng_state(q.device) if call.options.dropout_p > 0.0 else None
    if call.paged is not None:
        args, out = _paged_arguments(call._replace(k=k, v=v))
    else:
        table = packed_table(call.cu_seqlens_q, call.cu_seqlens_k)
        out = q.new_empty((*q.shape[:2], v.shape[2]))
        views = [packed_view(q), *(quantized_batched(t.transpose(0, 1)) for t in (k, v)), packed_view(out)]
        args = (*views, None, call.options, sequence_args(table, call.max_q, call.max_k))
    views = list(args[:4])
    kv_quant = tuple(t if isinstance(t, QuantizedKV) else None for t in views[1:3])
    views[1], views[2] = quantized_operand(views[1]), quantized_operand(views[2])
    run_forward(*views, args[4], args[5]._replace(kv_quant=kv_quant), args[6], rng_state)
    return out


def _paged_attention(call: _VarlenCall, who: str):
    """flash_attn_varlen_func over a paged KV cache, after its checks: one forward over the
    sequence table, the kernels reading each sequence's keys through the block table. Inputs that
    require grad take the autograd path, whose backward refuses, naming block_table (flash-attn
    runs this forward and has no backward for it either)."""
    rng_state = dropout_rng_state(call.q.device) if call.options.dropout_p > 0.0 else None
    sinks = call.options.sinks
    if _routes_through_torch(call.q, call.k, call.v) or (sinks is not None and _sinks_need_grad(sinks)):
        block_table, capacity = call.paged
        table = packed_table(call.cu_seqlens_q, call.cu_seqlens_k, paged=True)
        views = [packed_view(call.q), call.k.transpose(1, 2), call.v.transpose(1, 2)]
        out4 = attention_through_torch(
            *views,
            None,
            call.options,
            False,
            True,
            rng_state,
            Sequences(table, call.max_q, min(call.max_k, capacity), block_table),
        )
        return out4.squeeze(0).transpose(0, 1)
    if call.q.is_neg() or call.k.is_neg() or call.v.is_neg():
        call = call._replace(q=call.q.resolve_neg(), k=call.k.resolve_neg(), v=call.v.resolve_neg())
    args, out = _paged_arguments(call)
    run_forward(*args, rng_state)
    return out
