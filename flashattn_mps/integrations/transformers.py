"""flashattn_mps as a Hugging Face transformers attention implementation.

    from flashattn_mps.integrations import transformers as fa_transformers
    name = fa_transformers.register()          # "mps_attention"
    model = AutoModelForCausalLM.from_pretrained(model_id, attn_implementation=name)
    model.set_attn_implementation(name)        # or switch a loaded model

`register` puts the attention function into transformers' `AttentionInterface` and a mask builder
into its `AttentionMaskInterface` under the same name: models then build their padding, causal,
sliding-window and packed-sequence masks as they do for "sdpa" (transformers' `sdpa_mask`), except
that a sliding-window causal mask without padding is not built at all: the kernels apply the window
themselves (`sliding_window`), as they do the causal flag, so no L x S mask exists. Logit softcapping
(`softcap`, Gemma 2) and attention sinks (`s_aux`, GPT-OSS) go to the kernels natively too. Every
call goes through the SDPA drop-in's routing, so what the kernels do not cover (devices or dtypes
they lack) still reaches torch, visibly (`flashattn_mps.explain`, logger "flashattn_mps"): torch's SDPA,
or for softcap and sinks, which SDPA cannot express, attention on materialised scores."""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import create_position_bias_mask
from transformers.masking_utils import (
    _ignore_causal_mask_sdpa,
    _non_vmap_expansion_sdpa,
    prepare_padding_mask,
    sdpa_mask,
    sliding_window_bidirectional_mask_function,
    sliding_window_causal_mask_function,
)

from .._api import flash_attention
from .._sdpa import _attend, _plan, log

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
    AttentionMaskInterface.register(name, attention_mask)
    return name


def attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask=None,
    local_size: Optional[int] = None,
    allow_is_causal_skip: bool = True,
    **kwargs,
) -> Optional[torch.Tensor]:
    """transformers' mask interface: `sdpa_mask`'s masks, but None for a sliding-window mask
    (causal or bidirectional) the kernels apply themselves from `sliding_window` (see `_native_window`)."""
    if _native_window(
        q_length,
        kv_length,
        q_offset,
        kv_offset,
        mask_function,
        attention_mask,
        local_size,
        allow_is_causal_skip,
        kwargs.get("allow_is_bidirectional_skip", False),
        kwargs.get("device", "cpu"),
    ):
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        local_size=local_size,
        allow_is_causal_skip=allow_is_causal_skip,
        **({} if mask_function is None else {"mask_function": mask_function}),
        **kwargs,
    )


