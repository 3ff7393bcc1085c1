"""Helpers shared by the tests (imported as `helpers`; tests/conftest.py holds the fixtures): the
float64 SDPA golden and PyTorch's tolerance rule, inputs in every memory layout, fixed samples of
parameter products, peak memory in a fresh process, the float64 references of flash-attn's options
(bands, softcap, ALiBi, sinks, dropout), packed sequences, and the kernel sources as the compiler
sees them."""

from __future__ import annotations

import itertools
import json
import random
import re
import subprocess
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashattn_mps import _C, _metal_cpu, _sources, strict_check
from flashattn_mps._metal_mode import torch_version_tuple
from flashattn_mps._sdpa import torch_sdpa

TORCH_VERSION = torch_version_tuple(torch.__version__)  # (2, 4) for torch 2.4.0


def needs_torch_2_6(package: str) -> None:
    """Skips the calling test (or, before its imports, the test module) on torch < 2.6: the tested
    transformers 5.24.0 and diffusers 0.42.1 declare torch >= 2.6 and do not import on torch 2.4
    (diffusers uses torch.accelerator; transformers' masks import torch._dynamo helpers torch 2.4
    lacks), so with the oldest admitted torch there is no release of theirs to test against."""
    if TORCH_VERSION < (2, 6):
        pytest.skip(
            f"{package} as tested (transformers 5.24.0, diffusers 0.42.1) needs torch >= 2.6, "
            f"not torch {torch.__version__}",
            allow_module_level=True,
        )


def sdpa(q, k, v, causal=False, scale=None, attn_mask=None):
    """The reference of sdpa_rows_without_keys_zero with SDPA's positional causal and scale, GQA
    on (torch_sdpa gives torch 2.4, which has no enable_gqa, the same GQA)."""
    return sdpa_rows_without_keys_zero(q, k, v, attn_mask=attn_mask, is_causal=causal, scale=scale, enable_gqa=True)


def sdpa_rows_without_keys_zero(q, k, v, attn_mask=None, **options):
    """torch's SDPA (torch_sdpa's arguments) through its math backend, as PyTorch's own tests take
    their reference (torch 2.13's default CPU kernel returns NaN for causal rows with a negative
    scale; torch 2.4's for rows of a float mask whose block of keys is all -inf), with the
    project's rule for a query row whose mask keeps no key: output 0 and no gradient through that
    row. torch >= 2.5 does the same; torch 2.4 gives NaN there (and NaN gradients for every key),
    so such a row is computed unmasked and zeroed. float16 and bfloat16 are computed in float32 and
    rounded, which is what torch >= 2.5's math backend does on the CPU (the same bits); torch 2.4's
    computes in float16, whose scores overflow where the kernels' do not."""

    def attend(mask):
        if q.dtype not in (torch.float16, torch.bfloat16):
            return torch_sdpa(q, k, v, attn_mask=mask, **options)
        wide = None if mask is None or mask.dtype == torch.bool else mask.float()
        return torch_sdpa(q.float(), k.float(), v.float(), attn_mask=mask if wide is None else wide, **options).to(
            q.dtype
        )

    with sdpa_kernel(SDPBackend.MATH):
        if attn_mask is None:
            return attend(None)
        keeps = attn_mask if attn_mask.dtype == torch.bool else attn_mask != float("-inf")
        no_key = ~keeps.any(-1, keepdim=True)
        if not no_key.any():
            return attend(attn_mask)
        opened = attn_mask | no_key if attn_mask.dtype == torch.bool else attn_mask.masked_fill(no_key, 0.0)
        return torch.where(no_key, 0.0, attend(opened))


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
    return base[1:, 1:, 2 : n + 2, 3 : d + 3]


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
    return (
        layout_tensor(gen, layout, 1, hkv * gqa, lq, e, dtype),
        layout_tensor(gen, layout, 1, hkv, lk, e, dtype),
        layout_tensor(gen, layout, 1, hkv, lk, ev, dtype),
    )


# PyTorch's rule for gradients (test_transformers.py): error vs a float64 golden <= max(1e-5,
# fudge x the error of torch's SDPA autograd in the same dtype), for every dtype. PyTorch allows dQ
# 180 for half types; ours accumulates dQ in float32 registers and its half-type errors measure
# within 1.8x of the reference's over this sample (dK 1.6x, dV 1.0x; float32 up to 2.9x, far under
# the 1e-5 floor), so 16 keeps a wide margin and still catches a precision regression.
FUDGE = {"dq": 16.0, "dk": 16.0, "dv": 4.0}


# flash-attn's options: float64 references on materialised scores, and the sampled cases.
def visible(l, s, causal, bottom_right, window, device="cpu"):
    """(L, S) bool: which keys each query sees (flash-attn's rule; the diagonal of row i is i + S - L
    when bottom_right, else i)."""
    i = torch.arange(l, device=device)[:, None]
    j = torch.arange(s, device=device)[None, :]
    diagonal = i + (s - l if bottom_right else 0)
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    keep = torch.ones(l, s, dtype=torch.bool, device=device)
    if left >= 0:
        keep &= j >= diagonal - left
    if right >= 0:
        keep &= j <= diagonal + right
    return keep


