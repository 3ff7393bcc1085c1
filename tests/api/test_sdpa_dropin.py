"""The SDPA drop-in: masks inside the kernels, torch's signature and errors, visible fallbacks, and
patch()/unpatch() on real torch modules (CPU tensors through the CPU Metal device)."""

from __future__ import annotations

import itertools
import logging
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from flashattn_mps import explain, patch, scaled_dot_product_attention, unpatch
from flashattn_mps._sdpa import torch_sdpa  # torch's SDPA with enable_gqa also on torch 2.4
from helpers import ALL_DTYPES, TORCH_VERSION, max_error, randn, sdpa_rows_without_keys_zero


def golden_and_reference(q, k, v, mask=None, causal=False, scale=None, enable_gqa=False):
    golden_mask = None if mask is None else mask if mask.dtype == torch.bool else mask.double()
    options = dict(is_causal=causal, scale=scale, enable_gqa=enable_gqa)
    golden = sdpa_rows_without_keys_zero(q.double(), k.double(), v.double(), attn_mask=golden_mask, **options)
    reference = sdpa_rows_without_keys_zero(q, k, v, attn_mask=mask, **options)
    return golden, reference


def assert_dropin_matches(q, k, v, mask=None, causal=False, scale=None, enable_gqa=False, factor=5.0):
    assert explain(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=enable_gqa).startswith(
        "flashattn_mps"
    )
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=enable_gqa)
    golden, reference = golden_and_reference(q, k, v, mask, causal, scale, enable_gqa)
    tolerance = max(1e-5, factor * max_error(reference, golden))
    assert out.shape == golden.shape and out.dtype == q.dtype
    assert max_error(out, golden) <= tolerance


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks_of_every_broadcast_shape(gen, dtype, kind):
    b, h, lq, lk, e = 2, 4, 37, 45, 32
    q, k, v = (
        randn(gen, b, h, lq, e, dtype=dtype),
        randn(gen, b, 2, lk, e, dtype=dtype),
        randn(gen, b, 2, lk, e, dtype=dtype),
    )
    # PyTorch's patterns: 4-D masks with every dim full or 1, and 2-D ones.
    shapes = list(itertools.product([b, 1], [h, 1], [lq, 1], [lk, 1])) + [(lq, lk), (1, lk), (lq, 1)]
    for shape in shapes:
        keep = torch.rand(*shape, generator=gen) > 0.3
        if shape[-2] == lq:
            keep[..., ::4, :] = False  # every 4th row sees nothing
        if kind == "bool":
            mask = keep
        else:
            mask = torch.where(keep, torch.randn(*shape, generator=gen), torch.tensor(float("-inf"))).to(
                dtype if shape == (lq, lk) else torch.float32
            )
        assert_dropin_matches(q, k, v, mask, enable_gqa=True)


@pytest.mark.parametrize("lq", [5, 70])  # decode and prefill kernels
def test_fully_masked_rows_give_zeros(gen, lq):
    q, k, v = randn(gen, 1, 2, lq, 16), randn(gen, 1, 2, 30, 16), randn(gen, 1, 2, 30, 16)
    mask = torch.rand(lq, 30, generator=gen) > 0.5
    mask[::4] = False  # every 4th row sees nothing
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert (out[:, :, ::4] == 0).all()
    assert_dropin_matches(q, k, v, mask)


def test_key_padding_mask(gen):
    lengths = torch.tensor([30, 17, 1])
    mask = (torch.arange(30)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)
    q, k, v = (
        randn(gen, 3, 4, 20, 64, dtype=torch.float16),
        randn(gen, 3, 4, 30, 64, dtype=torch.float16),
        randn(gen, 3, 4, 30, 64, dtype=torch.float16),
    )
    assert_dropin_matches(q, k, v, mask)