def _native_window(
    q_length,
    kv_length,
    q_offset,
    kv_offset,
    mask_function,
    attention_mask,
    local_size,
    allow_is_causal_skip,
    allow_is_bidirectional_skip,
    device,
) -> bool:
    """Whether the mask asked for is exactly transformers' sliding-window causal mask (or, asked
    with allow_is_bidirectional_skip, its bidirectional one: ModernBERT's) over keys without
    padding, aligned as attention_forward aligns a window without a mask: queries and keys at the
    same positions (a prefill, an encoder), or one query at the last key (a causal decode step).
    transformers asks for every local mask with `local_size`; the mask function is checked on a
    probe of positions, so a chunked mask of the same size, or one with extra patterns, is built as
    usual (those also come without the skip flags, as packed sequences do)."""
    if local_size is None or mask_function is None or not (allow_is_causal_skip or allow_is_bidirectional_skip):
        return False
    if not isinstance(q_offset, int) or not isinstance(kv_offset, int):
        return False  # a static cache's tensor offset: its value cannot be read while tracing
    aligned = (q_length == kv_length and q_offset == kv_offset) or (
        q_length == 1 and q_offset == kv_offset + kv_length - 1
    )
    if not aligned:
        return False
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    # transformers' own test that no key is padding (False while tracing a padding mask's values).
    if not _ignore_causal_mask_sdpa(padding, q_length, kv_length, q_offset, kv_offset, None):
        return False
    probe = torch.arange(2 * local_size + 2, device=device)
    zero = torch.zeros(1, dtype=torch.long, device=device)
    expanded = _non_vmap_expansion_sdpa(zero, zero, probe, probe)
    pattern = (
        sliding_window_causal_mask_function if allow_is_causal_skip else sliding_window_bidirectional_mask_function
    )
    expected = pattern(local_size)(*expanded)
    return bool(torch.equal(mask_function(*expanded).expand_as(expected), expected))


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
    value, the mask from the registered mask function (bool (B, 1, L, S), or None when the causal
    flag and `sliding_window` suffice); returns the (B, L, Hq, Ev) output and no attention weights.

    Without a mask, a causal call is top-left aligned as in transformers' SDPA path (the queries
    come first: a prefill, or a static cache's unused tail) except a single query, which sees
    every key; `sliding_window` is then applied by the kernels on the same alignment (causal: the
    query's own key and the `sliding_window` - 1 before it; bidirectional: keys at most
    `sliding_window` - 1 positions away: transformers' flash-attention convention, window_size
    (sliding_window - 1, sliding_window - 1), for which ModernBERT passes its masks' window + 1).
    With a mask, the mask already holds the window.
    `softcap` (each scaled score s becomes softcap * tanh(s / softcap)) and the (Hq,) sinks `s_aux`
    are applied in the kernels, gradients included. GQA runs without repeating key/value heads."""
    sinks = s_aux if s_aux is not None else kwargs.get("sinks")
    packed = _packed_sequences(query, kwargs)
    if packed is not None:  # padding-free: packed sequences go to the varlen kernels
        return _attend_packed(
            module,
            query,
            key,
            value,
            dropout,
            scaling,
            is_causal,
            sliding_window,
            float(softcap or 0.0),
            sinks,
            *packed,
        ), None
    q_length, kv_length = query.shape[2], key.shape[2]
    wants_causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    causal = wants_causal and attention_mask is None and q_length > 1  # a mask already holds causality
    window = None
    if attention_mask is None and sliding_window is not None and max(q_length, kv_length) > sliding_window:
        window = (sliding_window - 1, 0) if wants_causal else (sliding_window - 1, sliding_window - 1)
    if position_bias is not None:  # relative position biases (T5 and kin) join the mask, as in "sdpa"
        if window is not None:
            attention_mask = _window_mask(q_length, kv_length, sliding_window, wants_causal, query.device)
            causal, window = False, None
        attention_mask = create_position_bias_mask(position_bias, attention_mask, causal, query, key)
        causal = False
    gqa = query.shape[1] != key.shape[1]
    if window is None and not softcap and sinks is None:
        out = _attend(query, key, value, attention_mask, dropout, causal, scaling, gqa, allow_cpu)
    else:
        out = _attend_variants(
            query,
            key,
            value,
            attention_mask,
            dropout,
            causal,
            scaling,
            gqa,
            allow_cpu,
            window,
            float(softcap or 0.0),
            sinks,
            wants_causal and q_length == 1 and attention_mask is None,
        )
    return out.transpose(1, 2).contiguous(), None


def _attend_variants(
    query, key, value, mask, dropout, causal, scaling, gqa, allow_cpu, window, softcap, sinks, decode_causal
):
    """A call with a window, softcap or sinks: the kernels take them natively where the drop-in's
    routing takes the call (training dropout included); elsewhere (devices or dtypes the kernels lack)
    attention on materialised scores with the same variants. A single query (decode_causal when
    causal) has its window on the last key: bottom-right."""
    decision, call = _plan(query, key, value, mask, dropout, causal, scaling, gqa, allow_cpu)
    if not torch.compiler.is_compiling() and log.isEnabledFor(logging.DEBUG):
        variants = ", ".join(
            name
            for name, on in (
                ("sliding window", window is not None),
                ("softcap", softcap > 0),
                ("sinks", sinks is not None),
            )
            if on
        )
        log.debug(
            "transformers attention with %s -> %s",
            variants,
            decision if call is not None else "materialised scores (torch): " + decision.reason,
        )
    if call is None:
        return _materialised_attention(
            query, key, value, mask, dropout, causal, scaling, window, softcap, sinks, decode_causal
        )
    query, key, value, mask, _, scale, dropout_p = call  # autocast applied
    if decode_causal:
        causal_mode, align = "bottom_right", None
    else:  # a single bidirectional query's window is centred on the last key too
        causal_mode, align = causal, ("bottom_right" if query.shape[2] == 1 and not causal else None)
    return flash_attention(
        query,
        key,
        value,
        causal_mode,
        scale,
        attn_mask=mask,
        window_size=window,
        softcap=softcap,
        sinks=sinks,
        window_align=align,
        dropout_p=dropout_p,
    )


def _materialised_attention(query, key, value, mask, dropout, causal, scaling, window, softcap, sinks, decode_causal):
    """Attention in torch on an L x S score matrix, for calls with variants the kernels cannot take."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = (query @ key.transpose(-1, -2)) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    q_length, kv_length = query.shape[2], key.shape[2]
    causal = causal or decode_causal
    if window is not None:
        keep = _window_mask(q_length, kv_length, window[0] + 1, causal, query.device)
    else:
        keep = torch.ones(q_length, kv_length, dtype=torch.bool, device=query.device)
        keep = keep.tril(kv_length - q_length if decode_causal else 0) if causal else keep
    scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    no_key = (scores == float("-inf")).all(-1, keepdim=True)
    if sinks is not None:
        column = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, column], -1)
    probs = torch.softmax(scores.float(), -1).to(query.dtype)
    probs = probs[..., :-1] if sinks is not None else probs.masked_fill(no_key, 0.0)  # rows without keys: zeros
    return torch.nn.functional.dropout(probs, dropout, training=dropout > 0) @ value


