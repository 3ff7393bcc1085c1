"""Bad input: clear errors naming the argument and the shapes; malformed descriptors rejected by
the C layer without crashing."""

from __future__ import annotations

import pytest
import torch

from flashattn_mps import _C, _metal_cpu, _sources, flash_attention
from flashattn_mps._api import describe
from helpers import BACKWARD_NAMES, FORWARD_NAMES, core_options, slots


def qkv(b=1, hq=2, hkv=2, lq=4, lk=5, e=8, ev=8, dtype=torch.float32):
    return (
        torch.randn(b, hq, lq, e, dtype=dtype),
        torch.randn(b, hkv, lk, e, dtype=dtype),
        torch.randn(b, hkv, lk, ev, dtype=dtype),
    )


def test_not_a_tensor():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        flash_attention(q, k.numpy(), v)


def test_unsupported_dtype():
    q, k, v = qkv(dtype=torch.float64)
    with pytest.raises(TypeError, match="q has dtype torch.float64"):
        flash_attention(q, k, v)
    q, k, v = qkv()
    with pytest.raises(TypeError, match="v has dtype torch.int32"):
        flash_attention(q, k, v.to(torch.int32))


def test_mixed_dtypes():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="share one dtype"):
        flash_attention(q, k.half(), v)


def test_unsupported_device():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="q is on device 'meta'"):
        flash_attention(q.to("meta"), k.to("meta"), v.to("meta"))


def test_mixed_devices():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="k is on device 'meta'"):
        flash_attention(q, k.to("meta"), v)


