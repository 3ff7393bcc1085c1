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
from transformers.cache_utils import Cache, CacheLayerMixin
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
from .._quantized import QuantizedKV, _check_bits_and_group, quantize_kv, quantize_rows
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
    if isinstance(key, QuantizedKVStates):  # a QuantizedKVCache's layer: read in place
        wants_causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        out = _attend_quantized_states(
            query, key, value, attention_mask, dropout, scaling, wants_causal, sliding_window, softcap, sinks
        )
        return out.transpose(1, 2).contiguous(), None
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


class QuantizedKVStates:
    """What a QuantizedKVCache layer hands the attention function for K (or V): the older rows as a
    QuantizedKV (None before the first flush) read in place by the kernels, then the recent rows
    (B, H, R, D) unquantized. shape, dtype and device are those of the whole (B, H, S, D)."""

    __slots__ = ("quantized", "recent")

    def __init__(self, quantized, recent: torch.Tensor):
        self.quantized, self.recent = quantized, recent

    @property
    def shape(self) -> torch.Size:
        older = 0 if self.quantized is None else self.quantized.shape[2]
        return torch.Size((*self.recent.shape[:2], older + self.recent.shape[2], self.recent.shape[3]))

    @property
    def dtype(self) -> torch.dtype:
        return self.recent.dtype

    @property
    def device(self) -> torch.device:
        return self.recent.device

    def dequantize(self) -> torch.Tensor:
        """The whole (B, H, S, D) tensor, for a model's own attention function."""
        if self.quantized is None:
            return self.recent
        return torch.cat([self.quantized.dequantize(), self.recent], dim=2)


