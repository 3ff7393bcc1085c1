"""The public attention function: one C call per attention call on a lean path; messages are built
only when something is wrong.

The hot path checks only what the C core cannot see (Python types, devices, torch's lazy negation,
autograd and tracing), allocates the outputs and hands the tensors themselves to `_C.forward`, which
reads their storage and runs the cached plan (csrc/fa_plan_cache.c). When the core refuses a call,
`check_call` runs to name the problem in Python's terms before the core's message is passed on.
A call's options are checked once into one AttentionOptions value (attention_options), which
travels down to the core (attend_with). Calls that need autograd or are traced go through
flashattn_mps._autograd."""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import _C
from ._autograd import _is_traced
from ._autograd import attention_through_torch as _attention_through_torch
from ._core import (  # noqa: F401
    _rng_words,
    backward_core,
    describe,
    dropout_rng_state,
    explained,
    forward_core,
    plan_backward,
    plan_forward,
    probs_core,
    quantized_slots,
)
from ._options import (
    _DEVICE_CODES,
    _KERNELS,
    AttentionOptions,
    band_of,
    check_alibi,
    check_call,
    check_causal_and_scale,
    check_dropout,
    check_gpu,
    check_kernel,
    check_mask,
    check_sinks,
    check_softcap,
    core_options,  # noqa: F401 (re-exported)
    given,
    quant_fields,
    scale_value,
    supported_mask_dtype,  # noqa: F401 (re-exported)
)
from ._quantized import QuantizedKV, check_quantized_call
from ._quantized import batched as quantized_batched
from ._quantized import operand as quantized_operand


def _sinks_need_grad(sinks) -> bool:
    """Sinks that want a gradient take the autograd path even when q, k and v do not."""
    return isinstance(sinks, torch.Tensor) and sinks.requires_grad and _is_grad_enabled()


# Bound once: the hot path pays no attribute lookups for them (dynamo knows them by identity).
_is_compiling = torch.compiler.is_compiling
_is_grad_enabled = torch.is_grad_enabled
_is_jit_tracing = torch.jit.is_tracing
_dispatch_modes = torch._C._len_torch_dispatch_stack


