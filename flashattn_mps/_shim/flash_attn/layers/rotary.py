"""flash-attn's flash_attn.layers.rotary.apply_rotary_emb, in torch ops (float32, differentiable):
the same rotation flashattn_mps's flash_attn_with_kvcache applies to q and the new keys."""

import torch

from flashattn_mps._kvcache import _rotate
from flashattn_mps._options import FlashAttnInputError


def apply_rotary_emb(
    x,
    cos,
    sin,
    interleaved=False,
    inplace=False,
    seqlen_offsets=0,
    cu_seqlens=None,
    max_seqlen=None,
):
    """Rotates the first rotary_dim = 2 * cos.shape[1] dims of x (batch, seqlen, nheads, headdim),
    or with cu_seqlens of the packed x (total, nheads, headdim), token t of a sequence at position
    seqlen_offsets + t (an int, or (batch,) offsets). interleaved: pairs (0, 1), (2, 3), ... (GPT-J);
    else (i, i + rotary_dim / 2) (GPT-NeoX). inplace writes the result into x and returns x."""
    who = "apply_rotary_emb"
    if cos.dim() != 2 or sin.shape != cos.shape or 2 * cos.shape[1] > x.shape[-1]:
        raise FlashAttnInputError(
            f"{who}: cos and sin must be (seqlen_rotary, rotary_dim / 2) with rotary_dim <= headdim "
            f"{x.shape[-1]}, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if cu_seqlens is None:
        if x.dim() != 4:
            raise FlashAttnInputError(f"{who}: x must be (batch, seqlen, nheads, headdim), got {tuple(x.shape)}")
        steps = torch.arange(x.shape[1], device=x.device)
        offsets = torch.as_tensor(seqlen_offsets, device=x.device).long().reshape(-1, 1)
        positions = (offsets + steps).expand(x.shape[0], -1)
        view = x
    else:
        if x.dim() != 3:
            raise FlashAttnInputError(
                f"{who}: with cu_seqlens, x must be (total_seqlen, nheads, headdim), got {tuple(x.shape)}"
            )
        rows = torch.arange(x.shape[0], device=x.device)
        sequence = (torch.searchsorted(cu_seqlens[1:].long(), rows, right=True)).clamp(max=cu_seqlens.shape[0] - 2)
        offsets = torch.as_tensor(seqlen_offsets, device=x.device).long()
        offsets = offsets[sequence] if offsets.dim() else offsets
        positions = (rows - cu_seqlens.long()[sequence] + offsets).unsqueeze(0)
        view = x.unsqueeze(0)
    rotated = _rotate(view, cos, sin, positions, interleaved).reshape(x.shape)
    if not inplace:
        return rotated
    x.copy_(rotated)
    return x
