"""What the FlashAttention-3 and -4 modules of the shim share: refusing what they accept but
flashattn_mps does not run, and their varlen call (seqused_k checked into each sequence's keys)."""

import torch

from flashattn_mps._options import FlashAttnInputError, check_lengths_tensor
from flashattn_mps._varlen import _check_varlen, packed_attention


def refuse(who: str, **arguments) -> None:
    """NotImplementedError naming the first argument given a value flashattn_mps cannot honour
    (each passed as True when its value is one it cannot)."""
    for name, unsupported in arguments.items():
        if unsupported:
            raise NotImplementedError(f"{who}: {name} is not supported by flashattn_mps's flash_attn shim")


def used_key_lengths(seqused_k, cu_seqlens_k, who: str):
    """seqused_k (batch,) int32: the keys each sequence uses from its start; at most its prefix
    sums' length when cu_seqlens_k is given (one host read, skipped under tracing as the other
    table checks are)."""
    batch = None if cu_seqlens_k is None else cu_seqlens_k.shape[0] - 1
    check_lengths_tensor(seqused_k, "seqused_k", who, seqused_k.device, batch)
    if torch.compiler.is_compiling():
        return seqused_k
    used = seqused_k.tolist()
    room = [None] * len(used) if cu_seqlens_k is None else cu_seqlens_k.diff().tolist()
    for b, (n, limit) in enumerate(zip(used, room)):
        if n < 0 or (limit is not None and n > limit):
            raise FlashAttnInputError(
                f"{who}: seqused_k[{b}] = {n} must be in [0, {'inf' if limit is None else limit}] "
                "(the keys of sequence b in cu_seqlens_k)"
            )
    return seqused_k


def varlen_attention(
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
    sinks,
    deterministic,
    return_lse,
):
    """A packed varlen call of FlashAttention-3 or -4 (no dropout, optional seqused_k and sinks),
    through flash_attn_varlen_func's checks and packed_attention: out, or with return_lse (out,
    lse (nheads, total_q), +inf for a row without keys)."""
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
        window_size,
        softcap,
        None,
        deterministic,
        False,
        None,
        sinks,
    )
    key_lengths = None if seqused_k is None else used_key_lengths(seqused_k, cu_seqlens_k, who)
    return packed_attention(*call[:7], call.options, return_lse=return_lse, key_lengths=key_lengths)