@pytest.mark.parametrize(
    "shapes,message",
    [
        (
            ((1, 2, 4, 8), (1, 2, 5, 8), (1, 2, 6, 8)),
            r"k and v must have the same heads and sequence length: q \(1, 2, 4, 8\)",
        ),
        (((1, 2, 4, 8), (1, 2, 5, 16), (1, 2, 5, 8)), r"q and k must have the same head dim"),
        (((2, 2, 4, 8), (1, 2, 5, 8), (1, 2, 5, 8)), r"batch sizes differ"),
        (
            ((1, 3, 4, 8), (1, 2, 5, 8), (1, 2, 5, 8)),
            r"query heads \(3\) must be a multiple of the number of key/value heads \(2\)",
        ),
        (((1, 2, 4, 8), (1, 3, 5, 8), (1, 2, 5, 8)), r"k and v must have the same heads"),
        (((2, 4, 8), (1, 2, 5, 8), (1, 2, 5, 8)), r"must all be 4-D \(B, H, L, E\) or all 3-D"),
        (((1, 1, 2, 4, 8),) * 3, r"must all be 4-D"),
        (((1, 2, 4, 600), (1, 2, 5, 600), (1, 2, 5, 8)), r"head dims up to 576 are supported, q has 600"),
    ],
)
def test_bad_shapes(shapes, message):
    q, k, v = (torch.randn(*s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        flash_attention(q, k, v)


def test_bad_flags():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attention(q, k, v, causal=1)
    with pytest.raises(TypeError, match="scale must be a float or None"):
        flash_attention(q, k, v, scale="0.5")
    with pytest.raises(ValueError, match="kernel must be one of"):
        flash_attention(q, k, v, kernel="fastest")


def test_requires_grad_is_differentiated_not_ignored():
    q, k, v = qkv()
    assert flash_attention(q.requires_grad_(), k, v).grad_fn is not None  # gradients: tests/kernels/test_backward.py
    with torch.no_grad():
        assert not flash_attention(q, k, v).requires_grad
    with pytest.raises(ValueError, match="differentiable or compiled calls take kernel='auto'"):
        flash_attention(q, k, v, kernel="simple")


# --- the C layer, called directly with malformed descriptors -------------------------------------


def good_descriptors():
    q, k, v = qkv()
    out = torch.empty(1, 2, 4, 8)
    return [q, k, v, out], [describe(t) for t in (q, k, v, out)]


def call_c(descs, lse=None, device=_C.DEVICE_CPU, kernel=_C.KERNEL_AUTO):
    _C.forward(device, slots(FORWARD_NAMES, (*descs, lse)), core_options(scale=0.5, kernel=kernel))


def test_c_layer_accepts_good_descriptors():
    keep, descs = good_descriptors()
    call_c(descs)


@pytest.mark.parametrize(
    "index,field,value,error,message",
    [
        (0, 0, 0, ValueError, "q: the view"),  # NULL storage
        (1, 1, 16, ValueError, "k: the view .* does not fit its storage of 16 bytes"),
        (2, 2, 1 << 40, ValueError, "v: the view"),  # offset past the end
        (0, 2, -4, ValueError, "q: the view"),  # negative offset
        (3, 3, 7, TypeError, "out: unknown dtype code 7"),
        (0, 4, (1, 2, 4), ValueError, "q: expected a 4-D descriptor"),
        (1, 5, (80, 40, 8, -1), ValueError, "k: negative size or stride"),
        (2, 5, (1 << 62, 1 << 62, 1 << 62, 1), ValueError, "v: strides overflow"),
        (3, 4, (1, 2, 4, 7), ValueError, r"out \(1, 2, 4, 7\) must be \(B, Hq, L, Ev\)"),
        (1, 3, _C.DTYPE_FLOAT16, TypeError, "share one dtype"),
        (0, 4, (1, 2, 4, 8, 1), ValueError, "at most 4"),
    ],
)
def test_c_layer_rejects_malformed(index, field, value, error, message):
    keep, descs = good_descriptors()
    d = list(descs[index])
    d[field] = value
    if field == 4 and len(value) != len(d[5]):
        d[5] = tuple(d[5]) + (1,) * (len(value) - len(d[5])) if len(value) > len(d[5]) else tuple(d[5])[: len(value)]
    descs[index] = tuple(d)
    with pytest.raises(error, match=message):
        call_c(descs)


def test_c_layer_rejects_bad_codes_and_arity():
    keep, descs = good_descriptors()
    with pytest.raises(TypeError, match="unknown device code 9"):
        call_c(descs, device=9)
    with pytest.raises(ValueError, match="unknown kernel choice 42"):
        call_c(descs, kernel=42)
    with pytest.raises(ValueError, match="a descriptor has 6 fields"):
        call_c([descs[0][:5]] + descs[1:])
    with pytest.raises(TypeError, match="lse: must be float32"):
        lse = torch.empty(1, 2, 4, dtype=torch.float16)
        call_c(descs, lse=describe(lse))


def test_mps_device_code_without_metal():
    if _C.HAS_METAL_BACKEND:
        pytest.skip("this build has the Metal backend")
    keep, descs = good_descriptors()
    with pytest.raises(RuntimeError, match="Metal backend exists only in macOS builds"):
        call_c(descs, device=_C.DEVICE_MPS)


# --- arguments torch's own kernels read differently from their bytes, and messages --------------


def negated_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor equal to t whose memory holds -t: torch's negative bit, as z.conj().imag has it."""
    z = torch.complex(torch.zeros_like(t, dtype=torch.float32), -t.float())
    view = z.conj().imag
    assert view.is_neg() and torch.equal(view, t.float())
    return view.to(t.dtype) if t.dtype != torch.float32 else view


def test_negative_bit_inputs_are_resolved_as_torch_does():
    from flashattn_mps import scaled_dot_product_attention
    from helpers import assert_matches_sdpa

    q, k, v = qkv(lq=6, lk=7)
    for args in [(negated_view(q), k, v), (q, negated_view(k), v), (q, k, negated_view(v))]:
        assert_matches_sdpa(flash_attention(*args), q, k, v)
        assert_matches_sdpa(scaled_dot_product_attention(*args), q, k, v)
    mask = torch.randn(6, 7)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.allclose(flash_attention(q, k, v, attn_mask=negated_view(mask)), expected, atol=1e-5)


def test_negative_bit_gradients_are_resolved():
    q, k, v = qkv(lq=6, lk=7)
    dout = torch.randn(1, 2, 6, 8)
    ours, theirs = ([t.clone().requires_grad_() for t in (q, k, v)] for _ in range(2))
    flash_attention(negated_view(ours[0]), ours[1], ours[2]).backward(negated_view(dout))
    torch.nn.functional.scaled_dot_product_attention(*theirs).backward(dout)
    for mine, want in zip(ours, theirs):
        assert torch.allclose(mine.grad, want.grad, atol=1e-5)


def test_option_messages_name_the_argument_what_was_given_and_what_is_accepted():
    np = pytest.importorskip("numpy")
    q, k, v = qkv()
    with pytest.raises(
        TypeError, match=r"kernel must be one of \['auto', 'decode', 'forward', 'simple', 'tensor'\], got list \[\]"
    ):
        flash_attention(q, k, v, kernel=[])
    with pytest.raises(TypeError, match=r"causal must be a bool \(True or False\), got numpy.bool_? True"):
        flash_attention(q, k, v, causal=np.bool_(True))
    with pytest.raises(TypeError, match=r"return_lse must be a bool \(True or False\), got int 1"):
        flash_attention(q, k, v, return_lse=1)
    with pytest.raises(TypeError, match=r"scale must be a float or None \(an int is taken as a float\), got str '0.5'"):
        flash_attention(q, k, v, scale="0.5")


@pytest.mark.parametrize(
    "field,value,error,message",
    [
        (0, "x", TypeError, r"q: storage must be an int \(an address or id<MTLBuffer>\), got str"),
        (0, -1, ValueError, r"q: storage must be an int in 0..2\^64-1, got -1"),
        (1, 2.5, TypeError, "q: storage_bytes must be an int, got float"),
        (2, 1 << 70, ValueError, "q: byte_offset must fit in 64 bits"),
        (4, None, TypeError, "q: sizes must be a sequence of ints, got NoneType"),
        (5, (1, "a", 1, 1), TypeError, "q: strides must be an int, got str"),
    ],
)
def test_c_layer_casting_messages_name_the_field(field, value, error, message):
    keep, descs = good_descriptors()
    descs[0] = tuple(value if i == field else f for i, f in enumerate(descs[0]))
    with pytest.raises(error, match=message) as raised:
        call_c(descs)
    assert "C++ type" not in str(raised.value)


def test_c_layer_tensor_arguments_are_checked():
    q, k, v = qkv()
    out = torch.empty(1, 2, 4, 8)
    with pytest.raises(
        TypeError, match=r"k: got a torch.Tensor of dtype torch.float64; expected a torch.Tensor of dtype float32"
    ):
        _C.forward(_C.DEVICE_CPU, slots(FORWARD_NAMES, (q, k.double(), v, out)), core_options(scale=0.5))
    with pytest.raises(TypeError, match="v must be a torch.Tensor, a 6-field descriptor or None, got object"):
        _C.forward(_C.DEVICE_CPU, slots(FORWARD_NAMES, (q, k, object(), out)), core_options(scale=0.5))
    with pytest.raises(ValueError, match="k is on device meta; this call runs on cpu"):
        _C.forward(_C.DEVICE_CPU, slots(FORWARD_NAMES, (q, k.to("meta"), v, out)), core_options(scale=0.5))
    with pytest.raises(ValueError, match="q: 4-D tensor; at most 3 dims here"):
        _C.forward(_C.DEVICE_CPU, slots(FORWARD_NAMES, (q, k, v, out)), core_options(scale=0.5, unbatched=True))


def test_raw_cpu_library_dispatch_names_a_bad_buffer():
    source = "#include <metal_stdlib>\nusing namespace metal;\nkernel void k(device float *x [[buffer(0)]]) {}\n"
    library = _metal_cpu.compile_library(source, "raw.metal", [])
    with pytest.raises(TypeError, match=r"buffers\[1\] must be bytes or an int \(a host address\), got str") as raised:
        library.dispatch("k", (1, 1, 1), (32, 1, 1), [0, "x"], [], [])
    assert "C++ type" not in str(raised.value)


# ---- the C layer refuses misaligned offsets, aliased outputs and 0-d masks ----


def descriptors(dtype=torch.float32):
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=dtype) for _ in range(3))
    out = torch.empty(1, 2, 4, 8, dtype=dtype)
    return [q, k, v, out]


