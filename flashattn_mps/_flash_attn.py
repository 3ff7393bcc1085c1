"""flash-attn 2's `flash_attn_func`, over the same core and planner as flash_attention.

flash-attn's layout is (batch, seqlen, heads, headdim); it is viewed as (B, H, L, D) by a transpose
(no copy: the kernels read any strides) and the output is written straight into a new contiguous
(B, L, H, Dv) tensor. Its causal mask and windows are bottom-right aligned: query i's diagonal key
is i + S - L."""
from __future__ import annotations

import torch

from . import _C
from ._api import _check_softcap, _check_window, _given, attend

_UNSUPPORTED = "flash_attn_func: {} is not supported by flashattn_mps yet (got {})"


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2's flash_attn_func: attention of q (B, L, H, D) over k, v (B, S, Hkv, D) and
    (B, S, Hkv, Dv); Hq a multiple of Hkv (MQA/GQA: query head h reads kv head h // (Hq // Hkv)).

    Args, as flash-attn's:
        dropout_p: must be 0.0 (dropout is not implemented; anything else raises NotImplementedError).
        softmax_scale: multiplies q.k; default 1 / sqrt(D).
        causal: bottom-right aligned: query i sees keys j <= i + S - L. A query row that sees no
            key (L > S) gives zeros.
        window_size: (left, right): query i sees keys in [i + S - L - left, i + S - L + right];
            -1 leaves that side unbounded. With causal the right side is 0. Key tiles wholly outside
            the window are never visited (forward and backward).
        softcap: 0.0, or > 0: each scaled score s becomes softcap * tanh(s / softcap) (Gemma 2),
            forward and backward (the gradient goes through tanh).
        alibi_slopes: None, or float32 (H,) or (B, H): adds -slope * |i + S - L - j| to the score of
            query i and key j (after softcap); the slopes get no gradient, as in flash-attn.
        deterministic: accepted and ignored: the backward here is always deterministic (no atomics).
        return_attn_probs: must be False (raises NotImplementedError).

    Returns out (B, L, H, Dv), contiguous, of q's dtype; differentiable in q, k, v. Tensors on "mps"
    run Metal, on "cpu" the CPU Metal device. float32, float16 and bfloat16; D, Dv <= 576.
    """
    if not (isinstance(dropout_p, (int, float)) and not isinstance(dropout_p, bool)):
        raise TypeError(f"flash_attn_func: dropout_p must be a float, got {_given(dropout_p)}")
    if dropout_p != 0.0:
        raise NotImplementedError(_UNSUPPORTED.format("dropout_p > 0", dropout_p))
    if return_attn_probs is not False:
        raise NotImplementedError(_UNSUPPORTED.format("return_attn_probs=True", _given(return_attn_probs)))
    if causal is not True and causal is not False:
        raise TypeError(f"flash_attn_func: causal must be a bool, got {_given(causal)}")
    if deterministic is not True and deterministic is not False:
        raise TypeError(f"flash_attn_func: deterministic must be a bool, got {_given(deterministic)}")
    left, right = _check_window(window_size, "flash_attn_func")
    softcap = _check_softcap(softcap, "flash_attn_func")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flash_attn_func: {name} must be a torch.Tensor, got {_given(t)}")
        if t.dim() != 4:
            raise ValueError(
                f"flash_attn_func: q, k, v must be 4-D (batch, seqlen, heads, headdim), got {name} {tuple(t.shape)}"
            )
    out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, causal, softmax_scale,
                 _C.KERNEL_AUTO, False, (1, left, right), True, softcap, alibi_slopes)
    return out.transpose(1, 2)
