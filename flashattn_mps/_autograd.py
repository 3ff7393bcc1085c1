"""flash_attention as differentiable torch.library ops.

`flashattn_mps::attention_forward(q, k, v, causal, scale) -> (out, lse)` runs the forward kernels and
keeps the float32 log-sum-exp of each row; `flashattn_mps::attention_backward(dout, q, k, v, out, lse,
causal, scale) -> (dq, dk, dv)` runs the fused backward (csrc/fa_backward.c). Both have fake
implementations, so torch.compile traces them without graph breaks, and register_autograd joins
them. flash_attention calls the forward op when an input requires grad or when it is being compiled.

The backward is itself not differentiable: asking for a graph of the gradients (create_graph=True,
double backward) raises instead of returning wrong second derivatives.
"""
from typing import Optional

import torch

from . import _C, _sources
from ._api import _DEVICE_CODES, _prepare_mps, _validate_mask, describe, flash_attention


@torch.library.custom_op("flashattn_mps::attention_forward", mutates_args=())
def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor], causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # The inputs arrive still marked as requiring grad; detached views take flash_attention's direct
    # path instead of coming back here.
    return flash_attention(q.detach(), k.detach(), v.detach(), causal, scale, attn_mask=attn_mask, return_lse=True)


@attention_forward.register_fake
def _(q, k, v, attn_mask, causal, scale):
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    unbatched = q.dim() == 3
    mask = None if attn_mask is None else _validate_mask(attn_mask, q, k)  # a (.., Hq, L, S) view
    batched = [t.unsqueeze(0) if unbatched else t for t in (q, k, v, out, lse, dout, dq, dk, dv)]
    if mask is not None and unbatched:
        mask = mask.unsqueeze(0)
    # D = rowsum(dout * out): scratch the core fills, then reads.
    delta = torch.empty(batched[0].shape[:-1], dtype=torch.float32, device=q.device)
    _sources.ensure_registered()
    if q.device.type == "mps":
        _prepare_mps()
    qb, kb, vb, outb, lseb, doutb, dqb, dkb, dvb = (describe(t) for t in batched)
    _C.backward(_DEVICE_CODES[q.device.type], qb, kb, vb, outb, lseb, doutb, describe(delta), dqb, dkb, dvb,
                scale, causal, mask=None if mask is None else describe(mask))
    return dq, dk, dv


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, attn_mask, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, attn_mask, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask)
    ctx.causal = causal
    ctx.scale = scale
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout: torch.Tensor, _dlse: Optional[torch.Tensor]):
    if torch.is_grad_enabled():
        raise RuntimeError(
            "flash_attention: double backward is not supported; its gradients cannot be "
            "differentiated (create_graph=True)"
        )
    q, k, v, out, lse, attn_mask = ctx.saved_tensors
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, attn_mask, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None


attention_forward.register_autograd(_backward, setup_context=_setup_context)
