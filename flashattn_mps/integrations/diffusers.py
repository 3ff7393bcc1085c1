"""flashattn_mps as a diffusers attention processor.

    from flashattn_mps.integrations.diffusers import MPSAttnProcessor, use_in
    use_in(pipe.unet)                          # = pipe.unet.set_attn_processor(MPSAttnProcessor())
    use_in(pipe.transformer, cpu=True)         # also CPU tensors, on the CPU Metal device

The processor serves diffusers' `Attention` modules (`diffusers.models.attention_processor.Attention`:
UNet2DConditionModel, DiT, PixArt, the VAE's mid-block attention, ...), computing what their
default `AttnProcessor2_0` computes with the attention through the SDPA drop-in. Unlike
`AttnProcessor2_0` it applies the module's `scale` (the same 1/sqrt(head dim) unless `scale_qk` is
off or a custom scale was given, where diffusers falls back to its unfused processor)."""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention

from .._sdpa import _attend


class MPSAttnProcessor:
    """A diffusers attention processor running attention through flashattn_mps (MPS tensors;
    cpu=True also CPU tensors, on the CPU Metal device). Calls the kernels do not cover reach
    torch's SDPA, visibly (`flashattn_mps.explain`, logger "flashattn_mps")."""

    def __init__(self, cpu: bool = False):
        self.cpu = bool(cpu)

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states=None,
        attention_mask=None,
        temb=None,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        image_shape = hidden_states.shape if hidden_states.ndim == 4 else None
        if image_shape is not None:  # (B, C, H, W) -> (B, H*W, C)
            hidden_states = hidden_states.flatten(2).transpose(1, 2)
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        batch, context_length = context.shape[0], context.shape[1]
        if attention_mask is not None:  # (B * heads, 1 or L, S) -> (B, heads, 1 or L, S)
            attention_mask = attn.prepare_attention_mask(attention_mask, context_length, batch)
            attention_mask = attention_mask.view(batch, attn.heads, -1, attention_mask.shape[-1])
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        if encoder_hidden_states is not None and attn.norm_cross:
            context = attn.norm_encoder_hidden_states(encoder_hidden_states)

        query, key, value = attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)
        head_dim = key.shape[-1] // attn.heads
        query, key, value = (t.view(batch, -1, attn.heads, head_dim).transpose(1, 2) for t in (query, key, value))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        out = _attend(query, key, value, attention_mask, 0.0, False, attn.scale, False, self.cpu)
        out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim).to(query.dtype)
        out = attn.to_out[1](attn.to_out[0](out))  # projection, dropout
        if image_shape is not None:
            out = out.transpose(1, 2).reshape(image_shape)
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor


def use_in(model: torch.nn.Module, cpu: bool = False) -> torch.nn.Module:
    """Give every diffusers `Attention` module of `model` an MPSAttnProcessor; returns the model.
    Modules of other attention classes keep their processors."""
    processor = MPSAttnProcessor(cpu=cpu)
    count = 0
    for module in model.modules():
        if isinstance(module, Attention):
            module.set_processor(processor)
            count += 1
    if count == 0:
        raise ValueError(
            f"use_in: {type(model).__name__} has no diffusers.models.attention_processor.Attention module "
            "(newer diffusers models dispatch attention through their attention backends instead)"
        )
    return model
