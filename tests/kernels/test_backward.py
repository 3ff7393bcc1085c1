"""The fused backward and flash_attention's autograd: gradient parity with SDPA over a sampled
product of shapes, layouts and flags, the torch.library ops under opcheck and torch.compile, a
training run against SDPA, and the errors (double backward, malformed descriptors)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from flashattn_mps import _C, flash_attention
from flashattn_mps._api import describe
from helpers import (
    ALL_DTYPES,
    FUDGE,
    LAYOUTS,
    core_options,
    layout_tensor,
    max_error,
    peak_memory_growth,
    product_case_tensors,
    randn,
    sample_product,
    sdpa,
)

HEAD_DIMS = [32, 59, 64, 96, 128, 256]
LENGTHS = [(113, 203), (203, 113), (128, 217), (1, 147), (37, 37)]
GQA = [1, 3, 8]


def sdpa_gradients(q, k, v, dout, causal, scale=None, attention=sdpa):
    """(dq, dk, dv) of attention(q, k, v) against dout, through autograd, inputs as they are."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    attention(*leaves, causal=causal, scale=scale).backward(dout)
    return [t.grad for t in leaves]


def ours(q, k, v, causal=False, scale=None):
    return flash_attention(q, k, v, causal=causal, scale=scale)


def assert_gradients_match(q, k, v, dout, causal=False, scale=None):
    golden = sdpa_gradients(q.double(), k.double(), v.double(), dout.double(), causal, scale)
    reference = sdpa_gradients(q, k, v, dout, causal, scale)
    actual = sdpa_gradients(q, k, v, dout, causal, scale, attention=ours)
    for name, a, g, r, t in zip(("dq", "dk", "dv"), actual, golden, reference, (q, k, v)):
        assert a.shape == t.shape and a.dtype == t.dtype, name
        error, reference_error = max_error(a, g), max_error(r, g)
        tolerance = max(1e-5, FUDGE[name] * reference_error)
        assert error <= tolerance, f"{name}: error {error:.3e} > {tolerance:.3e} (reference {reference_error:.3e})"


def case_cost(case):
    (lq, lk), e, gqa = case[0], case[1], case[2]
    return lq * lk * e * gqa