def _routes_through_torch(q, k, v) -> bool:
    """Autograd (some input requires grad) and tracing (torch.compile, export, make_fx, fake
    tensors: any torch dispatch mode; torch.jit.trace, which records only dispatched ops) leave the
    direct path: see attend."""
    if _is_compiling() or _is_jit_tracing():
        return True
    return (_is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)) or _dispatch_modes() > 0


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal=False,
    scale: Optional[float] = None,
    *,
    attn_mask: Optional[torch.Tensor] = None,
    kernel: str = "auto",
    return_lse: bool = False,
    window_size=None,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    window_align: Optional[str] = None,
):
    """Scaled dot-product attention, exactly as
    `torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
    enable_gqa=True)`, without materialising the L x S score matrix.

    Args:
        q: (B, Hq, L, E) or (Hq, L, E); any strides and storage offset (nothing is copied).
        k: (B, Hkv, S, E) or (Hkv, S, E); Hq must be a multiple of Hkv (GQA/MQA): query head h
            attends with key/value head h // (Hq // Hkv).
        v: (B, Hkv, S, Ev) or (Hkv, S, Ev); Ev may differ from E. E, Ev <= 576.
        causal: True: SDPA's top-left mask tril(ones(L, S)), query i sees keys 0..i;
            "bottom_right": flash-attn's, query i sees keys 0..i + S - L (rows that see none give
            zeros). The diagonal d_i (i, or i + S - L) also anchors window_size.
        scale: multiplies q.k; default 1/sqrt(E).
        attn_mask: None, or a mask broadcastable to (B, Hq, L, S) ((Hq, L, S) for 3-D inputs): bool
            (True takes part) or float32 / q's dtype added to the scaled scores, as SDPA's. Read
            through its strides inside the kernels, never expanded in memory; a row with no visible
            key gives zeros (and zero gradients). Not combinable with causal=True (SDPA refuses it too).
        kernel: "auto" (the planner's choice: "decode" for L <= 8, else "tensor" where it applies on
            an Apple10 GPU with Metal 4 tensor support, else "forward"), "forward" (the
            FlashAttention-2 prefill kernel), "tensor" (the prefill on Metal 4 tensor operations:
            fp16/bf16, E and Ev <= 128, no dropout; an error names what it does not take), "decode"
            (the vector kernel for few query rows, keys split over threadgroups when long) or
            "simple" (the one-row-per-SIMD-group reference kernel), for tests and benchmarks.
        return_lse: also return the float32 log-sum-exp of each row's scaled scores,
            (B, Hq, L) or (Hq, L): log(sum_j exp(scale * q_i . k_j)), -inf for a row with no key.
        window_size: None, or (left, right): query i sees only keys d_i - left .. d_i + right (-1:
            unbounded on that side; with causal the right side is 0), as flash-attn's sliding
            window; combinable with attn_mask. Key tiles wholly outside are never visited, so the
            cost grows with the window, not with S.
        window_align: None (the window follows causal's diagonal: top-left, or bottom-right with
            causal="bottom_right"), or with causal=False "top_left" or "bottom_right": which
            diagonal d_i the window (and ALiBi) is anchored on without a causal mask, e.g.
            bottom-right for a bidirectional window over a KV cache (flash_attn_func's
            causal=False windows are bottom-right).
        softcap: 0.0, or a positive number: each scaled score s becomes softcap * tanh(s / softcap)
            before masks (Gemma 2's logit softcapping); the backward differentiates through tanh.
        alibi_slopes: None, or float32 (Hq,) or (B, Hq) slopes on q's device: adds
            -slope * |d_i - j| to the score of query i and key j (ALiBi; d_i the diagonal as for
            window_size), after softcap. The slopes get no gradient (as in flash-attn).
        dropout_p: 0.0, or the probability in (0, 1] of dropping each attention probability, as
            SDPA's dropout_p (applied whenever it is > 0; modules pass 0 in eval): kept probabilities
            are scaled by 1 / (1 - dropout_p), the log-sum-exp is that of the undropped ones. The
            kernels drop with a counter-based generator (Philox 4x32-10) seeded per call from
            torch's default generator of q's device (`torch.manual_seed` makes calls reproducible),
            and the backward regenerates the same mask instead of storing it.
        sinks: None, or (Hq,) attention-sink logits (GPT-OSS, StreamingLLM), float32 or q's dtype
            (converted to float32), on q's device: row i of head h also counts exp(sinks[h]) in its
            softmax denominator, with no value, so its weights sum to less than 1. Combinable with
            every other option. A row that sees no key gives zeros; the log-sum-exp includes the
            sink (sinks[h] for such a row). Gradients flow to sinks too.

    q, k, v must share a dtype (float32, float16, bfloat16) and a device: "mps" runs Metal, "cpu"
    runs the same kernels on the CPU Metal device. Softmax statistics and accumulation are float32.
    Returns a new contiguous (B, Hq, L, Ev) (or (Hq, L, Ev)) tensor of q's dtype, and the
    log-sum-exp when return_lse is set. A lazily negated input (torch's negative bit, as in
    `z.conj().imag`) is resolved first, as torch's own kernels do: that copy is the only one.

    Differentiable with respect to q, k and v through a fused backward that never forms L x S either:
    eagerly through a torch.autograd.Function, and under torch.compile, export or tracing through
    the torch.library ops of flashattn_mps._autograd; the log-sum-exp carries no gradient and
    double backward raises.
    """
    if type(k) is QuantizedKV or type(v) is QuantizedKV:
        return _attend_quantized(
            q,
            k,
            v,
            attn_mask,
            causal,
            scale,
            kernel,
            return_lse,
            window_size,
            softcap,
            alibi_slopes,
            dropout_p,
            sinks,
            window_align,
        )
    if (
        type(kernel) is str
        and kernel == "auto"
        and return_lse is False
        and window_size is None
        and (causal is True or causal is False)
        and softcap == 0.0
        and alibi_slopes is None
        and dropout_p == 0.0
        and sinks is None
        and window_align is None
    ):
        return attend(q, k, v, attn_mask, causal, scale)
    causal, band = band_of(causal, window_size, window_align)
    return attend(
        q,
        k,
        v,
        attn_mask,
        causal,
        scale,
        check_kernel(kernel, return_lse),
        return_lse,
        band,
        False,
        check_softcap(softcap, "flash_attention"),
        alibi_slopes,
        check_dropout(dropout_p, "flash_attention"),
        None,
        sinks,
    )