def test_band_mask_600(gen):
    n = 600
    outside = torch.ones(n, n, dtype=torch.bool).triu(1) | torch.ones(n, n, dtype=torch.bool).tril(-65)
    band = torch.zeros(n, n).masked_fill(outside, float("-inf"))  # each query sees itself and 64 before
    q, k, v = randn(gen, 1, 2, n, 32), randn(gen, 1, 2, n, 32), randn(gen, 1, 2, n, 32)
    assert_dropin_matches(q, k, v, band)


def test_causal_and_shapes_like_torch(gen):
    q, k, v = randn(gen, 2, 3, 4, 9, 16), randn(gen, 2, 3, 4, 11, 16), randn(gen, 2, 3, 4, 11, 8)  # 5-D
    assert_dropin_matches(q, k, v, causal=True)
    q2, k2, v2 = randn(gen, 9, 16), randn(gen, 11, 16), randn(gen, 11, 8)  # 2-D
    assert_dropin_matches(q2, k2, v2, causal=True)
    q3, k3, v3 = randn(gen, 2, 8, 9, 16), randn(gen, 2, 2, 11, 16), randn(gen, 2, 2, 11, 16)
    assert_dropin_matches(q3, k3, v3, enable_gqa=True, scale=0.3)


ERROR_CASES = {
    "mask and causal": lambda q, k, v: dict(attn_mask=torch.ones(5, 6, dtype=torch.bool), is_causal=True),
    "heads without enable_gqa": lambda q, k, v: dict(key=k[:, :2], value=v[:, :2]),
    "indivisible heads": lambda q, k, v: dict(key=k[:, :3], value=v[:, :3], enable_gqa=True),
    "dtype mix": lambda q, k, v: dict(key=k.half()),
    "int mask": lambda q, k, v: dict(attn_mask=torch.ones(5, 6, dtype=torch.int32)),
    "float64 mask": lambda q, k, v: dict(attn_mask=torch.ones(5, 6, dtype=torch.float64)),
    "mask shape": lambda q, k, v: dict(attn_mask=torch.ones(5, 7)),
    "dropout out of range": lambda q, k, v: dict(dropout_p=1.5),
    "head dim mismatch": lambda q, k, v: dict(key=k[..., :4]),
    "int inputs": lambda q, k, v: dict(query=q.int(), key=k.int(), value=v.int()),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_errors_are_torchs(case):
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    args = dict(query=q, key=k, value=v)
    args.update(ERROR_CASES[case](q, k, v))
    # torch's error, from its meta kernel (nothing computed); torch 2.4's meta kernel accepts int
    # inputs that its CPU kernel refuses, so there the CPU kernel says what torch raises.
    device = "cpu" if case == "int inputs" and TORCH_VERSION < (2, 5) else "meta"
    with pytest.raises(Exception) as theirs:
        torch_sdpa(**{n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in args.items()})
    with pytest.raises(theirs.type):
        scaled_dot_product_attention(**args)


FALLBACKS = {
    "float64": (lambda q, k, v: dict(query=q.double(), key=k.double(), value=v.double()), "dtypes"),
    "mask needs grad": (lambda q, k, v: dict(attn_mask=torch.zeros(5, 6, requires_grad=True)), "requires grad"),
    "broadcast batch": (lambda q, k, v: dict(key=k[:1], value=v[:1]), "batch dimensions differ"),
    "head dim 600": (
        lambda q, k, v: dict(query=torch.randn(2, 4, 5, 600), key=torch.randn(2, 4, 6, 600)),
        "head dims above 576",
    ),
    "meta device": (lambda q, k, v: dict(query=q.to("meta"), key=k.to("meta"), value=v.to("meta")), "device"),
}


@pytest.mark.parametrize("case", sorted(FALLBACKS))
def test_fallbacks_take_torch_and_say_why(case, caplog):
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    make, reason = FALLBACKS[case]
    args = dict(query=q, key=k, value=v)
    args.update(make(q, k, v))
    text = explain(**args)
    assert text.startswith("torch's scaled_dot_product_attention") and reason in text
    with caplog.at_level(logging.DEBUG, logger="flashattn_mps"):
        torch.manual_seed(0)
        out = scaled_dot_product_attention(**args)
    assert reason in caplog.text
    torch.manual_seed(0)
    expected = F.scaled_dot_product_attention(**args)
    if out.device.type != "meta":
        assert torch.equal(out, expected)


def test_patch_routes_only_what_it_should(gen, caplog):
    original = F.scaled_dot_product_attention
    q, k, v = randn(gen, 1, 2, 9, 16), randn(gen, 1, 2, 9, 16), randn(gen, 1, 2, 9, 16)
    with caplog.at_level(logging.DEBUG, logger="flashattn_mps"):
        with patch():  # CPU tensors are not routed unless asked
            assert F.scaled_dot_product_attention is not original
            F.scaled_dot_product_attention(q, k, v)
        assert "not asked to route CPU calls" in caplog.text and "-> flashattn_mps" not in caplog.text
        assert F.scaled_dot_product_attention is original
        caplog.clear()
        outer = patch(cpu=True)
        inner = patch()
        outer.close()  # closing out of order keeps the newest patch in force ...
        assert F.scaled_dot_product_attention is not original
        inner.close()  # ... and restores torch's function when the last one goes
        assert F.scaled_dot_product_attention is original
        patch(cpu=True)
        try:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        finally:
            unpatch()
        assert "-> flashattn_mps kernels" in caplog.text
    assert F.scaled_dot_product_attention is original
    assert max_error(out, F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)) < 1e-5


