"""The one module that calls the C core's attention entry points, and the tensor-level runs over it.

The binding's contract: `forward(device, tensors, options, workspace)`,
`forward_workspace_bytes(device, tensors, options)`, `plan_forward(device, tensors, options)`,
`backward(device, tensors, options, workspace)` and `plan_backward(device, tensors, options)`, where
`tensors` maps slot names (q, k, v, out, lse, mask, alibi_slopes, rng_state, sinks, sequences,
sequence_scratch, block_table, k_scales, k_biases, v_scales, v_biases; for the backward also dout,
delta, dq, dk, dv, sink_grad) to tensors or None, and `options` is the tuple
`AttentionOptions.core` (or `_options.core_options`) builds (scale, causal, bottom_right,
window_left, window_right, softcap, dropout_p, kernel, num_splits, write_probs, max_q_len,
max_kv_len, unbatched, diagonal_offset, k_bits, k_group_size, v_bits, v_group_size, gpu_family). Above them:
forward_core, backward_core and probs_core allocate the outputs of an attention call whose options, one checked AttentionOptions
value, they turn into that tuple, and run it; every entry point ends in one of them."""

from __future__ import annotations

import math

import torch

from . import _C, _metal_mode, _sources
from ._options import _DESCRIPTOR_DTYPES, _DTYPE_CODES, AttentionOptions, check_call

_CONTIGUOUS = torch.contiguous_format
_SCALE_FIELD = _C.OPTION_FIELDS.index("scale")
_UNQUANTIZED = (0, 0, 0, 0)  # the options' k_bits, k_group_size, v_bits, v_group_size (_options.quant_fields)


# The binding's attention calls (looked up on _C at each call, so tests can count them).
def forward(device: int, tensors: dict, options: tuple, workspace=None) -> None:
    _C.forward(device, tensors, options, workspace)


def forward_workspace_bytes(device: int, tensors: dict, options: tuple) -> int:
    return _C.forward_workspace_bytes(device, tensors, options)


def plan_forward(device: int, tensors: dict, options: tuple) -> dict:
    """The plan of what the forward of these tensors launches: none for a call that needs no kernel,
    the stand-ins' kernels for an empty head dim (as forward_core and run_forward run them)."""
    q, k, v, out = tensors["q"], tensors["k"], tensors["v"], tensors["out"]
    if _needs_no_kernel(k, out, tensors.get("lse")):
        return _plan_without_kernel()
    if q.shape[-1] == 0 or v.shape[-1] == 0:
        q, k, v, out, scale = _stand_ins(q, k, v, out, options[_SCALE_FIELD])
        tensors = {**tensors, "q": q, "k": k, "v": v, "out": out}
        options = (*options[:_SCALE_FIELD], scale, *options[_SCALE_FIELD + 1 :])
    return _C.plan_forward(device, tensors, options)


def backward(device: int, tensors: dict, options: tuple, workspace=None) -> None:
    _C.backward(device, tensors, options, workspace)


def plan_backward(device: int, tensors: dict, options: tuple) -> list:
    """The plan of the gradients' pass of these tensors, as backward_core runs it: none when nothing
    flows back (an empty out, or no keys), the stand-ins' kernels for E = 0."""
    q, k = tensors["q"], tensors["k"]
    if tensors["dout"].numel() == 0 or k.shape[:-1].numel() == 0:
        return []
    if q.shape[-1] == 0:
        q, k, _, _, scale = _stand_ins(q, k, tensors["v"], tensors["out"], 0.0)
        tensors = {**tensors, "q": q, "k": k, "dq": torch.empty_like(q), "dk": torch.empty_like(k)}
        options = (*options[:_SCALE_FIELD], scale, *options[_SCALE_FIELD + 1 :])
    return _C.plan_backward(device, tensors, options)


def _prepare_mps() -> None:
    """Before a Metal call: the stream mode is chosen on first use (flashattn_mps._metal_mode)."""
    _metal_mode.prepare()


def device_code(t: torch.Tensor) -> int:
    """The core's device of a call on t's device, made ready (Metal's stream mode, the kernels' sources)."""
    if t.is_cpu:
        device = _C.DEVICE_CPU
    else:
        device = _C.DEVICE_MPS
        _prepare_mps()
    if not _sources.registered:
        _sources.ensure_registered()
    return device


