"""flash_attention's gradients: eagerly through a torch.autograd.Function, and as torch.library ops
for torch.compile, export and tracing.

`flashattn_mps::attention_forward(q, k, v, attn_mask, causal, scale, band, seq_major, softcap,
alibi_slopes, dropout_p, rng_state, sinks) -> (out, lse)`
runs the forward kernels and keeps the float32 log-sum-exp of each row (rng_state: dropout's
generator state, drawn by the caller outside the op so the fake implementations need none);
`flashattn_mps::attention_backward(dout, q, k, v, out, lse, attn_mask, causal, scale, band, softcap,
alibi_slopes, dropout_p, rng_state, sinks) -> (dq, dk, dv, dsinks)` (dsinks empty without sinks) runs
the fused backward (csrc/fa_backward.c). band is None or the ints (bottom_right, left, right) of
_api._band_of; seq_major allocates out as flash_attn_func's (B, L, H, Ev).
`flashattn_mps::attention_probs(...)` is flash_attn_func's return_attn_probs pass. All have fake
implementations, so torch.compile traces them without graph breaks, and
register_autograd joins them. A custom op's eager dispatch costs tens of microseconds in PyTorch,
so eager calls that need gradients take `_Attention`, an autograd.Function over the same two
cores (`_api.forward_core`, `_api.backward_core`) with the same formula.

The backward is itself not differentiable: asking for a graph of the gradients (create_graph=True,
double backward) raises instead of returning wrong second derivatives.
"""
from typing import Optional

import torch

from . import _C, _api
from ._api import (_scale_value, _validate, _validate_alibi, _validate_mask, _validate_sinks, backward_core,
                   forward_core, probs_core)


def _refuse_double_backward() -> None:
    if torch.is_grad_enabled():
        raise RuntimeError(
            "flash_attention: double backward is not supported; its gradients cannot be "
            "differentiated (create_graph=True)"
        )


