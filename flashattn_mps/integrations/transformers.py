"""flashattn_mps as a Hugging Face transformers attention implementation.

    from flashattn_mps.integrations import transformers as fa_transformers
    name = fa_transformers.register()          # "mps_attention"
    model = AutoModelForCausalLM.from_pretrained(model_id, attn_implementation=name)
    model.set_attn_implementation(name)        # or switch a loaded model

`register` puts the attention function into transformers' `AttentionInterface` and transformers'
SDPA mask builder into its `AttentionMaskInterface` under the same name: models then build their
padding, causal, sliding-window and packed-sequence masks as they do for "sdpa" (None where the
causal flag suffices), and every attention call goes through the SDPA drop-in, so what the kernels
do not cover (dropout in training, ...) still reaches torch's SDPA, visibly (`flashattn_mps.explain`,
logger "flashattn_mps")."""
from __future__ import annotations

import functools
from typing import Optional

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import create_position_bias_mask
from transformers.masking_utils import sdpa_mask

from .._sdpa import _attend

DEFAULT_NAME = "mps_attention"


def register(name: str = DEFAULT_NAME, cpu: bool = False) -> str:
    """Register flashattn_mps with transformers as `name` and return the name.

    cpu=True also runs CPU tensors on the CPU Metal device (as `flashattn_mps.patch(cpu=True)`
    does); otherwise CPU tensors take torch's SDPA. transformers treats a name containing "flash"
    as a flash-attn kernel to import and a name "org/repo" as a Hub kernel, so such names are refused."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"register: name must be a non-empty str, got {name!r}")
    if "flash" in name or "/" in name or ":" in name:
        raise ValueError(
            f"register: name {name!r} would make transformers load a flash-attn or Hub kernel instead "
            f"(names containing 'flash', '/' or ':'); use e.g. {DEFAULT_NAME!r}"
        )
    AttentionInterface.register(name, functools.partial(attention_forward, allow_cpu=bool(cpu)))
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    sliding_window: Optional[int] = None,
    position_bias: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
    s_aux: Optional[torch.Tensor] = None,
    allow_cpu: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function signature: (B, Hq, L, E) query, (B, Hkv, S, E) key and
    value, the mask from the registered mask function (bool (B, 1, L, S), or None when
    `is_causal` suffices); returns the (B, L, Hq, Ev) output and no attention weights.

    Without a mask, a causal call is top-left aligned as in transformers' SDPA path (the queries
    come first: a prefill, or a static cache's unused tail) except a single query, which sees
    every key; `sliding_window` is then applied on the same alignment. With a mask, the mask
    already holds the window. GQA runs without repeating key/value heads."""
    if softcap is not None:
        raise ValueError(
            f"flashattn_mps attention: {type(module).__name__} asks for logit softcapping (softcap={softcap}), "
            "which the kernels do not implement; use attn_implementation='eager' for this model"
        )
    sinks = s_aux if s_aux is not None else kwargs.get("sinks")
    if sinks is not None:
        raise ValueError(
            f"flashattn_mps attention: {type(module).__name__} has attention sinks (s_aux of shape "
            f"{tuple(sinks.shape)}), which the kernels do not implement; use attn_implementation='eager'"
        )
    packed = _packed_sequences(query, kwargs)
    if packed is not None:  # padding-free: packed sequences go to the varlen kernels
        return _attend_packed(module, query, key, value, dropout, scaling, is_causal, sliding_window, *packed), None
    q_length, kv_length = query.shape[2], key.shape[2]
    wants_causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    causal = wants_causal and attention_mask is None and q_length > 1  # a mask already holds causality
    if attention_mask is None and sliding_window is not None and max(q_length, kv_length) > sliding_window:
        attention_mask = _window_mask(q_length, kv_length, sliding_window, wants_causal, query.device)
        causal = False
    if position_bias is not None:  # relative position biases (T5 and kin) join the mask, as in "sdpa"
        attention_mask = create_position_bias_mask(position_bias, attention_mask, causal, query, key)
        causal = False
    out = _attend(query, key, value, attention_mask, dropout, causal, scaling, query.shape[1] != key.shape[1],
                  allow_cpu)
    return out.transpose(1, 2).contiguous(), None


def _window_mask(q_length: int, kv_length: int, window: int, causal: bool, device) -> torch.Tensor:
    """(L, S) bool: query i, at key position i (or S - 1 for a single query), sees the keys
    transformers' sliding masks let it see: causal, the `window` - 1 keys before it and itself;
    bidirectional, the keys at most `window` positions away."""
    offset = kv_length - 1 if q_length == 1 else 0
    position = torch.arange(q_length, device=device)[:, None] + offset
    keys = torch.arange(kv_length, device=device)[None, :]
    if causal:
        return (keys > position - window) & (keys <= position)
    return (keys - position).abs() <= window


_last_packing = [None, -1, None]  # (position_ids, its version, _packed_sequences' answer): one per forward


def _packed_sequences(query: torch.Tensor, kwargs: dict):
    """(cu_seqlens_q, cu_seqlens_k, max_q, max_k, trusted) of a padding-free batch, or None:
    flash-attn's kwargs cu_seq_lens_q/k and max_length_q/k (transformers'
    DataCollatorWithFlattening; validated by flash_attn_varlen_func), or a batch of one whose
    position_ids restart at 0 (packed sequences). The prefix sums built from position_ids are
    good by construction and read on the host once per forward (every layer gets the same
    position_ids tensor), not once per layer."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None and query.shape[0] == 1:
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        max_q = int(cu_q.diff().max()) if max_q is None else int(max_q)
        max_k = int(cu_k.diff().max()) if max_k is None else int(max_k)
        return cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k, False
    positions = kwargs.get("position_ids")
    if positions is None or query.shape[0] != 1 or positions.shape[-1] != query.shape[2] or query.shape[2] < 2:
        return None
    if _last_packing[0] is positions and _last_packing[1] == positions._version:
        return _last_packing[2]
    flat = positions.reshape(-1)
    starts = (flat == 0).nonzero().reshape(-1)
    packed = None
    if starts.numel() >= 2 and int(starts[0]) == 0:  # else one sequence (or not packed): the ordinary path
        cu = torch.cat([starts, starts.new_tensor([flat.numel()])]).to(torch.int32)
        longest = int(cu.diff().max())
        packed = (cu, cu, longest, longest, True)
    _last_packing[:] = [positions, positions._version, packed]
    return packed


def _attend_packed(module, query, key, value, dropout, scaling, is_causal, sliding_window, cu_q, cu_k, max_q, max_k,
                   trusted):
    """The (1, L, Hq, Ev) output of packed sequences through the varlen kernels (causal per
    sequence; transformers' sliding window of `w` keys is flash-attn's window_size (w - 1, 0))."""
    from .._api import _scale_value
    from .._varlen import flash_attn_varlen_func, packed_attention

    if dropout:
        raise NotImplementedError("flashattn_mps attention: dropout with packed sequences is not supported yet")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0 if causal else sliding_window - 1)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    cu_q, cu_k = cu_q.to(query.device), cu_k.to(query.device)
    if trusted:
        out = packed_attention(q, k, v, cu_q, cu_k, max_q, max_k, _scale_value(q.shape[-1], scaling), causal,
                               (1, *window), 0.0)
    else:
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scaling, causal=causal,
                                     window_size=window)
    return out.unsqueeze(0)