def _cpu_workspace(nbytes: int) -> torch.Tensor:
    return torch.empty((nbytes + 3) // 4, dtype=torch.float32)


def _mps_workspace(nbytes: int) -> torch.Tensor:
    return torch.empty((nbytes + 3) // 4, dtype=torch.float32, device="mps")


# The core asks for scratch memory (split-K partial results, an additive mask's block classes) only
# when a plan needs it: it allocates nothing itself.
_WORKSPACES = {_C.DEVICE_CPU: _cpu_workspace, _C.DEVICE_MPS: _mps_workspace}


def describe(t: torch.Tensor) -> tuple:
    """The C core's view of a tensor: (storage, storage bytes, byte offset, dtype, sizes, strides).

    The storage handle is the host address for CPU tensors and the id<MTLBuffer> for MPS tensors
    (PyTorch's MPS allocator hands out the buffer object as the storage's data pointer). `_C`
    reads a torch.Tensor argument the same way itself; descriptors are for calling it by hand."""
    storage = t.untyped_storage()
    return (
        storage.data_ptr(),
        storage.nbytes(),
        t.storage_offset() * t.element_size(),
        _DESCRIPTOR_DTYPES[t.dtype],
        tuple(t.shape),
        tuple(t.stride()),
    )


def dropout_rng_state(device: torch.device) -> torch.Tensor:
    """Dropout's generator state for one call: four random int32 words (Philox seed and counter
    offset, metal/fa_dropout.h) drawn from torch's default generator of `device` (the MPS one on
    "mps", the CPU one on "cpu"), so torch.manual_seed makes calls reproducible and consecutive calls
    drop differently. Drawn on the device, so no host synchronisation is needed to use them; the
    backward takes the same tensor and regenerates the forward's mask."""
    return torch.randint(-(2**31), 2**31, (4,), dtype=torch.int32, device=device)


def planning_rng_state(device) -> torch.Tensor:
    """Generator words for planning a dropout call: zeros, so that explaining draws nothing from
    torch's generator (the words change no plan)."""
    return torch.zeros(4, dtype=torch.int32, device=device)


def _rng_words(rng_state):
    """The core's view of a generator state: the int32 words as a float32 descriptor (bits unchanged)."""
    return None if rng_state is None else rng_state.view(torch.float32)


def sequence_args(table: torch.Tensor, max_q_len: int, max_kv_len: int, block_table=None) -> tuple:
    """A call's sequences: the (B, 6) int32 table (metal/fa_sequence.h), scratch for the
    per-sequence kernel arguments, the grid's lengths, and the (B, pages) block table of a paged
    cache or None."""
    words = (table.shape[0] * _C.SEQUENCE_PARAMS_BYTES + 3) // 4
    scratch = torch.empty(max(words, 1), dtype=torch.float32, device=table.device)
    return table, scratch, max_q_len, max_kv_len, block_table


def _sequence_slots(tensors: dict, sequences) -> tuple:
    """Puts sequence_args' tensors into the slots; returns the grid's (max_q_len, max_kv_len)."""
    if sequences is None:
        return 0, 0
    tensors["sequences"], tensors["sequence_scratch"], max_q, max_kv, tensors["block_table"] = sequences
    return max_q, max_kv


def _needs_no_kernel(k: torch.Tensor, out: torch.Tensor, lse) -> bool:
    """Whether a forward's result is known without a kernel: no output element (B, H or L of 0, or
    Ev = 0 without a log-sum-exp) or no key (S = 0, or a key tensor without rows). The core takes no
    empty tensor: it would have no storage to bind."""
    return k.shape[:-1].numel() == 0 or (out.numel() == 0 and (lse is None or lse.numel() == 0))


def _fill_without_kernel(out: torch.Tensor, lse, sinks) -> None:
    """_needs_no_kernel's result, as SDPA's: rows without keys give zeros (NaNs in q too: there is
    no score to carry them), their log-sum-exp -inf, or with sinks their head's sink logit."""
    out.zero_()
    if lse is None:
        return
    if sinks is None:
        lse.fill_(-math.inf)
    else:
        lse.copy_(sinks.view(-1, 1).expand_as(lse))


def _stand_ins(q, k, v, out, scale) -> tuple:
    """(q, k, v, out, scale) for the kernels when E or Ev is 0 but something is left to compute
    (E = 0: the softmax of zero scores averages v; Ev = 0: the log-sum-exp): zero-filled tensors one
    element wide, which the core can bind. With E = 0 every score is 0 whatever the scale (SDPA
    averages v even with its default 1/sqrt(0)), so the stand-ins' scale is 0; out's stand-in is
    scratch."""
    if q.shape[-1] == 0:
        q, k, scale = q.new_zeros((*q.shape[:-1], 1)), k.new_zeros((*k.shape[:-1], 1)), 0.0
    if v.shape[-1] == 0:
        v, out = v.new_zeros((*v.shape[:-1], 1)), out.new_empty((*out.shape[:-1], 1))
    return q, k, v, out, scale


def _stand_in_call(q, k, v, out, options: AttentionOptions) -> tuple:
    """_stand_ins over a call's options: (q, k, v, out, options), unchanged without an empty head dim."""
    if q.shape[-1] != 0 and v.shape[-1] != 0:
        return q, k, v, out, options
    q, k, v, out, scale = _stand_ins(q, k, v, out, options.scale)
    return q, k, v, out, options._replace(scale=scale)


def _zero_gradient(t: torch.Tensor, sequences) -> torch.Tensor:
    """A zero gradient of t laid out as backward_core's (t's strides with sequences, as the fakes say)."""
    return torch.zeros_like(t) if sequences is not None else t.new_zeros(t.shape)


def _plan_without_kernel() -> dict:
    """What the planner says of a call that launches nothing (_needs_no_kernel)."""
    return {"dispatches": [], "empty": True, "split_count": 0, "workspace_bytes": 0}


def quantized_slots(tensors: dict, kv_quant) -> None:
    """Puts quantized K and V (AttentionOptions.kv_quant: QuantizedKV or None each) into the slots:
    their data in k and v, their scales and biases in their own."""
    for name, quantized in zip(("k", "v"), kv_quant):
        if quantized is not None:
            tensors[name] = quantized.data
            tensors[f"{name}_scales"] = quantized.scales
            tensors[f"{name}_biases"] = quantized.biases


def _run_slots(q, k, v, out, lse, options: AttentionOptions, sequences, rng_state) -> tuple:
    """run_forward's and plan_run's tensors by slot name, and the grid's (max_q_len, max_kv_len)."""
    tensors = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "alibi_slopes": options.alibi}
    tensors.update(rng_state=_rng_words(rng_state), sinks=options.sinks)
    if options.kv_quant is not None:
        quantized_slots(tensors, options.kv_quant)
    return (tensors, *_sequence_slots(tensors, sequences))


def run_forward(q, k, v, out, lse, options: AttentionOptions, sequences, rng_state=None) -> None:
    """Runs the forward into out (and lse) over (B, H, L, D) views on one device, the options
    checked (an AttentionOptions); sequences: sequence_args' tuple or None."""
    if _needs_no_kernel(k, out, lse):
        _fill_without_kernel(out, lse, options.sinks)
        return
    q, k, v, out, options = _stand_in_call(q, k, v, out, options)
    device = device_code(q)
    tensors, max_q, max_kv = _run_slots(q, k, v, out, lse, options, sequences, rng_state)
    forward(device, tensors, options.core(False, max_q, max_kv), _WORKSPACES[device])


def plan_run(q, k, v, out, lse, options: AttentionOptions, sequences, rng_state=None) -> dict:
    """What run_forward with these arguments would launch, as explain_plan shows it, without
    running (the planner reads shapes, strides and options, never an element)."""
    tensors, max_q, max_kv = _run_slots(q, k, v, out, lse, options, sequences, rng_state)
    return explained(
        plan_forward(_C.DEVICE_CPU if q.is_cpu else _C.DEVICE_MPS, tensors, options.core(False, max_q, max_kv)),
        q.device,
    )


def forward_core(
    q, k, v, mask, options: AttentionOptions, with_lse: bool, seq_major=False, rng_state=None, sequences=None
):
    """Runs the forward on tensors whose options are checked (options: the call's AttentionOptions,
    with the (B, Hq) ALiBi view and float32 sinks) and whose mask (or None) is the (B, Hq, L, S)
    view: returns out and lse (None unless with_lse). Every path ends here. rng_state: dropout's
    generator words. sequences: sequence_args' tuple of a packed or cached call over (B, H, L, D)
    views, or None. seq_major: out is allocated (B, L, H, Ev) in memory, seen as (B, H, L, Ev)."""
    scale, causal, band, softcap, alibi, sinks, dropout_p, kernel, num_splits, kv_quant = options
    if q.is_cpu:  # _C checks that every tensor is on this device
        device = _C.DEVICE_CPU
    elif q.is_mps:
        device = _C.DEVICE_MPS
        _prepare_mps()
    else:
        check_call(q, k, v, causal, scale, mask)
        raise ValueError(f"flash_attention: q is on device '{q.device}'")  # check_call raises first
    dims = q.dim()
    if kv_quant is None and not (
        q.dtype in _DTYPE_CODES and (dims == 4 or dims == 3) and k.dim() == dims and v.dim() == dims
    ):
        check_call(q, k, v, causal, scale, mask)
    if q.is_neg() or k.is_neg() or v.is_neg():
        q, k, v = q.resolve_neg(), k.resolve_neg(), v.resolve_neg()
    shape = q.shape
    rows = (shape[0], shape[1], shape[2]) if dims == 4 else (shape[0], shape[1])
    value_dim = v.shape[-1] if kv_quant is None or kv_quant[1] is None else kv_quant[1].shape[-1]
    if seq_major:  # (B, L, H, Ev) in memory, seen as (B, H, L, Ev)
        out = q.new_empty((shape[0], shape[2], shape[1], value_dim)).transpose(1, 2)
    elif value_dim == shape[-1]:
        out = torch.empty_like(q, memory_format=_CONTIGUOUS)
    else:
        out = q.new_empty((*rows, value_dim))
    lse = q.new_empty(rows, dtype=torch.float32) if with_lse else None
    if _needs_no_kernel(k, out, lse):
        _fill_without_kernel(out, lse, sinks)
        return out, lse
    result = out
    q, k, v, out, options = _stand_in_call(q, k, v, out, options)
    scale = options.scale
    if not _sources.registered:
        _sources.ensure_registered()
    tensors = {
        "q": q,
        "k": k,
        "v": v,
        "out": out,
        "lse": lse,
        "mask": mask,
        "alibi_slopes": alibi,
        "rng_state": None if rng_state is None else _rng_words(rng_state),
        "sinks": sinks,
    }
    max_q = max_kv = 0
    if sequences is not None:
        max_q, max_kv = _sequence_slots(tensors, sequences)
    if kv_quant is not None:
        quantized_slots(tensors, kv_quant)
    if band is None and kv_quant is None:  # (AttentionOptions.core, inline: this is every plain call's path)
        core = (
            scale,
            causal,
            False,
            -1,
            -1,
            softcap,
            dropout_p,
            kernel,
            num_splits,
            False,
            max_q,
            max_kv,
            dims == 3,
            0,
        )
        core += _UNQUANTIZED + (0,)
    else:
        core = options.core(False, max_q, max_kv, dims == 3)
    try:
        forward(device, tensors, core, _WORKSPACES[device])
    except (TypeError, ValueError):
        if kv_quant is None:
            check_call(q, k, v, causal, scale, mask)  # names the problem in Python's terms if it can
        raise
    return result, lse


def backward_core(dout, q, k, v, out, lse, mask, options: AttentionOptions, rng_state=None, sequences=None):
    """dq, dk, dv of forward_core's call (mask as the (B, Hq, L, S) view or None; options and
    rng_state the forward's, so the same probabilities are dropped), and after them dsinks, the
    (Hq,) float32 gradient of the sinks, when options.sinks (float32 (Hq,)) is given. With
    sequences, the rows of q, k and v no sequence holds get zero gradients and no share of dsinks."""
    sinks = options.sinks
    if dout.numel() == 0 or k.shape[:-1].numel() == 0:  # an empty out, or no keys: nothing flows back
        grads = tuple(_zero_gradient(t, sequences) for t in (q, k, v))
        return grads if sinks is None else (*grads, sinks.new_zeros(sinks.shape))
    if q.shape[-1] == 0:  # E = 0: dq and dk are empty; dv and dsinks are those of zero scores
        q0, k0, _, _, zero_scores = _stand_in_call(q, k, v, out, options)
        grads = backward_core(dout, q0, k0, v, out, lse, mask, zero_scores, rng_state, sequences)
        return (_zero_gradient(q, sequences), _zero_gradient(k, sequences), *grads[2:])
    device = device_code(q)  # _C checks every tensor's device
    if dout.is_neg():
        dout = dout.resolve_neg()
    if sequences is None:
        dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    else:  # the kernels write only the rows of some sequence
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = q.new_empty(q.shape[:-1], dtype=torch.float32)  # D = rowsum(dout * out): the core's scratch
    # Each row's term of the sinks' gradient (B, Hq, L), summed below over batch and rows, deterministically.
    sink_grad = None if sinks is None else q.new_empty(q.shape[:-1], dtype=torch.float32)
    tensors = {
        "q": q,
        "k": k,
        "v": v,
        "out": out,
        "lse": lse,
        "dout": dout,
        "delta": delta,
        "dq": dq,
        "dk": dk,
        "dv": dv,
        "mask": mask,
        "alibi_slopes": options.alibi,
        "rng_state": _rng_words(rng_state),
        "sinks": sinks,
        "sink_grad": sink_grad,
    }
    max_q, max_kv = _sequence_slots(tensors, sequences)
    backward(
        device,
        tensors,
        # The simdgroup and decode forwards share one backward; a forced tensor path stays forced.
        options._replace(
            kernel=_C.KERNEL_TENSOR if options.kernel == _C.KERNEL_TENSOR else _C.KERNEL_AUTO, num_splits=0
        ).core(max_q_len=max_q, max_kv_len=max_kv, unbatched=q.dim() == 3),
        _WORKSPACES[device],
    )
    if sinks is None:
        return dq, dk, dv
    if sequences is not None:  # rows past the last sequence hold no term
        table = sequences[0]
        end = (table[:, 1] + table[:, 2]).max(dim=0, keepdim=True)[0] if table.shape[0] else table.new_zeros(1)
        sink_grad = sink_grad.masked_fill(torch.arange(q.shape[-2], device=q.device) >= end, 0.0)
    return dq, dk, dv, sink_grad.sum(dim=-1).reshape(-1, sink_grad.shape[-2]).sum(dim=0)


def probs_arguments(q, k, v, out, mask, options: AttentionOptions, rng_state=None, sequences=None):
    """The probability pass's slots and options, as forward and plan_forward take them, and the
    shape of the probabilities it writes: (B, Hq, L, S), or with sequences (sequence_args) the
    grid's (sequences, Hq, max_seqlen_q, max_seqlen_k), each sequence in its top-left block. The
    pass takes each row's softmax again (sinks included), not the forward's lse, and runs the simple
    kernel whatever options.kernel."""
    if rng_state is None:  # no dropout: every probability is kept whatever the words
        rng_state = torch.zeros(4, dtype=torch.int32, device=q.device)
    q, k, v, out, options = _stand_in_call(q, k, v, out, options)
    shape = (
        (*q.shape[:-1], k.shape[-2])
        if sequences is None
        else (sequences[0].shape[0], q.shape[-3], sequences[2], sequences[3])
    )
    tensors = {
        "q": q,
        "k": k,
        "v": v,
        "out": out,
        "mask": mask,
        "alibi_slopes": options.alibi,
        "sinks": options.sinks,
        "rng_state": _rng_words(rng_state),
    }
    max_q, max_kv = _sequence_slots(tensors, sequences)
    core = options._replace(kernel=_C.KERNEL_SIMPLE, num_splits=0).core(True, max_q, max_kv, q.dim() == 3)
    return tensors, core, shape


def probs_pass_runs(lse: torch.Tensor) -> bool:
    """Whether there is a probability pass to run: with an empty lse (no query rows) there is no
    probability, and q has no storage for the core to read."""
    return lse.numel() > 0


def probs_core(q, k, v, out, lse, mask, options: AttentionOptions, rng_state=None, sequences=None) -> torch.Tensor:
    """The attention probabilities of forward_core's call that returned out and lse, as flash-attn's
    return_attn_probs shows them: (B, Hq, L, S) float32, exp(s_ij - lse_i) for every key row i sees,
    negated where dropout dropped it (0 elsewhere). The simple kernel's probability pass computes
    them from the same scores and generator as the attention kernels (csrc/fa_core.h, write_probs);
    an L x S array, for tests. sequences: a varlen call's, with its (1, Hq, total, D) views (the
    layout probs_arguments says)."""
    tensors, core, shape = probs_arguments(q, k, v, out, mask, options, rng_state, sequences)
    probs = torch.zeros(shape, dtype=torch.float32, device=q.device)
    if not probs_pass_runs(lse) or k.shape[:-1].numel() == 0:  # no rows, or no keys: every probability is 0
        return probs
    forward(device_code(q), tensors, core, probs.view(-1))
    return probs


def explained(plan: dict, device: torch.device) -> dict:
    """A plan as the explain functions return it: with "metal_stream" (how dispatches reach the GPU)
    for MPS tensors."""
    if device.type == "mps":
        plan["metal_stream"] = _metal_mode.describe()
    return plan
