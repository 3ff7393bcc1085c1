"""The attention calls of _C in their former positional form, mapped onto the contract's
(device, tensors, options[, workspace]). A bridge for the call sites until they build the tensors
dict and the options tuple themselves."""
from . import _C

_FORWARD = ("device", "q", "k", "v", "out", "lse", "scale", "causal", "kernel", "workspace", "mask", "unbatched",
            "band", "softcap", "alibi_slopes", "dropout_p", "rng_state", "write_probs", "sinks", "sequences",
            "num_splits")
_WORKSPACE_BYTES = ("device", "q", "k", "v", "out", "lse", "scale", "causal", "kernel", "mask", "band", "softcap",
                    "alibi_slopes", "sinks")
_PLAN_FORWARD = ("device", "q", "k", "v", "out", "lse", "scale", "causal", "kernel", "mask", "band", "softcap",
                 "alibi_slopes", "dropout_p", "rng_state", "sinks", "sequences", "num_splits", "write_probs")
_BACKWARD = ("device", "q", "k", "v", "out", "lse", "dout", "delta", "dq", "dk", "dv", "scale", "causal", "mask",
             "unbatched", "band", "softcap", "alibi_slopes", "dropout_p", "rng_state", "sinks", "sink_grad",
             "sequences")
_PLAN_BACKWARD = tuple(n for n in _BACKWARD if n != "unbatched")
_TENSORS = set(_C.FORWARD_SLOTS) | set(_C.BACKWARD_SLOTS)


def _split(names, args, kwargs):
    given = dict(zip(names, args))
    given.update(kwargs)
    device = given.pop("device")
    tensors = {name: given.pop(name) for name in list(given) if name in _TENSORS and name not in ("workspace", "sequences")}
    band = given.pop("band", None)
    bottom_right, left, right = (0, -1, -1) if band is None else band
    sequences = given.pop("sequences", None)
    max_q_len = max_kv_len = 0
    if sequences is not None:
        table, scratch, max_q_len, max_kv_len, block_table = sequences
        tensors.update(sequences=table, sequence_scratch=scratch, block_table=block_table)
    options = (given.pop("scale"), bool(given.pop("causal")), bool(bottom_right), left, right,
               given.pop("softcap", 0.0), given.pop("dropout_p", 0.0), given.pop("kernel", _C.KERNEL_AUTO),
               given.pop("num_splits", 0), bool(given.pop("write_probs", False)), max_q_len, max_kv_len,
               bool(given.pop("unbatched", False)))
    return device, tensors, options, given.pop("workspace", None)


def forward(*args, **kwargs):
    device, tensors, options, workspace = _split(_FORWARD, args, kwargs)
    return _C.forward(device, tensors, options, workspace)


def forward_workspace_bytes(*args, **kwargs):
    device, tensors, options, _ = _split(_WORKSPACE_BYTES, args, kwargs)
    return _C.forward_workspace_bytes(device, tensors, options)


def plan_forward(*args, **kwargs):
    device, tensors, options, _ = _split(_PLAN_FORWARD, args, kwargs)
    return _C.plan_forward(device, tensors, options)


def backward(*args, **kwargs):
    device, tensors, options, _ = _split(_BACKWARD, args, kwargs)
    return _C.backward(device, tensors, options)


def plan_backward(*args, **kwargs):
    device, tensors, options, _ = _split(_PLAN_BACKWARD, args, kwargs)
    return _C.plan_backward(device, tensors, options)
