"""The plan cache never serves a plan made for other options or other tensors: two calls that
differ in one option field (each of _C.OPTION_FIELDS in turn) or in one optional tensor's presence
or shape plan afresh, and repeating a call finds its plan."""

import itertools

import pytest
import torch

from flashattn_mps import _C, _sources
from helpers import core_options

B, H, L, D = 1, 2, 8, 16
CHANGED = {  # a valid value other than the base's, for every option field
    "scale": 0.25,
    "causal": True,
    "bottom_right": True,
    "window_left": 3,
    "window_right": 2,
    "softcap": 5.0,
    "dropout_p": 0.1,
    "kernel": _C.KERNEL_SIMPLE,
    "num_splits": 2,
    "write_probs": True,
    "max_q_len": 4,
    "max_kv_len": 4,
    "unbatched": True,
    "diagonal_offset": 3,
    "gpu_family": 9,
}
# Quantized K/V's fields: no value of them is valid with the same tensors (they say what the k and v
# slots hold), so they are keyed with their tensors in tests/kernels/test_quantized.py.
QUANTIZED_FIELDS = ("k_bits", "k_group_size", "v_bits", "v_group_size")


def base_options(**changes):
    return core_options(**{"scale": 0.5, **changes})


def batch_of_one(t):
    """t (3-D) as a 4-D view whose batch stride is 0, as an unbatched call sees it."""
    return t.as_strided((1, *t.shape), (0, *t.stride()))


def tensors(direction, unbatched=False):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(H, L, D, generator=gen) for _ in range(3))
    out, dout = torch.empty(H, L, D), torch.randn(H, L, D, generator=gen)
    rows = [torch.empty(H, L) for _ in range(2)]
    grads = [torch.empty(H, L, D) for _ in range(3)]
    by_name = dict(q=q, k=k, v=v, out=out, lse=rows[0])
    if direction == "backward":
        by_name.update(dout=dout, delta=rows[1], dq=grads[0], dk=grads[1], dv=grads[2])
    if not unbatched:
        by_name = {name: batch_of_one(t) for name, t in by_name.items()}
    by_name["rng_state"] = torch.zeros(4)
    return by_name