def forward_c(descs, lse=None, mask=None):
    _sources.ensure_registered()
    _C.forward(_C.DEVICE_CPU, slots(FORWARD_NAMES, (*descs, lse), mask=mask), core_options(scale=0.5))


def test_c_layer_rejects_misaligned_offsets_aliases_and_0d_masks():
    keep = descriptors()
    descs = [describe(t) for t in keep]
    forward_c(descs)  # the good call
    for name, index in (("q", 0), ("out", 3)):
        bad = list(descs)
        bad[index] = descs[index][:2] + (2,) + descs[index][3:]
        with pytest.raises(
            ValueError,
            match=f"{name}: byte offset 2 is not a multiple of the float32 element "
            r"size \(4 bytes\)",
        ):
            forward_c(bad)
    for victim, name in ((0, "q"), (2, "v")):
        bad = list(descs)
        bad[3] = descs[victim]
        with pytest.raises(ValueError, match=f"out .* overlaps {name} .*must not alias"):
            forward_c(bad)
    lse = torch.empty(1, 2, 4)
    lse_view = describe(keep[3].view(-1)[:8].view(1, 2, 4))  # inside out's bytes
    with pytest.raises(ValueError, match="out .* overlaps lse"):
        forward_c(descs, lse=lse_view)
    forward_c(descs, lse=describe(lse))
    broadcast_out = describe(torch.empty(8).expand(1, 2, 4, 8))
    with pytest.raises(ValueError, match="out: an output whose elements overlap"):
        forward_c(descs[:3] + [broadcast_out])
    mask = torch.ones(1, dtype=torch.bool)
    zero_d = (mask.untyped_storage().data_ptr(), 1, 0, _C.DTYPE_BOOL, (), ())
    with pytest.raises(ValueError, match="mask: expected a 4-D descriptor, got ndim=0"):
        forward_c(descs, mask=zero_d)


def test_c_layer_rejects_backward_outputs_that_alias():
    q, k, v, out = descriptors()
    lse = torch.empty(1, 2, 4)
    forward_c([describe(t) for t in (q, k, v, out)], lse=describe(lse))
    dout, delta = torch.randn_like(out), torch.empty(1, 2, 4)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    args = [describe(t) for t in (q, k, v, out, lse, dout, delta, dq, dk, dv)]
    _C.backward(_C.DEVICE_CPU, slots(BACKWARD_NAMES, args), core_options(scale=0.5))
    for index, clash, message in (
        (7, 8, "dq .* overlaps dk"),
        (9, 5, "dv .* overlaps dout"),
        (6, 4, "delta .* overlaps lse"),
    ):
        bad = list(args)
        bad[index] = args[clash]
        with pytest.raises(ValueError, match=message):
            _C.backward(_C.DEVICE_CPU, slots(BACKWARD_NAMES, bad), core_options(scale=0.5))