def run_module(module, x, key_padding=None):
    module.zero_grad()
    x = x.clone().requires_grad_()
    out = (
        module(x, x, x, key_padding_mask=key_padding, need_weights=False)[0]
        if isinstance(module, nn.MultiheadAttention)
        else module(x, src_key_padding_mask=key_padding)
    )
    out.sum().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in module.parameters()]


GRAD_FUDGE = {"q": 16.0, "k": 16.0, "v": 4.0}  # PyTorch's factors (dQ up to 180 for half types)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("pattern", ["bool_rows_masked", "float_key_padding", "band", "full_4d_float"])
def test_mask_gradients(gen, dtype, pattern):
    b, h, lq, lk, e = 2, 4, 40, 50, 32
    q, k, v = (randn(gen, b, h, n, e, dtype=dtype) for n in (lq, lk, lk))
    if pattern == "bool_rows_masked":
        mask = torch.rand(lq, lk, generator=gen) > 0.4
        mask[::4] = False  # rows with no visible key: zero output, zero gradients
    elif pattern == "float_key_padding":
        mask = torch.zeros(b, 1, 1, lk).masked_fill(
            torch.arange(lk) >= torch.tensor([50, 23]).view(b, 1, 1, 1), float("-inf")
        )
    elif pattern == "band":
        outside = torch.ones(lq, lk, dtype=torch.bool).triu(1) | torch.ones(lq, lk, dtype=torch.bool).tril(-9)
        mask = torch.zeros(lq, lk, dtype=dtype).masked_fill(outside, float("-inf"))
    else:
        mask = torch.randn(b, h, lq, lk, generator=gen)
    dout = randn(gen, b, h, lq, e, dtype=dtype)

    def grads(fn, *tensors):
        leaves = [t.detach().requires_grad_() for t in tensors]
        fn(*leaves, mask if mask.dtype == torch.bool or leaves[0].dtype != torch.float64 else mask.double()).backward(
            dout.to(leaves[0].dtype)
        )
        return [t.grad for t in leaves]

    ours = grads(lambda q_, k_, v_, m: scaled_dot_product_attention(q_, k_, v_, attn_mask=m), q, k, v)
    golden = grads(
        lambda q_, k_, v_, m: sdpa_rows_without_keys_zero(q_, k_, v_, attn_mask=m), q.double(), k.double(), v.double()
    )
    reference = grads(lambda q_, k_, v_, m: sdpa_rows_without_keys_zero(q_, k_, v_, attn_mask=m), q, k, v)
    for name, a, g, r in zip("qkv", ours, golden, reference):
        tolerance = max(1e-5, GRAD_FUDGE[name] * max_error(r, g))
        assert max_error(a, g) <= tolerance, f"d{name}: {max_error(a, g):.3e} > {tolerance:.3e}"
    if pattern == "bool_rows_masked":
        assert (ours[0][:, :, ::4] == 0).all()