def _window_mask(q_length: int, kv_length: int, window: int, causal: bool, device) -> torch.Tensor:
    """(L, S) bool: query i, at key position i (or S - 1 for a single query), sees the keys
    transformers' flash-attention path lets it see (window_size (window - 1, window - 1)): causal,
    the `window` - 1 keys before it and itself; bidirectional, the keys at most `window` - 1
    positions away (ModernBERT passes its masks' window + 1)."""
    offset = kv_length - 1 if q_length == 1 else 0
    position = torch.arange(q_length, device=device)[:, None] + offset
    keys = torch.arange(kv_length, device=device)[None, :]
    if causal:
        return (keys > position - window) & (keys <= position)
    return (keys - position).abs() <= window - 1


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


def _attend_packed(
    module,
    query,
    key,
    value,
    dropout,
    scaling,
    is_causal,
    sliding_window,
    softcap,
    sinks,
    cu_q,
    cu_k,
    max_q,
    max_k,
    trusted,
):
    """The (1, L, Hq, Ev) output of packed sequences through the varlen kernels (causal per
    sequence; transformers' sliding window of `w` keys is flash-attn's window_size (w - 1, 0));
    dropout, softcap and sinks in the kernels too."""
    from .._options import AttentionOptions, check_sinks, scale_value
    from .._varlen import flash_attn_varlen_func, packed_attention

    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0 if causal else sliding_window - 1)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    cu_q, cu_k = cu_q.to(query.device), cu_k.to(query.device)
    if trusted:
        sinks = None if sinks is None else check_sinks(sinks, query[0])
        options = AttentionOptions(
            scale_value(q.shape[-1], scaling), causal, (1, *window), softcap, None, sinks, float(dropout)
        )
        out = packed_attention(q, k, v, cu_q, cu_k, max_q, max_k, options)
    else:
        out = flash_attn_varlen_func(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max_q,
            max_k,
            float(dropout),
            softmax_scale=scaling,
            causal=causal,
            window_size=window,
            softcap=softcap,
            sinks=sinks,
        )
    return out.unsqueeze(0)