def variant_scores(q, k, causal=False, bottom_right=False, window=None, scale=None, softcap=0.0, alibi=None):
    """The scores (scaled, capped, ALiBi-biased, in q's dtype; SDPA layout, GQA by repeating k) and
    which keys each row sees under causal and the window."""
    hq, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // hkv, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi is not None:
        l, s = q.shape[2], k.shape[2]
        distance = (torch.arange(l)[:, None] + (s - l if bottom_right else 0) - torch.arange(s)[None, :]).abs()
        slopes = alibi.to(scores.dtype).expand(q.shape[0], hq)[:, :, None, None]
        scores = scores - slopes * distance.to(scores.dtype)
    return scores, visible(q.shape[2], k.shape[2], causal, bottom_right, window)


def reference(
    q,
    k,
    v,
    causal=False,
    bottom_right=False,
    window=None,
    scale=None,
    attn_mask=None,
    softcap=0.0,
    alibi=None,
    sinks=None,
    dropout_mask=None,
    dropout_p=0.0,
):
    """Attention in the inputs' dtype from materialised scores, SDPA layout (B, H, L, D), in
    flash-attn's order: scale, softcap, ALiBi (slopes (H,) or (B, H)), masks; rows that see no key
    give zeros. sinks (H,): one more logit per row, of no value, in the softmax (GPT-OSS's eager).
    dropout_mask (B, H, L, S) bool: the probabilities outside it are dropped, the others scaled by
    1 / (1 - dropout_p), as flash-attn's test reference does."""
    hq, hkv = q.shape[1], k.shape[1]
    v = v.repeat_interleave(hq // hkv, 1)
    scores, keep = variant_scores(q, k, causal, bottom_right, window, scale, softcap, alibi)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        keep = keep & attn_mask
    elif attn_mask is not None:
        scores = scores + attn_mask
    scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        column = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, column], -1)
    probs = torch.softmax(scores.float() if scores.dtype != torch.float64 else scores, -1).to(q.dtype)
    if sinks is not None:
        probs = probs[..., :-1]  # a row with no key has all its weight on the sink: zeros
    else:
        probs = probs.masked_fill(~keep.any(-1, keepdim=True), 0.0)  # no key: zeros
    if dropout_mask is not None:
        probs = probs.masked_fill(~dropout_mask, 0.0) / (1.0 - dropout_p)
    return probs @ v


def check(actual, inputs, factor=5.0, **options):
    """PyTorch's rule against the float64 reference: error <= max(1e-5, factor x the same-dtype
    reference's error)."""
    golden = reference(*[t.double() for t in inputs], **options)
    same_dtype = reference(*inputs, **options)
    assert actual.shape == golden.shape and actual.dtype == inputs[0].dtype
    error, reference_error = max_error(actual, golden), max_error(same_dtype, golden)
    assert error <= max(1e-5, factor * reference_error), (error, reference_error)


def sdpa_inputs(gen, b, hq, hkv, l, s, e, ev, dtype, q_scale=1.0):
    """q (B, Hq, L, E) scaled by q_scale, k (B, Hkv, S, E), v (B, Hkv, S, Ev): SDPA's layout."""
    return (
        randn(gen, b, hq, l, e, dtype=dtype) * q_scale,
        randn(gen, b, hkv, s, e, dtype=dtype),
        randn(gen, b, hkv, s, ev, dtype=dtype),
    )


def flash_inputs(gen, b, l, s, hq, hkv, e, ev, dtype):
    return (
        randn(gen, b, l, hq, e, dtype=dtype),
        randn(gen, b, s, hkv, e, dtype=dtype),
        randn(gen, b, s, hkv, ev, dtype=dtype),
    )


def sdpa_view(*tensors):
    return tuple(t.transpose(1, 2) for t in tensors)


# (causal, window, softcap, ALiBi slopes' shape): flash-attn's options, alone and together.
VARIANTS = [
    (True, (-1, -1), 0.0, None),
    (False, (5, 3), 0.0, None),
    (True, (7, -1), 0.0, None),
    (False, (-1, 0), 0.0, None),
    (False, (0, 0), 0.0, None),
    (False, (2, -1), 0.0, None),
    (True, (0, 4), 0.0, None),
    (False, (40, 40), 0.0, None),
    (False, (-1, -1), 0.7, None),
    (True, (-1, -1), 2.0, None),
    (False, (6, 1), 0.5, None),
    (True, (3, -1), 1.5, None),
    (False, (-1, -1), 0.0, "h"),
    (True, (-1, -1), 0.0, "bh"),
    (True, (9, -1), 1.0, "h"),
    (False, (4, 4), 0.0, "bh"),
]
LENGTHS = [(37, 53), (53, 37), (1, 40), (3, 70), (24, 24), (70, 9)]
KERNELS = ["auto", "forward", "decode", "simple"]


