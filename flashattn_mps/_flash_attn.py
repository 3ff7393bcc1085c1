"""flash-attn 2's `flash_attn_func`, over the same core and planner as flash_attention.

flash-attn's layout is (batch, seqlen, heads, headdim); it is viewed as (B, H, L, D) by a transpose
(no copy: the kernels read any strides) and the output is written straight into a new contiguous
(B, L, H, Dv) tensor. Its causal mask and windows are bottom-right aligned: query i's diagonal key
is i + S - L."""

from __future__ import annotations

import torch

from . import _C
from ._api import attend_with, attention_options
from ._autograd import attention_probabilities
from ._core import dropout_rng_state
from ._options import FlashAttnInputError, check_bool, check_common, check_dropout, check_number, given


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
    *,
    sinks=None,
):
    """flash-attn 2's flash_attn_func: attention of q (B, L, H, D) over k, v (B, S, Hkv, D) and
    (B, S, Hkv, Dv); Hq a multiple of Hkv (MQA/GQA: query head h reads kv head h // (Hq // Hkv)).

    Args, as flash-attn's:
        dropout_p: probability in [0, 1] of dropping each attention probability (set it to 0.0 in
            evaluation, as flash-attn says); kept ones are scaled by 1 / (1 - dropout_p). The kernels
            drop with a counter-based generator (Philox 4x32-10) seeded per call from torch's
            default generator of q's device, so torch.manual_seed makes runs reproducible; the
            backward regenerates the forward's mask.
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
        deterministic: accepted; changes nothing: the backward here is always deterministic (each
            gradient element is written by one thread, no atomics), dropout included (the mask is a
            function of the generator state, not of scheduling).
        return_attn_probs: also return softmax_lse and the attention probabilities, for tests.
        sinks: keyword only, not in flash-attn 2: None, or (H,) attention-sink logits (GPT-OSS,
            StreamingLLM; flash-attn 3's learnable sinks), float32 or q's dtype: each row's softmax
            also counts exp(sinks[h]) in its denominator, with no value. Differentiable.

    Returns out (B, L, H, Dv), contiguous, of q's dtype; differentiable in q, k, v. With
    return_attn_probs, (out, softmax_lse, S_dmask): softmax_lse (B, H, L) float32, the log-sum-exp
    of each row's scaled scores (of the undropped probabilities); S_dmask (B, H, L, S) of q's
    dtype, the softmax probability of each key a row sees (0 for the others) and negative where
    dropout dropped it, as flash-attn's tests read it (their keep mask is S_dmask >= 0; the sign
    bit tells a dropped probability that rounds to zero). flash-attn pads its S_dmask to multiples
    of 128 and returns an empty one without dropout; here it is exactly (B, H, L, S), probabilities
    without dropout too. Tensors on "mps" run Metal, on "cpu" the CPU Metal device. float32,
    float16 and bfloat16; D, Dv <= 576.
    """
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
        sinks,
        with_lse=return_attn_probs,
        with_probs=return_attn_probs,
    )


def dense_attention(
    who,
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
    sinks,
    with_lse=False,
    with_probs=False,
):
    """flash_attn_func after its signature, for every flash-attn release's dense function (the
    flash_attn shim's too): out, or (out, lse) with_lse, or (out, lse, probs) with_probs too. The
    lse is flash-attn's (B, H, L) float32, +inf for a row that sees no key."""
    dropout_p = check_dropout(dropout_p, who)
    check_bool(with_lse, "return_attn_probs", who)
    band, softcap = check_common(who, causal, window_size, softcap, deterministic)
    if softmax_scale is not None and type(softmax_scale) is not float:
        softmax_scale = check_number(softmax_scale, "softmax_scale", who)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{who}: {name} must be a torch.Tensor, got {given(t)}")
        if t.dim() != 4:
            raise FlashAttnInputError(
                f"{who}: q, k, v must be 4-D (batch, seqlen, heads, headdim), got {name} {tuple(t.shape)}"
            )
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    options = attention_options(
        qh, kh, vh, None, causal, softmax_scale, _C.KERNEL_AUTO, band, softcap, alibi_slopes, dropout_p, sinks
    )
    rng_state = dropout_rng_state(q.device) if dropout_p > 0.0 else None
    result = attend_with(qh, kh, vh, None, options, with_lse, True, rng_state)
    if not with_lse:
        return result.transpose(1, 2)
    out, lse = result
    if not with_probs:
        return out.transpose(1, 2), lse
    # The probabilities are exp(s - lse): the lse includes the sinks, so they need no other input.
    probs = attention_probabilities(qh.detach(), kh.detach(), vh.detach(), out.detach(), lse, options, rng_state)
    return out.transpose(1, 2), lse, probs.to(q.dtype)
