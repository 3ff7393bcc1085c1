"""Shared helpers: the float64 SDPA golden and PyTorch's tolerance rule."""
from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def sdpa(q, k, v, causal=False, scale=None, attn_mask=None):
    """torch's SDPA through its math backend, as PyTorch's own tests take their reference: the
    default CPU kernel of torch 2.13 returns NaN for causal rows with a negative scale."""
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal, scale=scale,
                                              enable_gqa=True)


def max_error(actual: torch.Tensor, golden: torch.Tensor) -> float:
    """max |actual - golden| where both are finite; NaN/inf must sit at the same places."""
    a = actual.double()
    same_nonfinite = (a.isnan() == golden.isnan()).all() and (a.isinf() == golden.isinf()).all()
    assert same_nonfinite, "NaN/inf positions differ from the golden"
    finite = golden.isfinite()
    if not finite.any():
        return 0.0
    assert (a[golden.isinf()] == golden[golden.isinf()]).all()
    return (a[finite] - golden[finite]).abs().max().item()


def assert_gradients_match(grads, reference, inputs, dout, names="qkv", factor=5.0):
    """grads (of the kernels' out, against dout) beside the gradients of reference(*leaves) for
    fresh leaves made from the inputs, in float64 (golden) and in the inputs' dtype, by PyTorch's
    rule: error <= max(1e-5, factor x the same-dtype reference's error)."""
    def reference_grads(tensors):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        expected = reference(*leaves)
        return torch.autograd.grad(expected, leaves, dout.to(expected.dtype))

    golden = reference_grads([t.double() for t in inputs])
    same_dtype = reference_grads(inputs)
    for name, actual, want, near in zip(names, grads, golden, same_dtype):
        error, reference_error = max_error(actual, want), max_error(near, want)
        assert error <= max(1e-5, factor * reference_error), (f"d{name}", error, reference_error)


def assert_matches_sdpa(out, q, k, v, causal=False, scale=None, factor=5.0):
    """PyTorch's rule: error vs a float64 golden <= max(1e-5, factor x the error of torch's own SDPA
    in the same dtype)."""
    golden = sdpa(q.double(), k.double(), v.double(), causal, scale)
    reference = sdpa(q, k, v, causal, scale)
    assert out.shape == golden.shape, f"shape {tuple(out.shape)} != {tuple(golden.shape)}"
    assert out.dtype == q.dtype
    error = max_error(out, golden)
    reference_error = max_error(reference, golden)
    tolerance = max(1e-5, factor * reference_error)
    assert error <= tolerance, f"error {error:.3e} > tolerance {tolerance:.3e} (reference error {reference_error:.3e})"
    return error


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)


ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


LAYOUTS = ["bhld", "blhd", "sliced"]


def layout_tensor(gen, layout, b, h, n, d, dtype):
    """A (b, h, n, d) tensor in the given memory layout, never copied afterwards."""
    if layout == "bhld":
        return randn(gen, b, h, n, d, dtype=dtype)
    if layout == "blhd":
        return randn(gen, b, n, h, d, dtype=dtype).transpose(1, 2)
    base = randn(gen, b + 1, h + 1, n + 3, d + 5, dtype=dtype)  # sliced view with a storage offset
    return base[1:, 1:, 2:n + 2, 3:d + 3]


PEAK_RSS = """
import json, sys, torch
from flashattn_mps import flash_attention
{run}
run(64)  # compile/load, start the worker pool
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
base = rss("VmRSS:")
inputs = run(int(sys.argv[1]))
print(json.dumps({{"extra": rss("VmHWM:") - base, "inputs": inputs}}))
"""


def peak_memory_growth(run_source: str, n: int):
    """In a fresh process, after a warm-up run(64): how far run(n) raised the peak RSS (bytes), and
    the bytes of inputs and outputs run(n) reports. run_source defines run(n)."""
    script = PEAK_RSS.format(run=run_source)
    result = subprocess.run([sys.executable, "-c", script, str(n)], capture_output=True, text=True, check=True)
    measured = json.loads(result.stdout)
    return measured["extra"], measured["inputs"]


def sample_product(axes, count, seed, cost, per_value, max_cost):
    """A fixed sample of the product of `axes` (lists of values) for parametrised tests: for every
    value of every axis the cheapest of `per_value` random cases holding it, then random cases under
    `max_cost` up to `count`. Deterministic across processes (values are ordered by str)."""
    rng = random.Random(seed)
    full = list(itertools.product(*axes))
    chosen = []
    for axis in range(len(axes)):
        for value in sorted({c[axis] for c in full}, key=str):
            pool = [c for c in full if c[axis] == value]
            chosen.append(min(rng.sample(pool, min(per_value, len(pool))), key=cost))
    rest = [c for c in full if cost(c) < max_cost]
    chosen += rng.sample(rest, max(0, count - len(chosen)))
    return sorted(set(chosen), key=str)


def product_case_tensors(gen, lengths, e, gqa, dtype, layout, ev_differs):
    """q, k, v of one sampled case: batch 1, GQA ratio gqa (2 kv heads, 1 for ratio 8), Ev = 3/4 E
    when ev_differs, in the given memory layout."""
    (lq, lk), ev = lengths, (max(1, (e * 3) // 4) if ev_differs else e)
    hkv = 2 if gqa < 8 else 1
    return (layout_tensor(gen, layout, 1, hkv * gqa, lq, e, dtype), layout_tensor(gen, layout, 1, hkv, lk, e, dtype),
            layout_tensor(gen, layout, 1, hkv, lk, ev, dtype))


@pytest.fixture
def core_calls(monkeypatch):
    """Counts the C core's forward and backward calls: the proof that the kernels ran."""
    import flashattn_mps

    counts = {"forward": 0, "backward": 0, "masked": 0}  # masked: forward calls given an attn_mask
    for name in ("forward", "backward"):
        def counting(*args, _real=getattr(flashattn_mps._C, name), _name=name, **kwargs):
            counts[_name] += 1
            # _C.forward(device, tensors, options, workspace): tensors a dict slot name -> tensor
            mask = kwargs.get("tensors", args[1] if len(args) > 1 else {}).get("mask")
            counts["masked"] += _name == "forward" and mask is not None
            return _real(*args, **kwargs)

        monkeypatch.setattr(flashattn_mps._C, name, counting)
    return counts