def slopes(gen, kind, b, h):
    """ALiBi slopes of the given shape kind, or None."""
    if kind is None:
        return None
    return torch.rand(*((h,) if kind == "h" else (b, h)), generator=gen) * 0.5


def forward_case(gen, lengths, variant, dtype):
    """q, k, v (B = 2, Hq = 4, Hkv = 2, E = 40, Ev = 24) and ALiBi slopes of one sampled forward case."""
    (l, s), alibi_kind = lengths, variant[3]
    q, k, v = flash_inputs(gen, 2, l, s, 4, 2, 40, 24, dtype)
    return q * 4, k, v, slopes(gen, alibi_kind, 2, 4)  # scores of several units, so the softcap bends them


# Packed sequences (flash_attn_varlen_func): each sequence against the reference on its own.
def prefix_sums(lengths):
    return torch.tensor([0] + torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)


def packed_inputs(gen, lens_q, lens_k, hq, hkv, e, ev, dtype):
    return (
        randn(gen, sum(lens_q), hq, e, dtype=dtype),
        randn(gen, sum(lens_k), hkv, e, dtype=dtype),
        randn(gen, sum(lens_k), hkv, ev, dtype=dtype),
    )


def pieces(t, cu, b):
    """Sequence b of a packed (total, H, D) tensor as a (1, H, L_b, D) SDPA view."""
    return t[int(cu[b]) : int(cu[b + 1])].transpose(0, 1).unsqueeze(0)


def per_sequence_reference(q, k, v, lens_q, lens_k, alibi=None, **options):
    """Each sequence on its own through reference (bottom-right), packed back."""
    cq, ck = prefix_sums(lens_q), prefix_sums(lens_k)
    outs = []
    for b in range(len(lens_q)):
        slope = None if alibi is None else (alibi if alibi.dim() == 1 else alibi[b])
        out = reference(pieces(q, cq, b), pieces(k, ck, b), pieces(v, ck, b), bottom_right=True, alibi=slope, **options)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs) if outs else q.new_empty(0, q.shape[1], v.shape[2])


def check_packed(actual, inputs, lens_q, lens_k, factor=5.0, **options):
    golden = per_sequence_reference(*[t.double() for t in inputs], lens_q, lens_k, **options)
    same_dtype = per_sequence_reference(*inputs, lens_q, lens_k, **options)
    assert actual.shape == golden.shape and actual.dtype == inputs[0].dtype
    error, reference_error = max_error(actual, golden), max_error(same_dtype, golden)
    assert error <= max(1e-5, factor * reference_error), (error, reference_error)


# The kernel sources as the compiler sees them, and their kernel definitions.
def preprocessed(source: str, macros: dict) -> str:
    clang = strict_check.find_clang()
    defines = [f"-D{k}={v}" for k, v in macros.items()]
    result = subprocess.run(
        [clang, *_metal_cpu.preprocessor_flags(), "-P", "-I", f"{_metal_cpu.shim_dir()}/include", *defines, "-"],
        input=_sources.kernel_sources()[source],
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout


DEFINITION = re.compile(
    r"template\s*<([^>]*)>\s*\[\[kernel,\s*max_total_threads_per_threadgroup\(([^)]*)\)\]\]"
    r"\s*void\s+(\w+)\s*\("
)


# Direct calls of the C layer: _C.forward / backward / plan_* take (device, tensors by slot name, options).
FORWARD_NAMES = ("q", "k", "v", "out", "lse")
BACKWARD_NAMES = ("q", "k", "v", "out", "lse", "dout", "delta", "dq", "dk", "dv")


def core_options(**fields) -> tuple:
    """A direct _C call's options tuple, in _C.OPTION_FIELDS' order: SDPA's defaults (scale 1) with
    these fields changed."""
    values = dict(
        scale=1.0,
        causal=False,
        bottom_right=False,
        window_left=-1,
        window_right=-1,
        softcap=0.0,
        dropout_p=0.0,
        kernel=_C.KERNEL_AUTO,
        num_splits=0,
        write_probs=False,
        max_q_len=0,
        max_kv_len=0,
        unbatched=False,
        diagonal_offset=0,
        k_bits=0,
        k_group_size=0,
        v_bits=0,
        v_group_size=0,
        gpu_family=0,
    )
    unknown = set(fields) - set(values)
    assert not unknown, f"not an option field: {unknown}"
    values.update(fields)
    return tuple(values[name] for name in _C.OPTION_FIELDS)


def slots(names, tensors, **more) -> dict:
    """The tensors dict of a direct _C call: the positional tensors under names, then more."""
    return {**dict(zip(names, tensors)), **more}