class QuantizedKVLayer(CacheLayerMixin):
    """One layer of QuantizedKVCache: a quantized store of the older rows, grown in place (capacity
    doubling, so appending is amortised O(new rows)), and the recent rows unquantized. Each update
    returns the store as it was and the recent rows with the new ones; when the recent rows reach
    `residual_length` they are quantized into the store (transformers' QuantizedLayer's rule: a
    residual_length of 0 quantizes every step's rows after that step's attention)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, bits: int = 8, group_size: int = 64, residual_length: int = 0, dequantize: bool = False):
        super().__init__()
        self.bits, self.group_size, self.residual_length = bits, group_size, residual_length
        self.dequantize_states = dequantize
        self.store = None  # QuantizedKV pair (keys, values) of capacity rows, or None
        self.stored = 0  # rows of the store in use

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
        self.is_initialized = True

    def _stored_view(self):
        if self.stored == 0:
            return None, None
        return tuple(part.narrow(2, 0, self.stored) for part in self.store)

    def _flush(self) -> None:
        """Quantizes the recent rows into the store (growing it when full) and empties them."""
        rows = self.keys.shape[2]
        capacity = 0 if self.store is None else self.store[0].shape[2]
        if self.stored + rows > capacity:
            grown = max(2 * capacity, self.stored + rows, 64)
            fresh = []
            for states in (self.keys, self.values):
                shape = (*states.shape[:2], grown, states.shape[3])
                fresh.append(quantize_kv(states.new_zeros(shape), self.bits, self.group_size))
            for new, old in zip(fresh, self._stored_view()):
                if old is not None:
                    for part in ("data", "scales", "biases"):
                        getattr(new, part)[:, :, : self.stored] = getattr(old, part)
            self.store = tuple(fresh)
        for quantized, states in zip(self.store, (self.keys, self.values)):
            target = quantized.narrow(2, self.stored, rows)
            for part, values in zip(
                (target.data, target.scales, target.biases), quantize_rows(states, self.bits, self.group_size)
            ):
                part.copy_(values)
        self.stored += rows
        self.keys, self.values = self.keys[:, :, :0], self.values[:, :, :0]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        stored_keys, stored_values = self._stored_view()
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        keys, values = QuantizedKVStates(stored_keys, self.keys), QuantizedKVStates(stored_values, self.values)
        if self.keys.shape[2] >= max(self.residual_length, 1):
            self._flush()  # writes past the returned store's rows: what this step reads is unchanged
        if self.dequantize_states:
            return keys.dequantize(), values.dequantize()
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.stored + (self.keys.shape[2] if self.is_initialized else 0)

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.store, self.stored = None, 0
        self.keys = self.values = None
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if not self.is_initialized:
            return
        beam_idx = beam_idx.to(self.device)
        self.keys, self.values = self.keys.index_select(0, beam_idx), self.values.index_select(0, beam_idx)
        if self.store is not None:
            self.store = tuple(
                QuantizedKV(
                    q.data.index_select(0, beam_idx),
                    q.scales.index_select(0, beam_idx),
                    q.biases.index_select(0, beam_idx),
                    q.bits,
                    q.group_size,
                )
                for q in self.store
            )


class QuantizedKVCache(Cache):
    """A transformers cache whose keys and values are quantized in place (flashattn_mps.quantize_kv:
    `bits` 8 or 4, `group_size` 32, 64 or 128 dividing the head dim) and read by the kernels
    without being expanded: pass it to `generate(..., past_key_values=QuantizedKVCache(...))` of a
    model whose attention implementation is `register()`'s. The `residual_length` most recent rows
    stay unquantized (0: each step's own rows only, quantized after that step), as transformers'
    quantized caches keep them. dequantize=True hands the attention function the dequantized
    tensors instead (for comparison with any attention implementation). Full-attention layers;
    no torch.compile, no offloading."""

    def __init__(self, bits: int = 8, group_size: int = 64, residual_length: int = 0, dequantize: bool = False):
        _check_bits_and_group(bits, group_size, "QuantizedKVCache")
        if isinstance(residual_length, bool) or not isinstance(residual_length, int) or residual_length < 0:
            raise ValueError(f"QuantizedKVCache: residual_length must be an int >= 0, got {residual_length!r}")
        super().__init__(
            layer_class_to_replicate=functools.partial(QuantizedKVLayer, bits, group_size, residual_length, dequantize)
        )


def _attend_quantized_states(query, key, value, mask, dropout, scaling, wants_causal, sliding_window, softcap, sinks):
    """Attention over a QuantizedKVCache layer's states: the stored rows (quantized, read in place;
    older than every query, so all visible but for the mask) and the recent ones (unquantized,
    causal bottom-right when no mask is given), merged exactly through their log-sum-exps."""
    if (key.quantized is None) != (value.quantized is None):
        raise ValueError("QuantizedKVCache: keys and values must be stored alike")
    if dropout > 0.0:
        raise ValueError("QuantizedKVCache: attention dropout is not applied over quantized states (inference only)")
    if sliding_window is not None and key.shape[2] > sliding_window:
        raise NotImplementedError("QuantizedKVCache: sliding-window layers are not supported")
    older = 0 if key.quantized is None else key.quantized.shape[2]
    causal = "bottom_right" if wants_causal and mask is None and query.shape[2] > 1 else False
    if mask is not None and mask.dtype == torch.bool and mask.shape[-2] != query.shape[2]:
        mask = mask.expand(*mask.shape[:-2], query.shape[2], mask.shape[-1])
    options = dict(softcap=float(softcap or 0.0), return_lse=True)
    out, lse = flash_attention(
        query,
        key.recent,
        value.recent,
        causal,
        scaling,
        attn_mask=None if mask is None else mask[..., older:],
        sinks=sinks,
        **options,
    )
    if older == 0:
        return out
    out_old, lse_old = flash_attention(
        query,
        key.quantized,
        value.quantized,
        False,
        scaling,
        attn_mask=None if mask is None else mask[..., :older],
        **options,
    )
    top = torch.maximum(lse, lse_old).masked_fill(torch.isneginf(torch.maximum(lse, lse_old)), 0.0)
    weight, weight_old = (lse - top).exp(), (lse_old - top).exp()
    total = (weight + weight_old).clamp_min(torch.finfo(torch.float32).tiny)
    merged = (out.float() * weight[..., None] + out_old.float() * weight_old[..., None]) / total[..., None]
    return merged.to(query.dtype)