def _attend_quantized(
    q,
    k,
    v,
    attn_mask,
    causal,
    scale,
    kernel,
    return_lse,
    window_size,
    softcap,
    alibi_slopes,
    dropout_p,
    sinks,
    window_align,
):
    """flash_attention with K, V or both a QuantizedKV: the forward kernels read them in place
    (metal/fa_quant.h); no gradient flows (check_quantized_call says so)."""
    kv_quant = check_quantized_call(q, k, v, "flash_attention", lambda: _sinks_need_grad(sinks))
    k, v = quantized_operand(k), quantized_operand(v)
    causal, band = band_of(causal, window_size, window_align)
    code = check_kernel(kernel, return_lse)
    softcap = check_softcap(softcap, "flash_attention")
    dropout_p = check_dropout(dropout_p, "flash_attention")
    options = attention_options(q, k, v, attn_mask, causal, scale, code, band, softcap, alibi_slopes, dropout_p, sinks)
    options = options._replace(kv_quant=kv_quant)
    rng_state = dropout_rng_state(q.device) if dropout_p > 0.0 else None
    mask = None if attn_mask is None else check_mask(attn_mask, q, k)
    out, lse = forward_core(q, k, v, mask, options, return_lse, False, rng_state)
    return (out, lse) if return_lse else out


def attend(
    q,
    k,
    v,
    attn_mask=None,
    causal=False,
    scale=None,
    kernel: int = _C.KERNEL_AUTO,
    return_lse=False,
    band=None,
    seq_major=False,
    softcap=0.0,
    alibi_slopes=None,
    dropout_p=0.0,
    rng_state=None,
    sinks=None,
):
    """flash_attention with its options already checked (kernel a _C.KERNEL_* code, return_lse a
    bool, band None or (bottom_right, left, right) ints as band_of gives): the lean entry the SDPA
    drop-in calls; attention_options then attend_with. seq_major: q is a (B, L, H, E) tensor viewed
    as (B, H, L, E), and out is allocated the same way (flash_attn_func's layout); the flash-attn
    API it serves has its log-sum-exp convention too (_flash_attn_lse). softcap: a checked float;
    alibi_slopes: None or the user's (H,) or (B, H) tensor, sinks None or the user's (H,) one
    (both checked by attention_options); dropout_p: a checked float, with rng_state the call's
    generator state (drawn when None and dropout_p > 0)."""
    options = attention_options(
        q, k, v, attn_mask, causal, scale, kernel, band, softcap, alibi_slopes, dropout_p, sinks
    )
    return attend_with(q, k, v, attn_mask, options, return_lse, seq_major, rng_state)