def sequence_tensors(max_len=L):
    return {
        "sequences": torch.tensor([[0, 0, max_len, 0, 0, max_len]], dtype=torch.int32),
        "sequence_scratch": torch.zeros(_C.SEQUENCE_PARAMS_BYTES // 4 + 4),
    }


def plan(direction, by_name, options):
    """Runs the cached path (the forward only as far as its workspace size) and returns whether it
    planned afresh."""
    _sources.ensure_registered()
    before = _C.plan_cache_counts()
    if direction == "forward":
        _C.forward_workspace_bytes(_C.DEVICE_CPU, by_name, options)
    else:
        _C.backward(_C.DEVICE_CPU, by_name, options)
    after = _C.plan_cache_counts()
    misses = after[f"{direction}_misses"] - before[f"{direction}_misses"]
    hits = after[f"{direction}_hits"] - before[f"{direction}_hits"]
    assert misses + hits == 1
    return misses == 1


_CASES = itertools.count(1)


def with_fresh_scale(options, shift):
    i = _C.OPTION_FIELDS.index("scale")
    return options[:i] + (options[i] + shift,) + options[i + 1 :]


def assert_keyed(direction, base_tensors, base, changed_tensors, changed):
    shift = next(_CASES) * 2.0**-20  # a scale of this case only, so no earlier case has cached its keys
    base, changed = with_fresh_scale(base, shift), with_fresh_scale(changed, shift)
    assert plan(direction, base_tensors, base), "a new call found a plan"
    assert not plan(direction, base_tensors, base), "a repeated call plans again"
    assert plan(direction, changed_tensors, changed), "a changed call was served the old plan"
    assert not plan(direction, changed_tensors, changed)


def test_the_options_tuple_is_the_c_struct():
    assert set(CHANGED) | set(QUANTIZED_FIELDS) == set(_C.OPTION_FIELDS)
    assert _C.OPTION_FIELDS == (
        "scale",
        "causal",
        "bottom_right",
        "window_left",
        "window_right",
        "softcap",
        "dropout_p",
        "kernel",
        "num_splits",
        "write_probs",
        "max_q_len",
        "max_kv_len",
        "unbatched",
        "diagonal_offset",
        *QUANTIZED_FIELDS,
        "gpu_family",
    )
    assert _C.FORWARD_SLOTS[:5] == ("q", "k", "v", "out", "lse") and "dq" in _C.BACKWARD_SLOTS
    with pytest.raises(ValueError, match="'dq' is not a forward slot"):
        _C.forward_workspace_bytes(_C.DEVICE_CPU, {**tensors("forward"), "dq": None}, base_options())
    with pytest.raises(TypeError, match="options.causal must be a bool, got str"):
        _C.forward_workspace_bytes(_C.DEVICE_CPU, tensors("forward"), base_options(causal="yes"))
    with pytest.raises(ValueError, match="expected 19 fields"):
        _C.forward_workspace_bytes(_C.DEVICE_CPU, tensors("forward"), base_options()[:-1])


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("field", list(CHANGED))
def test_every_option_is_part_of_the_plan_key(direction, field):
    if field == "kernel" and direction == "backward":
        changed_value = _C.KERNEL_DECODE  # not read by the backward, still keyed
    else:
        changed_value = CHANGED[field]
    base_tensors = tensors(direction)
    changed_tensors = base_tensors
    if field in ("max_q_len", "max_kv_len"):  # the grid's lengths: with a sequence table
        base_tensors = changed_tensors = {**base_tensors, **sequence_tensors()}
        lengths = dict(max_q_len=L, max_kv_len=L)
        base, changed = base_options(**lengths), base_options(**{**lengths, field: changed_value})
    else:
        base, changed = base_options(), base_options(**{field: changed_value})
    if field == "unbatched":  # the same views, one as 3-D tensors with a batch dim of 1 added
        changed_tensors = {
            name: t.squeeze(0) if t.dim() == 4 or name in ("lse", "delta") and t.dim() == 3 else t
            for name, t in base_tensors.items()
        }
    assert_keyed(direction, base_tensors, base, changed_tensors, changed)


OPTIONAL = {  # an optional slot's tensor, and the same slot with another shape
    "mask": (
        lambda: torch.ones(B, H, L, L, dtype=torch.bool),
        lambda: torch.ones(B, 1, L, L, dtype=torch.bool).expand(B, H, L, L),
    ),
    "alibi_slopes": (lambda: torch.ones(B, H), lambda: torch.ones(1).expand(B, H)),
    "sinks": (lambda: torch.zeros(H), lambda: torch.zeros(2 * H)[::2]),
}


# The backward requires lse and refuses a block table: those two are optional in the forward only.
OPTIONAL_CASES = [
    (direction, slot)
    for direction in ("forward", "backward")
    for slot in (*OPTIONAL, "sequences", "lse", "block_table")
    if direction == "forward" or slot not in ("lse", "block_table")
]


@pytest.mark.parametrize("direction, slot", OPTIONAL_CASES)
def test_every_optional_tensor_is_part_of_the_plan_key(direction, slot):
    base_tensors = tensors(direction)
    options = base_options()
    extra = {}
    if slot in ("sequences", "block_table"):
        options = base_options(max_q_len=L, max_kv_len=L)
        if slot == "block_table":
            base_tensors = {**base_tensors, **sequence_tensors()}
            pool = torch.randn(2, H, 4, D)
            base_tensors.update(k=pool, v=pool)
            present = {"block_table": torch.tensor([[0, 1]], dtype=torch.int32)}
            other = {"block_table": torch.tensor([[0, 1, 1]], dtype=torch.int32)}
            assert_keyed(direction, {**base_tensors, **present}, options, {**base_tensors, **other}, options)
            return
        present, other = sequence_tensors(), sequence_tensors(max_len=L // 2)
        other["sequences"] = torch.tensor([[0, 0, 4, 0, 0, 4], [0, 4, 4, 0, 4, 4]], dtype=torch.int32)
        other["sequence_scratch"] = torch.zeros(2 * _C.SEQUENCE_PARAMS_BYTES // 4 + 4)
    elif slot == "lse":
        assert_keyed(direction, {**base_tensors, "lse": None}, options, base_tensors, options)
        return
    else:
        make, make_other = OPTIONAL[slot]
        present, other = {slot: make()}, {slot: make_other()}
        if slot == "sinks" and direction == "backward":
            present["sink_grad"] = torch.empty(B, H, L)
            other["sink_grad"] = torch.empty(B, H, L)
    assert_keyed(direction, base_tensors, options, {**base_tensors, **present, **extra}, options)
    assert_keyed(direction, {**base_tensors, **present}, options, {**base_tensors, **other}, options)
