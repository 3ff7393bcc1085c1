"""flashattn_mps in diffusers models.

    from flashattn_mps.integrations.diffusers import MPSAttnProcessor, use_in
    use_in(pipe.unet)                          # every attention call of that model on our kernels
    use_in(pipe.transformer, cpu=True)         # also CPU tensors, on the CPU Metal device

`use_in(model)` serves both kinds of diffusers attention, model by model:

- `AttnProcessor2_0` / `AttnProcessor` of diffusers' `Attention` modules (UNet2DConditionModel,
  DiT, PixArt, the VAE's attention, ...) become an `MPSAttnProcessor`, which computes what
  `AttnProcessor2_0` computes with the attention through the SDPA drop-in (and applies the
  module's `scale`, where diffusers falls back to its unfused processor).
- Every other processor keeps its own code (projections, norms, rotary embeddings, joint
  text-image concatenation, masks, GQA): the model gets a copy of it whose `__call__` resolves
  `dispatch_attention_fn` (Flux, Wan, QwenImage, HunyuanVideo, LTX: `attention_dispatch`) or
  `F.scaled_dot_product_attention` (SD3's joint processors) to flashattn_mps's SDPA drop-in.
  The copy's method runs with a private copy of its module's globals: diffusers' and torch's
  modules are not touched, no backend is switched globally, and another model (of the same class
  too) keeps its processors. The model's own attention backend choice is overridden.

A processor neither way reaches (its attention elsewhere, an `nn.Module` processor with weights,
context parallelism) is refused, naming the module, before any processor is changed. Calls the
kernels do not cover reach torch's SDPA, visibly (`flashattn_mps.explain`, logger
"flashattn_mps")."""

from __future__ import annotations

import copy
import types

import torch
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0

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
    """Every attention call of `model` through flashattn_mps (see the module's description);
    returns the model. Raises ValueError, changing nothing, when some attention module cannot be
    served or there is none."""
    plan, refused = [], []
    for name, module in model.named_modules():
        processor = getattr(module, "processor", None)
        if processor is None or not hasattr(module, "set_processor"):
            continue
        served = _serving(processor, cpu)
        if isinstance(served, str):
            refused.append(f"{name or type(model).__name__} ({type(processor).__name__}): {served}")
        else:
            plan.append((module, served))
    if refused:
        raise ValueError(
            f"use_in: {type(model).__name__} has attention flashattn_mps cannot serve: " + "; ".join(refused)
        )
    if not plan:
        raise ValueError(f"use_in: {type(model).__name__} has no diffusers attention module (none with a processor)")
    for module, served in plan:
        module.set_processor(served)
    return model


def _serving(processor, cpu: bool):
    """The processor that serves `processor`'s module through flashattn_mps, or why there is none."""
    original = getattr(processor, "flashattn_mps_original", None)
    if original is not None:  # served already (use_in again, maybe with another cpu)
        return _serving(original, cpu)
    if isinstance(processor, MPSAttnProcessor):
        return MPSAttnProcessor(cpu=cpu)
    if type(processor) in (AttnProcessor2_0, AttnProcessor):
        return MPSAttnProcessor(cpu=cpu)
    if isinstance(processor, torch.nn.Module):
        return "a processor with weights of its own (nn.Module) is not served"
    if getattr(processor, "_parallel_config", None) is not None:
        return "context parallelism (parallel_config) is not served"
    served_class = _served_class(type(processor), cpu)
    if isinstance(served_class, str):
        return served_class
    served = copy.copy(processor)
    served.__class__ = served_class
    served.flashattn_mps_original = processor
    return served


_SERVED_CLASSES = {}  # (processor class, cpu) -> its subclass calling flashattn_mps


def _served_class(cls, cpu: bool):
    """A subclass of the processor class whose __call__ is the class's own code run with a private
    copy of its globals, in which the attention it calls is flashattn_mps's; or why there is none."""
    key = (cls, cpu)
    if key not in _SERVED_CLASSES:
        call = cls.__call__
        code = getattr(call, "__code__", None)
        names = set() if code is None else set(code.co_names)
        if "dispatch_attention_fn" in names:
            replaced = {"dispatch_attention_fn": _dispatch_attention(cpu)}
        elif "F" in names and "scaled_dot_product_attention" in names:
            replaced = {"F": _Functional(cpu)}
        else:
            return "its __call__ reaches attention neither through dispatch_attention_fn nor F.scaled_dot_product_attention"
        scope = {**call.__globals__, **replaced}
        method = types.FunctionType(code, scope, call.__name__, call.__defaults__, call.__closure__)
        method.__kwdefaults__ = call.__kwdefaults__
        method.__qualname__ = f"MPS{cls.__name__}.__call__"
        _SERVED_CLASSES[key] = type(
            f"MPS{cls.__name__}",
            (cls,),
            {"__call__": method, "__module__": __name__, "flashattn_mps_cpu": cpu},
        )
    return _SERVED_CLASSES[key]


def _dispatch_attention(cpu: bool):
    """diffusers' dispatch_attention_fn for one model: query, key, value (B, L, H, D); what its
    native backend does (a (B, S) mask is read as (B, 1, 1, S)), through the SDPA drop-in."""

    def dispatch_attention_fn(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
        attention_kwargs=None,
        *,
        backend=None,
        parallel_config=None,
    ):
        if parallel_config is not None:
            raise NotImplementedError("flashattn_mps (use_in): context parallelism (parallel_config) is not served")
        if attention_kwargs:
            raise NotImplementedError(
                f"flashattn_mps (use_in): attention_kwargs {sorted(attention_kwargs)} are not served"
            )
        if attn_mask is not None and attn_mask.ndim == 2 and attn_mask.shape == (query.shape[0], key.shape[1]):
            attn_mask = attn_mask[:, None, None, :]
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        out = _attend(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, cpu)
        return out.transpose(1, 2)

    return dispatch_attention_fn


class _Functional:
    """torch.nn.functional for one processor's code, with its scaled_dot_product_attention the
    SDPA drop-in."""

    def __init__(self, cpu: bool):
        self.cpu = cpu

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)

    def scaled_dot_product_attention(
        self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ):
        return _attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, self.cpu)