@pytest.mark.parametrize(
    "lengths,e,gqa,dtype,causal,layout,ev_differs",
    sample_product(
        [LENGTHS, HEAD_DIMS, GQA, ALL_DTYPES, [False, True], LAYOUTS, [False, True]], 40, 6, case_cost, 8, 1.5e7
    ),
)
@pytest.mark.slow
def test_gradient_parity(gen, lengths, e, gqa, dtype, causal, layout, ev_differs):
    q, k, v = product_case_tensors(gen, lengths, e, gqa, dtype, layout, ev_differs)
    dout = layout_tensor(gen, layout, 1, q.shape[1], q.shape[2], v.shape[3], dtype)
    assert_gradients_match(q, k, v, dout, causal)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_batched_heads_scale_and_3d(gen, dtype):
    q, k, v = (
        randn(gen, 2, 6, 45, 40, dtype=dtype),
        randn(gen, 2, 2, 70, 40, dtype=dtype),
        randn(gen, 2, 2, 70, 24, dtype=dtype),
    )
    assert_gradients_match(q, k, v, randn(gen, 2, 6, 45, 24, dtype=dtype), causal=True, scale=-0.3)
    assert_gradients_match(q[1], k[1], v[1], randn(gen, 6, 45, 24, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lq,lk", [(40, 70), (3, 70), (1, 2000)])
def test_after_each_forward_kernel(gen, dtype, lq, lk):
    """The backward reads the log-sum-exp of whichever forward ran: the prefill kernel, the decode
    kernel, and the decode kernel with its keys split over threadgroups (L = 1 against 2000 keys)."""
    q, k, v = (
        randn(gen, 1, 4, lq, 64, dtype=dtype),
        randn(gen, 1, 1, lk, 64, dtype=dtype),
        randn(gen, 1, 1, lk, 64, dtype=dtype),
    )
    assert_gradients_match(q, k, v, randn(gen, 1, 4, lq, 64, dtype=dtype))


@pytest.mark.parametrize("lq,lk", [(0, 5), (5, 0), (0, 0)])
def test_empty_sequences(gen, lq, lk):
    q, k, v = (randn(gen, 1, 2, n, 8).requires_grad_() for n in (lq, lk, lk))
    flash_attention(q, k, v).sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and (t.grad == 0).all()


def test_only_some_inputs_require_grad(gen):
    q, k, v = randn(gen, 1, 4, 30, 32), randn(gen, 1, 2, 40, 32), randn(gen, 1, 2, 40, 32)
    k.requires_grad_()
    out = flash_attention(q, k, v, causal=True)
    out.sum().backward()  # an expanded gradient: dout read with stride 0
    assert q.grad is None and v.grad is None
    expected = sdpa_gradients(q.double(), k.double(), v.double(), torch.ones(out.shape, dtype=torch.float64), True)[1]
    assert max_error(k.grad, expected) < 1e-5


def test_lse_is_returned_without_gradient(gen):
    q, k, v = (randn(gen, 1, 2, 12, 16).requires_grad_() for _ in range(3))
    out, lse = flash_attention(q, k, v, return_lse=True)
    assert out.requires_grad and not lse.requires_grad


def test_double_backward_raises(gen):
    q, k, v = (randn(gen, 1, 2, 12, 16).requires_grad_() for _ in range(3))
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.grad(flash_attention(q, k, v).sum(), (q, k), create_graph=True)


RUN_TRAINING_STEP = """
def run(n):
    q = torch.randn(1, 1, n, 32, requires_grad=True)
    flash_attention(q, q, q, causal=True).sum().backward()
    return q.nbytes * 3  # q, out, q.grad
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads peak RSS from /proc")
@pytest.mark.slow
def test_memory_grows_linearly_with_length():
    small, small_io = peak_memory_growth(RUN_TRAINING_STEP, 1024)
    large, large_io = peak_memory_growth(RUN_TRAINING_STEP, 4096)
    score_matrix = 4096 * 4096 * 4  # one float32 L x S matrix: 64 MiB
    assert large < score_matrix / 8, f"peak grew by {large} bytes at L=4096"
    # 4x the length: linear growth is ~4x, quadratic would be 16x.
    assert large - large_io <= 6 * max(small - small_io, 1 << 20), (small, large)


# --- the torch.library ops ---------------------------------------------------------------------


def test_opcheck(gen):
    q, k, v = randn(gen, 1, 4, 20, 16), randn(gen, 1, 2, 24, 16), randn(gen, 1, 2, 24, 8)
    strided = randn(gen, 1, 24, 2, 16).transpose(1, 2)
    mask = torch.rand(20, 24, generator=gen) > 0.3
    for args in [
        (q, k, v, None, True, 0.25),
        (q[0], k[0], v[0], None, False, 0.5),
        (q, strided, v, None, False, 0.5),
        (q, k, v, mask, False, 0.25),
    ]:
        torch.library.opcheck(
            torch.ops.flashattn_mps.attention_forward.default,
            tuple(t.requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in args),
        )
    out, lse = torch.ops.flashattn_mps.attention_forward(q.detach(), k.detach(), v.detach(), None, True, 0.25)
    dout = randn(gen, 1, 20, 4, 8).transpose(1, 2)
    torch.library.opcheck(
        torch.ops.flashattn_mps.attention_backward.default,
        (dout, q.detach(), k.detach(), v.detach(), out, lse, None, True, 0.25),
    )


class Block(torch.nn.Module):
    """A pre-norm transformer block with GQA (4 query heads, 2 kv heads) and a causal mask."""

    def __init__(self, attention, width=32, heads=4, kv_heads=2):
        super().__init__()
        self.attention, self.heads, self.kv_heads, self.head_dim = attention, heads, kv_heads, width // heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, (heads + 2 * kv_heads) * self.head_dim)
        self.proj = torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1
        )
        # (B, L, H, D) viewed as (B, H, L, D): strided inputs, as models produce them.
        q, k, v = (t.view(b, n, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = self.attention(q, k, v, causal=True)
        x = x + self.proj(out.transpose(1, 2).reshape(b, n, -1))
        return x + self.mlp(self.norm2(x))


def test_torch_compile_has_no_graph_break(gen):
    model = Block(ours)
    x = randn(gen, 2, 24, 32)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    y = compiled(x)
    y.square().mean().backward()
    compiled_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected = model(x)
    expected.square().mean().backward()
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(compiled_grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_training_matches_sdpa(gen):
    """A few Adam steps of a tiny causal language-model block: the loss curves agree."""

    def train(attention):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(50, 32), Block(attention), torch.nn.Linear(32, 50))
        optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
        tokens = torch.randint(0, 50, (4, 33), generator=torch.Generator().manual_seed(1))
        losses = []
        for _ in range(8):
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 50), tokens[:, 1:].reshape(-1))
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            losses.append(loss.item())
        return losses

    ours_losses, sdpa_losses = train(ours), train(sdpa)
    assert ours_losses[-1] < ours_losses[0] - 0.3  # it learns
    assert ours_losses == pytest.approx(sdpa_losses, rel=1e-4, abs=1e-4)


# --- the C layer, called directly with malformed descriptors -------------------------------------


def backward_tensors():
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 4)
    out, lse = flash_attention(q, k, v, scale=0.5, return_lse=True)
    names = ["q", "k", "v", "out", "lse", "dout", "delta", "dq", "dk", "dv"]
    tensors = [
        q,
        k,
        v,
        out,
        lse,
        torch.randn(1, 4, 6, 4),
        torch.empty(1, 4, 6),
        torch.empty_like(q),
        torch.empty_like(k),
        torch.empty_like(v),
    ]
    return dict(zip(names, tensors))


def call_backward(tensors, **replace):
    descs = {name: describe(t) for name, t in tensors.items()}
    descs.update(replace)
    _C.backward(_C.DEVICE_CPU, descs, core_options(scale=0.5))


def test_c_layer_backward_accepts_good_descriptors():
    tensors = backward_tensors()
    call_backward(tensors)
    expected = sdpa_gradients(*(tensors[n].double() for n in ("q", "k", "v", "dout")), False, 0.5)
    for name, want in zip(("dq", "dk", "dv"), expected):
        assert max_error(tensors[name], want) < 1e-5


@pytest.mark.parametrize(
    "name,make,error,message",
    [
        (
            "dq",
            lambda t: torch.empty(1, 4, 6, 7),
            ValueError,
            r"dq \(1, 4, 6, 7\) must be the shape of q \(1, 4, 6, 8\)",
        ),
        ("dk", lambda t: torch.empty(1, 2, 5, 8, dtype=torch.float16), TypeError, "dk: must be float32, got float16"),
        ("dv", lambda t: torch.empty(1, 2, 5), ValueError, "dv: expected a 4-D descriptor"),
        ("dout", lambda t: torch.empty(1, 4, 5, 4), ValueError, r"dout \(1, 4, 5, 4\) must be the shape of out"),
        ("delta", lambda t: torch.empty(1, 4, 6, dtype=torch.float16), TypeError, "delta: must be float32"),
        ("delta", lambda t: torch.empty(1, 4, 7), ValueError, r"delta \(1, 4, 7\) must be \(B, Hq, L\) for q"),
        ("lse", lambda t: torch.empty(1, 4, 5), ValueError, r"lse must be \(B, Hq, L\)"),
        ("k", lambda t: torch.empty(1, 3, 5, 8), ValueError, "must have the same heads and sequence length"),
    ],
)
def test_c_layer_backward_rejects_malformed(name, make, error, message):
    tensors = backward_tensors()
    tensors[name] = make(tensors)
    with pytest.raises(error, match=message):
        call_backward(tensors)


def test_c_layer_backward_checks_bounds_and_presence():
    tensors = backward_tensors()
    too_far = list(describe(tensors["dq"]))
    too_far[2] = 64  # byte offset: the view runs past its storage
    with pytest.raises(ValueError, match="dq: the view"):
        call_backward(tensors, dq=tuple(too_far))
    with pytest.raises(ValueError, match="lse: the view"):
        call_backward(tensors, lse=(0, 0, 0, _C.DTYPE_FLOAT32, (1, 4, 6), (24, 6, 1)))


# --- the tiled kernels' paths, as in test_forward_kernel.py ------------------------------------------


def backward_view(gen, layout, b, h, n, d, dtype):
    if layout == "unaligned":  # unit column stride, aligned strides, start one element off: strided path
        return randn(gen, b, h, n, d + 4, dtype=dtype)[..., 1 : d + 1]
    if layout == "strided":
        return randn(gen, b, h, n, 2 * d, dtype=dtype)[..., ::2]
    return layout_tensor(gen, layout, b, h, n, d, dtype)


@pytest.mark.parametrize(
    "layout,dtype",
    [("bhld", torch.float32), ("blhd", torch.float16), ("unaligned", torch.bfloat16), ("strided", torch.float32)],
)
def test_gradient_tile_paths(gen, layout, dtype):
    """dK/dV tiles Q and dO, dQ tiles K and V: contiguous and strided load paths, ragged tiles, a
    head dim with a padding slice (40 in 48), GQA, both causal orders of the grid."""
    q, k, v = (
        backward_view(gen, layout, 1, 4, 37, 40, dtype),
        backward_view(gen, layout, 1, 2, 75, 40, dtype),
        backward_view(gen, layout, 1, 2, 75, 24, dtype),
    )
    dout = backward_view(gen, layout, 1, 4, 37, 24, dtype)
    for causal in (False, True):
        assert_gradients_match(q, k, v, dout, causal)


def masked(mask):
    def attention(q, k, v, causal=False, scale=None):
        if attention.ours:
            return flash_attention(q, k, v, attn_mask=mask, scale=scale)
        return sdpa(
            q,
            k,
            v,
            attn_mask=mask if mask.dtype == torch.bool or q.dtype != torch.float64 else mask.double(),
            scale=scale,
        )

    return attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
def test_gradient_mask_tile_classes(gen, dtype, mask_kind):
    """Masks of wholly kept, wholly excluded and mixed blocks in both gradient kernels (query tiles
    of dK/dV, key tiles of dQ), one of them transposed in memory."""
    lq, lk = 70, 72
    g = torch.Generator().manual_seed(5)
    kind = (
        torch.randint(0, 3, (lq // 8 + 1, lk // 8 + 1), generator=g)
        .repeat_interleave(8, 0)[:lq]
        .repeat_interleave(8, 1)[:, :lk]
    )
    keep = torch.where(kind == 2, torch.rand(lq, lk, generator=g) > 0.5, kind == 1) | (torch.arange(lk) == 0)
    keep[:, 40:] = False  # key blocks no query sees: dK = dV = 0 there
    mask = (
        keep
        if mask_kind == "bool"
        else torch.where(keep, torch.randn(lq, lk, generator=g), torch.tensor(float("-inf"))).to(dtype)
    )
    q, k, v = (
        randn(gen, 1, 2, lq, 32, dtype=dtype),
        randn(gen, 1, 2, lk, 32, dtype=dtype),
        randn(gen, 1, 2, lk, 32, dtype=dtype),
    )
    dout = randn(gen, 1, 2, lq, 32, dtype=dtype)
    for m in (mask, mask.t().contiguous().t()):
        attention = masked(m)
        attention.ours = False
        golden = sdpa_gradients(q.double(), k.double(), v.double(), dout.double(), False, attention=attention)
        reference = sdpa_gradients(q, k, v, dout, False, attention=attention)
        attention.ours = True
        actual = sdpa_gradients(q, k, v, dout, False, attention=attention)
        for name, a, gd, r in zip(("dq", "dk", "dv"), actual, golden, reference):
            error, reference_error = max_error(a, gd), max_error(r, gd)
            assert error <= max(1e-5, FUDGE[name] * reference_error), (name, error, reference_error)
        assert (actual[1][:, :, 40:] == 0).all() and (actual[2][:, :, 40:] == 0).all()