class _Attention(torch.autograd.Function):
    """Eager autograd: (q, k, v, the (B, Hq, L, S) mask view or None, causal, scale, band, seq_major)
    -> (out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale, band, seq_major, softcap, alibi, dropout_p, rng_state, sinks):
        out, lse = forward_core(q, k, v, mask, causal, scale, _C.KERNEL_AUTO, True, band, seq_major, softcap, alibi,
                                dropout_p, rng_state, sinks)
        ctx.save_for_backward(q, k, v, out, lse, mask, alibi, rng_state, sinks)
        ctx.causal, ctx.scale, ctx.band, ctx.softcap, ctx.dropout_p = causal, scale, band, softcap, dropout_p
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        _refuse_double_backward()
        q, k, v, out, lse, mask, alibi, rng_state, sinks = ctx.saved_tensors
        grads = backward_core(dout, q, k, v, out, lse, mask, ctx.causal, ctx.scale, ctx.band, ctx.softcap, alibi,
                              ctx.dropout_p, rng_state, sinks)
        dsinks = grads[3] if sinks is not None else None
        return grads[0], grads[1], grads[2], None, None, None, None, None, None, None, None, None, dsinks


def attention_through_torch(q, k, v, attn_mask, causal: bool, scale: Optional[float], return_lse: bool, band=None,
                            seq_major=False, softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None,
                            sinks=None):
    """flash_attention for calls that need autograd or are being traced (flashattn_mps._api routes
    them here)."""
    scale_value = _scale_value(q.shape[-1], scale)
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or torch._C._len_torch_dispatch_stack() > 0:
        _validate(q, k, v, causal, scale, attn_mask)  # traced once; fake tensors are never checked by C
        out, lse = torch.ops.flashattn_mps.attention_forward(
            q, k, v, attn_mask, causal, scale_value, None if band is None else list(band), seq_major, softcap,
            alibi_slopes, dropout_p, rng_state,
            sinks if sinks is None or sinks.dtype == torch.float32 else sinks.float(),  # the op checks
        )
    else:
        mask = None if attn_mask is None else _validate_mask(attn_mask, q, k)
        if q.is_neg() or k.is_neg() or v.is_neg():  # resolved here, so autograd sees the copy
            q, k, v = q.resolve_neg(), k.resolve_neg(), v.resolve_neg()
        alibi = None if alibi_slopes is None else _validate_alibi(alibi_slopes, q)
        sinks = None if sinks is None else _validate_sinks(sinks, q)
        out, lse = _Attention.apply(q, k, v, mask, causal, scale_value, band, seq_major, softcap, alibi, dropout_p,
                                    rng_state, sinks)
    return (out, lse) if return_lse else out


_api._attention_through_torch = attention_through_torch


@torch.library.custom_op("flashattn_mps::attention_forward", mutates_args=())
def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    causal: bool,
    scale: float,
    band: Optional[list[int]] = None,
    seq_major: bool = False,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    rng_state: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    mask = None if attn_mask is None else _validate_mask(attn_mask, q, k)
    alibi = None if alibi_slopes is None else _validate_alibi(alibi_slopes, q)
    sinks = None if sinks is None else _validate_sinks(sinks, q)
    return forward_core(q, k, v, mask, causal, scale, _C.KERNEL_AUTO, True, _band_tuple(band), seq_major, softcap,
                        alibi, dropout_p, rng_state, sinks)


def _band_tuple(band: Optional[list[int]]):
    return None if band is None else tuple(band)


@attention_forward.register_fake
def _(q, k, v, attn_mask, causal, scale, band=None, seq_major=False, softcap=0.0, alibi_slopes=None, dropout_p=0.0,
      rng_state=None, sinks=None):
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
    scale: float,
    band: Optional[list[int]] = None,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    rng_state: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = None if attn_mask is None else _validate_mask(attn_mask, q, k)
    alibi = None if alibi_slopes is None else _validate_alibi(alibi_slopes, q)
    if sinks is None:
        return (*backward_core(dout, q, k, v, out, lse, mask, causal, scale, _band_tuple(band), softcap, alibi,
                               dropout_p, rng_state),
                _no_sink_gradient(q))
    return backward_core(dout, q, k, v, out, lse, mask, causal, scale, _band_tuple(band), softcap, alibi, dropout_p,
                         rng_state, _validate_sinks(sinks, q))


def _no_sink_gradient(q: torch.Tensor) -> torch.Tensor:
    """attention_backward's dsinks without sinks: an empty float32 tensor (an op returns tensors)."""
    return q.new_empty((0,), dtype=torch.float32)


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, attn_mask, causal, scale, band=None, softcap=0.0, alibi_slopes=None, dropout_p=0.0,
      rng_state=None, sinks=None):
    dsinks = _no_sink_gradient(q) if sinks is None else q.new_empty(sinks.shape, dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, attn_mask, causal, scale, band, _seq_major, softcap, alibi_slopes, dropout_p, rng_state, sinks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, alibi_slopes, rng_state, sinks)
    ctx.dropout_p = dropout_p
    ctx.causal = causal
    ctx.scale = scale
    ctx.band = band
    ctx.softcap = softcap
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout: torch.Tensor, _dlse: Optional[torch.Tensor]):
    _refuse_double_backward()
    q, k, v, out, lse, attn_mask, alibi_slopes, rng_state, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = attention_backward(dout, q, k, v, out, lse, attn_mask, ctx.causal, ctx.scale, ctx.band,
                                            ctx.softcap, alibi_slopes, ctx.dropout_p, rng_state, sinks)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None if sinks is None else dsinks


attention_forward.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("flashattn_mps::attention_probs", mutates_args=())
def attention_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    band: Optional[list[int]] = None,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    rng_state: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """flash_attn_func's return_attn_probs: the probabilities of the call that returned out and lse
    (_api.probs_core), an op so that compiled and exported code can ask for them too."""
    alibi = None if alibi_slopes is None else _validate_alibi(alibi_slopes, q)
    return probs_core(q, k, v, out, lse, None, causal, scale, _band_tuple(band), softcap, alibi, dropout_p, rng_state)


@attention_probs.register_fake
def _(q, k, v, out, lse, causal, scale, band=None, softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None):
    return q.new_empty((*q.shape[:-1], k.shape[-2]), dtype=torch.float32)