def attention_options(
    q,
    k,
    v,
    attn_mask,
    causal,
    scale,
    kernel: int = _C.KERNEL_AUTO,
    band=None,
    softcap=0.0,
    alibi_slopes=None,
    dropout_p=0.0,
    sinks=None,
) -> AttentionOptions:
    """The AttentionOptions of a dense call whose kernel, band, softcap and dropout_p are checked:
    causal and scale are checked here (cheaply when they are a bool and a float or None) and the
    scale resolved, the user's ALiBi slopes and sinks checked against q (the (B, Hq) view, float32
    sinks)."""
    if (causal is not True and causal is not False) or not (scale is None or type(scale) is float):
        scale = check_causal_and_scale(causal, scale)
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        check_call(q, k, v, causal, scale, attn_mask)
    if attn_mask is not None and causal:
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")
    # (a q without dims is refused by forward_core's checks). While traced the default stays None
    # for the ops to resolve on the real q: 1/sqrt(E) of a symbolic E would be a float guard on E,
    # one torch 2.4 cannot evaluate (it would recompile on every call under dynamic shapes).
    if scale is None and not _is_traced():
        scale = scale_value(q.shape[-1] if q.dim() else 0, None)
    alibi = None if alibi_slopes is None else check_alibi(alibi_slopes, q)
    return AttentionOptions(
        scale, causal, band, softcap, alibi, None if sinks is None else check_sinks(sinks, q), dropout_p, kernel
    )


def attend_with(q, k, v, attn_mask, options: AttentionOptions, return_lse=False, seq_major=False, rng_state=None):
    """attend over attention_options' value: the direct path (forward_core) for eager calls without
    gradients, else attention_through_torch."""
    if options.dropout_p > 0.0 and rng_state is None:
        rng_state = dropout_rng_state(q.device)  # outside the ops, so their fake implementations need none
    sinks = options.sinks
    if _routes_through_torch(q, k, v) or (sinks is not None and _sinks_need_grad(sinks)):
        if options.kernel != _C.KERNEL_AUTO:
            names = {code: name for name, code in _KERNELS.items()}
            raise ValueError(
                f"flash_attention: kernel={names.get(options.kernel, options.kernel)!r} selects a forward kernel for "
                "tests and benchmarks of the forward; differentiable or compiled calls take kernel='auto'"
            )
        result = _attention_through_torch(q, k, v, attn_mask, options, return_lse, seq_major, rng_state)
        return (result[0], _flash_attn_lse(result[1])) if return_lse and seq_major else result
    mask = None if attn_mask is None else check_mask(attn_mask, q, k)
    out, lse = forward_core(q, k, v, mask, options, return_lse, seq_major, rng_state)
    if not return_lse:
        return out
    return out, (_flash_attn_lse(lse) if seq_major else lse)