def test_multihead_attention_and_encoder_layer_with_patch(gen, caplog):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(64, 4, batch_first=True)
    layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0, batch_first=True)
    x = randn(gen, 2, 33, 64)
    padding = torch.zeros(2, 33, dtype=torch.bool)
    padding[1, 20:] = True
    for module in (mha, layer):
        for kp in (None, padding):
            expected = run_module(module, x, kp)
            caplog.clear()
            with patch(cpu=True), caplog.at_level(logging.DEBUG, logger="flashattn_mps"):
                got = run_module(module, x, kp)
            assert "-> flashattn_mps kernels" in caplog.text and "-> torch's" not in caplog.text
            for a, b in zip((expected[0], expected[1], *expected[2]), (got[0], got[1], *got[2])):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# torch's own argument parser decides what each scalar argument accepts: the drop-in must accept
# and refuse exactly the same.
class _HasFloat:
    def __float__(self):
        return 0.5


ARGUMENT_VALUES = {
    "float": 0.5,
    "int": 1,
    "zero": 0,
    "bool": True,
    "false": False,
    "np.float32": np.float32(0.375),
    "np.float16": np.float16(0.5),
    "np.int64": np.int64(1),
    "np.bool_": np.bool_(True),
    "0-dim tensor": torch.tensor(0.25),
    "0-dim int tensor": torch.tensor(1),
    "1-element tensor": torch.tensor([0.5]),
    "tensor needing grad": torch.tensor(0.5, requires_grad=True),
    "str": "0.5",
    "complex": 1j,
    "None": None,
    "__float__": _HasFloat(),
    "np.ndarray": np.array(0.5),
}


@pytest.mark.parametrize("argument", ["scale", "dropout_p", "is_causal", "enable_gqa"])
def test_argument_types_are_torchs(gen, argument, core_calls):
    q, k, v = randn(gen, 1, 2, 5, 8), randn(gen, 1, 2, 6, 8), randn(gen, 1, 2, 6, 8)
    for name, value in ARGUMENT_VALUES.items():
        meta = dict(query=q.to("meta"), key=k.to("meta"), value=v.to("meta"), **{argument: value})
        try:
            torch_sdpa(**meta)
        except Exception as theirs:
            with pytest.raises(type(theirs)):
                scaled_dot_product_attention(q, k, v, **{argument: value})
            continue
        if argument == "dropout_p" and value not in (0, False):
            continue  # accepted, and random: the kernels' dropout (tests/kernels/test_dropout.py)
        before = core_calls["forward"]
        out = scaled_dot_product_attention(q, k, v, **{argument: value})
        assert core_calls["forward"] == before + 1, f"{argument}={name} did not reach the kernels"
        expected = torch_sdpa(q, k, v, **{argument: value})
        assert max_error(out, expected.double()) < 1e-5, f"{argument}={name}"


@pytest.mark.parametrize("lq, lk", [(5, 9), (7, 7), (40, 70)])
def test_causal_bias_variants(gen, lq, lk, core_calls):
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left

    q, k, v = randn(gen, 2, 2, lq, 16), randn(gen, 2, 2, lk, 16), randn(gen, 2, 2, lk, 16)
    for make, where in ((causal_upper_left, "upper left"), (causal_lower_right, "lower right")):
        bias = make(lq, lk)
        text = explain(q, k, v, attn_mask=bias)
        assert text.startswith("flashattn_mps kernels") and ("CausalBias" in text)
        calls = core_calls["forward"]
        with patch(cpu=True):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        assert core_calls["forward"] == calls + 1
        golden = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=bias._materialize())
        assert max_error(out, golden) < 1e-5, where
    with pytest.raises(ValueError):  # as torch: a CausalBias does not combine with is_causal
        scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(lq, lk), is_causal=True)