def _flash_attn_lse(lse: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp as flash-attn's API returns it: +inf for a row whose softmax sum is 0 (no
    visible key) or NaN, where the kernels (and SDPA's convention, kept by flash_attention and by
    the backward, which reads the kernels' own lse) have -inf and NaN. flash-attn's forward kernels
    write INFINITY there (csrc/flash_attn/src/softmax.h, normalize_softmax_lse)."""
    return lse.masked_fill(lse.isnan() | (lse == -math.inf), math.inf)


def explain_plan(
    q,
    k,
    v,
    causal=False,
    scale: Optional[float] = None,
    *,
    attn_mask=None,
    kernel: str = "auto",
    window_size=None,
    softcap: float = 0.0,
    alibi_slopes=None,
    dropout_p: float = 0.0,
    sinks=None,
    window_align=None,
    backward: bool = False,
    gpu: Optional[str] = None,
) -> dict:
    """What `flash_attention(q, k, v, causal, scale, kernel=kernel, window_size=window_size, ...)`
    would launch, without running it:
    {"dispatches": [{"source", "function", "macros", "constants", "grid", "threadgroup", "cost"}, ...],
    "split_count", "workspace_bytes", "empty"} (and "metal_stream" for MPS tensors: how dispatches
    reach the GPU). split_count > 1 means the keys are split over threadgroups and a second dispatch
    merges the partial results. "constants" are the function constants by index. "cost" turns a
    timing into utilisation and bandwidth: "threadgroup_bytes" per threadgroup, "registers" (32-bit,
    per thread) the configuration budgets, "flops" the kernel issues (padding included), "tiles"
    (the key tiles the forward kernel's threadgroups visit; the scores the simple and decode
    kernels compute: under causal or a window only those the band reaches) and
    "useful_flops" (2 (E + Ev) per visible query-key pair), and "min_bytes_read" /
    "min_bytes_written" (each input element once, the outputs); an attn_mask's hidden keys count as
    visible (csrc/fa_plan_forward.c says how each figure is counted).

    backward=True: the plan of the gradients' pass instead, {"dispatches": [delta, dkdv, dq]}: the
    pre-pass D = rowsum(dO * O), dK/dV over key blocks ("tiles": the query tiles its threadgroups
    visit, over every query head of a GQA group) and dQ over query blocks ("tiles": the key tiles,
    as the forward's), with the same cost figures (csrc/fa_plan_backward.c counts them).

    Calls of flash_attn_varlen_func and flash_attn_with_kvcache are explained by
    explain_varlen_plan and explain_kvcache_plan, which take those functions' arguments. With K or
    V a QuantizedKV, "min_bytes_read" counts its bytes, scales and biases (forward only).

    gpu: the GPU family to plan for, "apple7" (M1), "apple8" (M2), "apple9" (M3, M4) or "apple10"
    (M5); None: the one FLASHATTN_MPS_GPU_FAMILY names, else the device's (MPS: the Metal
    device's; the CPU device: apple9). "gpu_family" names it, and each dispatch's "estimate" says
    what it means there: "registers" per thread in all (the fragments of "cost" plus an overhead
    estimate), its "threadgroup_bytes", the "resident_threadgroups" and "resident_simd_groups" per
    core, the "occupancy" and the estimated "fraction_of_peak", with the "assumptions" named
    (csrc/fa_gpu_family.c; docs/performance.md)."""
    causal, band = band_of(causal, window_size, window_align)
    kv_quant = None
    if type(k) is QuantizedKV or type(v) is QuantizedKV:
        kv_quant = check_quantized_call(q, k, v, "explain_plan")
        if backward is True:
            raise ValueError("explain_plan: no gradient flows through quantized K/V, so there is no backward to plan")
    else:
        check_call(q, k, v, causal, scale, attn_mask)
    code = check_kernel(kernel, False)
    mask = None if attn_mask is None else check_mask(attn_mask, q, k)
    if q.dim() == 3:  # views, not copies
        q, k, v = q.unsqueeze(0), quantized_batched(k), quantized_batched(v)
        mask = None if mask is None else mask.unsqueeze(0)
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    if kv_quant is not None:
        kv_quant = tuple(t if isinstance(t, QuantizedKV) else None for t in (k, v))
        k, v = quantized_operand(k), quantized_operand(v)
    device, scale = _DEVICE_CODES[q.device.type], scale_value(q.shape[-1], scale)
    tensors = {
        "q": q,
        "k": k,
        "v": v,
        "out": out,
        "mask": mask,
        "alibi_slopes": None if alibi_slopes is None else check_alibi(alibi_slopes, q),
        "rng_state": _rng_words(torch.zeros(4, dtype=torch.int32, device=q.device)),
        "sinks": None if sinks is None else check_sinks(sinks, q),
    }
    family = check_gpu(gpu, "explain_plan")
    options = core_options(
        scale,
        causal,
        band,
        check_softcap(softcap, "explain_plan"),
        check_dropout(dropout_p, "explain_plan"),
        code,
        quant=quant_fields(kv_quant),
        gpu_family=family,
    )
    family_name = _C.gpu_family_name(device, family)
    if kv_quant is not None:
        quantized_slots(tensors, kv_quant)
    if backward is True:  # planning reads no element: the tensors only carry shapes and strides
        rows = q.new_empty(q.shape[:-1], dtype=torch.float32)
        tensors.update(
            lse=rows,
            dout=out,
            delta=rows.clone(),
            dq=torch.empty_like(q),
            dk=torch.empty_like(k),
            dv=torch.empty_like(v),
            sink_grad=None if sinks is None else rows,
        )
        return {"dispatches": plan_backward(device, tensors, options), "gpu_family": family_name}
    if backward is not False:
        raise TypeError(f"explain_plan: backward must be a bool, got {given(backward)}")
    return {**explained(plan_forward(device, tensors, options), q.device), "gpu_family": family_name}