class LoggingTensor(torch.Tensor):
    """A subclass with its own __torch_function__: it must see the call (torch's protocol)."""

    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_torch_function_subclasses_go_to_torch(gen, core_calls):
    q, k, v = randn(gen, 1, 2, 5, 8), randn(gen, 1, 2, 6, 8), randn(gen, 1, 2, 6, 8)
    for subclassed in (
        {"query": q.as_subclass(LoggingTensor)},
        {"attn_mask": torch.zeros(5, 6).as_subclass(LoggingTensor)},
    ):
        args = {**dict(query=q, key=k, value=v), **subclassed}
        assert "LoggingTensor" in explain(**args) and explain(**args).startswith("torch's")
        LoggingTensor.seen.clear()
        out = scaled_dot_product_attention(**args)
        assert "scaled_dot_product_attention" in LoggingTensor.seen
        assert (
            max_error(out.as_subclass(torch.Tensor), F.scaled_dot_product_attention(q.double(), k.double(), v.double()))
            < 1e-5
        )
    assert core_calls["forward"] == 0
    parameter = nn.Parameter(q.clone())  # Parameter disables __torch_function__: the kernels take it
    assert explain(parameter, k, v).startswith("flashattn_mps")


def test_jit_trace_records_the_custom_op_and_replays(gen):
    q, k, v = randn(gen, 1, 2, 9, 16), randn(gen, 1, 2, 9, 16), randn(gen, 1, 2, 9, 16)
    mask = torch.rand(9, 9, generator=gen) > 0.3

    def attend(q_, k_, v_, m):
        return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True) + F.scaled_dot_product_attention(
            q_, k_, v_, attn_mask=m
        )

    with patch(cpu=True), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # routing is decided when tracing, as shapes
        traced = torch.jit.trace(attend, (q, k, v, mask))
    assert "flashattn_mps::attention_forward" in str(traced.graph)
    q2, k2, v2 = randn(gen, 1, 2, 9, 16), randn(gen, 1, 2, 9, 16), randn(gen, 1, 2, 9, 16)
    mask2 = torch.rand(9, 9, generator=gen) > 0.5
    golden = attend(q2.double(), k2.double(), v2.double(), mask2)
    assert max_error(traced(q2, k2, v2, mask2), golden) < 1e-5


def test_export_traces_the_custom_op(gen):
    class Attend(nn.Module):
        def forward(self, q_, k_, v_):
            return scaled_dot_product_attention(q_, k_, v_, is_causal=True)

    q, k, v = randn(gen, 1, 2, 9, 16), randn(gen, 1, 2, 9, 16), randn(gen, 1, 2, 9, 16)
    exported = torch.export.export(Attend(), (q, k, v))
    assert "flashattn_mps.attention_forward" in str(exported.graph)
    q2 = randn(gen, 1, 2, 9, 16)
    golden = F.scaled_dot_product_attention(q2.double(), k.double(), v.double(), is_causal=True)
    assert max_error(exported.module()(q2, k, v), golden) < 1e-5


def test_nested_tensors_and_vmap_go_to_torch(gen, core_calls):
    lengths, h, e = (3, 7), 2, 16
    parts = [randn(gen, n, h, e) for n in lengths]
    nested = torch.nested.nested_tensor(parts, layout=torch.jagged).transpose(1, 2)  # (B, H, j, E)
    text = explain(nested, nested, nested)
    assert text.startswith("torch's") and "nested" in text
    out = scaled_dot_product_attention(nested, nested, nested)
    for part, got in zip(parts, out.unbind()):
        t = part.transpose(0, 1).double()
        assert max_error(got, F.scaled_dot_product_attention(t, t, t)) < 1e-5

    q, k, v = randn(gen, 3, 2, 5, 8), randn(gen, 3, 2, 6, 8), randn(gen, 3, 2, 6, 8)
    reasons = []
    out = torch.vmap(lambda a, b, c: (reasons.append(explain(a, b, c)), scaled_dot_product_attention(a, b, c))[1])(
        q, k, v
    )
    assert reasons[0].startswith("torch's") and "torch.func" in reasons[0]
    assert max_error(out, F.scaled_dot_product_attention(q.double(), k.double(), v.double())) < 1e-5
    assert core_calls["forward"] == 0


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_without_graph_breaks(gen, dynamic, core_calls, caplog):
    from torch._dynamo.utils import counters

    def attend(q_, k_, v_, m):
        return scaled_dot_product_attention(q_, k_, v_, is_causal=True) + scaled_dot_product_attention(
            q_, k_, v_, attn_mask=m
        )

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(attend, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    # new lengths and head dims: recompiles (static) or one symbolic graph (dynamic; the default
    # scale 1/sqrt(E) is resolved by the op at run time, so nothing guards on E)
    for n, e in ((9, 16), (13, 32), (17, 8)):
        q, k, v = (randn(gen, 1, 2, n, e).requires_grad_() for _ in range(3))
        mask = torch.rand(n, n, generator=gen) > 0.3
        with caplog.at_level(logging.WARNING):
            out = compiled(q, k, v, mask)
        out.sum().backward()
        golden = attend(q.detach().double(), k.detach().double(), v.detach().double(), mask)
        assert max_error(out.detach(), golden) < 1e-5
    assert not counters["graph_break"], dict(counters["graph_break"])
    # no warning and nothing of ours (torch 2.14 logs its own tracing at DEBUG level: not ours to judge)
    ours = [r for r in caplog.records if r.levelno >= logging.WARNING or r.name.startswith("flashattn_mps")]
    assert not ours, [r.getMessage() for r in ours]
    assert core_calls["forward"] == 6 and core_calls["backward"] == 6
    if dynamic:
        assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_follows_torchs_rule(gen, dtype, core_calls):
    q, k, v = randn(gen, 1, 2, 9, 16), randn(gen, 1, 2, 9, 16), randn(gen, 1, 2, 9, 16)
    mask = torch.randn(9, 9, generator=gen)
    with torch.autocast("cpu", dtype):
        text = explain(q, k, v, attn_mask=mask)
        out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
        reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        doubles = scaled_dot_product_attention(q.double(), k.double(), v.double())  # float64 is not cast
    assert text.startswith("flashattn_mps") and "autocast" in text
    assert out.dtype == reference.dtype == dtype and doubles.dtype == torch.float64
    assert core_calls["forward"] == 1
    cast = [t.to(dtype) for t in (q, k, v, mask)]
    golden = F.scaled_dot_product_attention(*(t.double() for t in cast[:3]), attn_mask=cast[3].double())
    assert max_error(out, golden) <= max(1e-5, 5 * max_error(reference, golden))


def test_sdpa_kernel_is_honoured(gen, core_calls):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = randn(gen, 1, 2, 9, 16), randn(gen, 1, 2, 9, 16), randn(gen, 1, 2, 9, 16)
    with sdpa_kernel(SDPBackend.MATH):
        text = explain(q, k, v)
        scaled_dot_product_attention(q, k, v)
    assert text.startswith("torch's") and "sdpa_kernel" in text and core_calls["forward"] == 0
    for allowed in (
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION],
    ):
        with sdpa_kernel(allowed):
            assert explain(q, k, v).startswith("flashattn_mps")
            scaled_dot_product_attention(q, k, v)
    assert core_calls["forward"] == 3
