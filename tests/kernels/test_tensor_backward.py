"""The backward on Metal 4 tensor operations (dK/dV and dQ on matmul2d, metal/fa_backward_tensor.h)
on the CPU Metal device: gradients against float64 by the project's rule in float16 and bfloat16,
through autograd after the tensor forward, at head dims 64, 128 and padded ones (80 beside Ev 48),
with causal and windows, bool and additive masks (rows that see no key), softcap, ALiBi, sinks
(and their gradient), GQA, strided inputs and an expanded dout, packed sequences (through the core
entry). Differentiable calls take kernel="auto", so the cases run in child processes planning for
Apple10 (FLASHATTN_MPS_GPU_FAMILY=apple10: AUTO then takes both tensor kernels, which each case
checks in its plan), under the emulated Apple10 lane layout and under the scrambled layout (a rule
of no GPU) with two seeds, so a kernel that assumed a layout would fail. Also: two runs give
bit-identical gradients, the kernels run clean in the device's checked mode, the planner's rule
(AUTO takes the path where it takes the tensor forward), explain_plan's view of it, and the errors
of kernel="tensor" for what it does not take."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from flashattn_mps import _C, explain_plan, flash_attention
from flashattn_mps import metal_cpu as mc
from flashattn_mps._core import backward_core, dropout_rng_state, run_forward, sequence_args
from flashattn_mps._options import AttentionOptions
from helpers import (
    assert_gradients_match,
    packed_inputs,
    per_sequence_reference,
    prefix_sums,
    randn,
    reference,
    sdpa,
    sdpa_inputs,
)

DTYPES = [torch.float16, torch.bfloat16]


def tensor_backward_plan(*args, **kwargs):
    """The backward plan AUTO makes in the child processes (planning for Apple10): the tensor kernels."""
    dispatches = explain_plan(*args, backward=True, **kwargs)["dispatches"]
    names = [d["function"] for d in dispatches]
    assert [n.rsplit("_", 1)[0] for n in names] == [
        "fa_backward_delta",
        "fa_backward_tensor_dkdv",
        "fa_backward_tensor_dq",
    ]
    return dispatches


def check_gradients(gen, tensors, dout=None, leaves=3, golden=None, **options):
    """Gradients of flash_attention against the float64 reference by the project's rule; `leaves`
    of the tensors (q, k, v[, sinks]) get gradients, the options are flash_attention's and
    `options["reference"]` the reference's (helpers.reference), or `golden` the reference."""
    ref_options = options.pop("reference", {})
    grads_of = [t.detach().clone().requires_grad_() for t in tensors[:leaves]]
    out = flash_attention(*grads_of[:3], **options, **sink_option(grads_of))
    if dout is None:
        dout = randn(gen, *out.shape, dtype=out.dtype)
    grads = torch.autograd.grad(out, grads_of, dout)
    if golden is None:
        golden = lambda *t: reference(*t[:3], **ref_options, **sink_option(t))  # noqa: E731
    assert_gradients_match(grads, golden, tensors[:leaves], dout)
    return grads


def sink_option(leaves):
    return {"sinks": leaves[3]} if len(leaves) > 3 else {}


# Each case runs the tensor backward and checks it; the same list runs under every layout.
def case_plain(gen, dtype, e, causal):
    q, k, v = sdpa_inputs(gen, 1, 4, 2, 100, 130, e, e, dtype)
    tensor_backward_plan(q, k, v, causal=causal)
    check_gradients(gen, (q, k, v), causal=causal, reference=dict(causal=causal))


def case_padded_widths(gen, dtype):
    q, k, v = sdpa_inputs(gen, 2, 2, 1, 70, 45, 80, 48, dtype)
    _, dkdv, dq = tensor_backward_plan(q, k, v)
    assert dkdv["macros"]["FA_BD"] == dq["macros"]["FA_BD"] == "96"  # the tensor forward's width
    check_gradients(gen, (q, k, v))


def case_variants(gen, dtype):
    """Bottom-right causal with a window, softcap and per-(batch, head) ALiBi; then sinks, whose
    gradient is checked too."""
    q, k, v = sdpa_inputs(gen, 2, 4, 2, 75, 90, 64, 64, dtype, q_scale=4.0)
    alibi = torch.rand(2, 4, generator=gen) * 0.5
    tensor_backward_plan(q, k, v, causal="bottom_right", window_size=(20, -1), softcap=2.0, alibi_slopes=alibi)
    check_gradients(
        gen,
        (q, k, v),
        causal="bottom_right",
        window_size=(20, -1),
        softcap=2.0,
        alibi_slopes=alibi,
        reference=dict(causal=True, bottom_right=True, window=(20, -1), softcap=2.0, alibi=alibi),
    )
    sinks = torch.randn(4, generator=gen)
    check_gradients(gen, (q, k, v, sinks), leaves=4, window_size=(7, 3), reference=dict(window=(7, 3)))


def masked_sdpa(mask):
    """SDPA's math with the mask, rows that see no key giving zeros (helpers.sdpa)."""
    return lambda q, k, v: sdpa(q, k, v, attn_mask=mask if q.dtype != torch.float64 else mask.double())


def case_masks(gen, dtype):
    """A broadcast bool mask and a float one; row 3 and row 40 see no key (zero gradients)."""
    q, k, v = sdpa_inputs(gen, 2, 2, 2, 66, 80, 128, 128, dtype)
    keep = torch.rand(2, 1, 66, 80, generator=gen) > 0.3
    keep[:, :, 3] = False
    tensor_backward_plan(q, k, v, attn_mask=keep)
    dq, _, _ = check_gradients(gen, (q, k, v), attn_mask=keep, golden=masked_sdpa(keep))
    assert (dq[:, :, 3] == 0).all()
    additive = torch.randn(66, 80, generator=gen) * 2
    additive[40] = float("-inf")
    additive[:, 70:] = float("-inf")
    dq, dk, _ = check_gradients(gen, (q, k, v), attn_mask=additive, golden=masked_sdpa(additive))
    assert (dq[:, :, 40] == 0).all() and (dk[:, :, 70:] == 0).all()


def case_strides(gen, dtype):
    """q and k with the head dim strided (read element by element), v sequence-major, and dout
    expanded from a sum (every stride 0)."""
    q = randn(gen, 1, 4, 64, 50, dtype=dtype).transpose(-1, -2)  # (1, 4, 50, 64), head-dim stride 50
    k = randn(gen, 1, 64, 2, 60, dtype=dtype).permute(0, 2, 3, 1)
    v = randn(gen, 1, 60, 2, 64, dtype=dtype).transpose(1, 2)
    dout = torch.ones((), dtype=dtype).expand(1, 4, 50, 64)
    tensor_backward_plan(q, k, v, causal=True)
    check_gradients(gen, (q, k, v), dout=dout, causal=True, reference=dict(causal=True))


def case_varlen(gen, dtype):
    """Packed sequences through the sequence table (bottom-right causal, one empty sequence): the
    tensor forward, then the tensor backward, through the core entry the autograd functions use."""
    lens_q, lens_k = [70, 0, 9, 20], [90, 5, 9, 130]
    q, k, v = packed_inputs(gen, lens_q, lens_k, 4, 2, 64, 64, dtype)
    dout = randn(gen, q.shape[0], 4, 64, dtype=dtype)
    cq, ck = prefix_sums(lens_q), prefix_sums(lens_k)
    zeros = torch.zeros(4, dtype=torch.int32)
    table = torch.stack([zeros, cq[:-1], cq.diff(), zeros, ck[:-1], ck.diff()], 1).contiguous()
    sequences = sequence_args(table, max(lens_q), max(lens_k))
    options = AttentionOptions(0.125, True, (1, -1, -1), kernel=_C.KERNEL_TENSOR)
    out = torch.empty(q.shape[0], 4, 64, dtype=dtype)
    lse = torch.empty(1, 4, q.shape[0], dtype=torch.float32)
    views = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v, out, dout)]
    run_forward(*views[:4], lse, options, sequences)
    grads = backward_core(views[4], *views[:4], lse, None, options, sequences=sequences)
    grads = [g[0].transpose(0, 1) for g in grads]
    assert_gradients_match(
        grads,
        lambda *t: per_sequence_reference(*t, lens_q, lens_k, causal=True, scale=0.125),
        (q, k, v),
        dout,
    )


CASES = {
    "plain-float16-64-full": (case_plain, torch.float16, 64, False),
    "plain-bfloat16-128-causal": (case_plain, torch.bfloat16, 128, True),
    "padded-bfloat16": (case_padded_widths, torch.bfloat16),
    **{f"variants-{str(dtype)[6:]}": (case_variants, dtype) for dtype in DTYPES},
    "masks-float16": (case_masks, torch.float16),
    "strides-bfloat16": (case_strides, torch.bfloat16),
    "varlen-float16": (case_varlen, torch.float16),
}


def run_case(name):
    fn, *args = CASES[name]
    fn(torch.Generator().manual_seed(sum(map(ord, name))), *args)


def two_runs_give_identical_gradients():
    """Deterministic: each SIMD-group sums its own rows in a fixed order (GQA: over every query head
    of its kv head), no atomics."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = sdpa_inputs(gen, 1, 6, 2, 90, 110, 64, 32, torch.float16)
    dout = randn(gen, 1, 6, 90, 32, dtype=torch.float16)
    tensor_backward_plan(q, k, v, causal=True)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        runs.append(torch.autograd.grad(flash_attention(*leaves, causal=True), leaves, dout))
    for first, second in zip(*runs):
        assert torch.equal(first, second)


CHILD = """
import sys
import test_tensor_backward as t
for name in t.CASES:
    t.run_case(name)
    print(name, file=sys.stderr)
t.two_runs_give_identical_gradients()
print("ok")
"""


@pytest.mark.parametrize(
    "layout, seed", [("family", ""), ("scrambled", "11"), pytest.param("scrambled", "2026", marks=pytest.mark.slow)]
)
def test_every_case_in_a_process_planning_for_apple10(layout, seed):
    """Every case, and the determinism check, in a process planning for Apple10 whose cooperative
    tensors are laid out as Apple10's or by the scrambled rule (a fresh process: the planner's
    family and the device's layout are read once)."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(
        os.environ,
        FLASHATTN_MPS_GPU_FAMILY="apple10",
        FLASHATTN_MPS_CPU_GPU_FAMILY="apple10",
        FLASHATTN_MPS_CPU_TENSOR_LAYOUT=layout,
        FLASHATTN_MPS_CPU_TENSOR_LAYOUT_SEED=seed,
        PYTHONPATH=os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")]),
    )
    run = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_auto_takes_the_tensor_backward_where_it_takes_the_tensor_forward():
    q = torch.empty(1, 8, 256, 128, dtype=torch.float16)
    names = lambda plan: [d["function"] for d in plan["dispatches"]]  # noqa: E731
    for gpu in ("apple7", "apple8", "apple9"):
        assert names(explain_plan(q, q, q, backward=True, gpu=gpu)) == [
            "fa_backward_delta_half",
            "fa_backward_dkdv_half",
            "fa_backward_dq_half",
        ]
    _, dkdv, dq = explain_plan(q, q, q, backward=True, gpu="apple10")["dispatches"]
    assert (dkdv["function"], dq["function"]) == ("fa_backward_tensor_dkdv_half", "fa_backward_tensor_dq_half")
    for d, heads in ((dkdv, 8), (dq, 8)):
        assert d["macros"]["FA_LANGUAGE_VERSION"] == "400" and d["macros"]["FA_BD"] == "128"
        assert d["threadgroup"] == (128, 1, 1) and d["grid"] == (256 // 64, heads, 1)
        assert d["cost"]["flops"] == d["cost"]["useful_flops"]  # D = 128, L and S multiples of the tiles
        assert d["cost"]["threadgroup_bytes"] > 64 * 136 * 2 and 0 < d["estimate"]["fraction_of_peak"] <= 1
    # what the path does not take stays on the simdgroup kernels under AUTO
    for args, kwargs in (
        ((q.float(), q.float(), q.float()), {}),
        ((torch.empty(1, 8, 256, 160, dtype=torch.float16),) * 3, {}),
        ((q, q, q), {"dropout_p": 0.1}),
    ):
        assert not any("tensor" in n for n in names(explain_plan(*args, backward=True, gpu="apple10", **kwargs)))


def test_tensor_backward_names_what_it_does_not_take(gen):
    """The forward refuses first through flash_attention; the backward's own refusal, reached through
    the core entry with the simdgroup forward's out and lse."""
    for dtype, e, dropout_p, match in (
        (torch.float32, 64, 0.0, "float32"),
        (torch.float16, 160, 0.0, "head dims E or Ev above 128"),
        (torch.float16, 64, 0.3, "dropout_p"),
    ):
        q, k, v = sdpa_inputs(gen, 1, 2, 2, 20, 20, e, e, dtype)
        out, lse = flash_attention(q, k, v, return_lse=True)
        options = AttentionOptions(e**-0.5, False, dropout_p=dropout_p, kernel=_C.KERNEL_TENSOR)
        with pytest.raises(ValueError, match=f"kernel='tensor': the tensor-path backward does not take .*{match}"):
            backward_core(torch.ones_like(out), q, k, v, out, lse, None, options, dropout_rng_state(q.device))


def test_tensor_backward_runs_clean_in_checked_mode(checked_core):
    """The staging and streamed tiles, their barriers and the gradients' copy-out under the CPU
    device's checked mode (threadgroup races, uninitialised reads, out-of-bounds accesses): nothing
    reported, and the same bits as unchecked. Through the core entry with the simdgroup forward's lse
    (AUTO plans for Apple9 here)."""
    gen = torch.Generator().manual_seed(12)
    q, k, v = sdpa_inputs(gen, 1, 4, 2, 70, 45, 80, 48, torch.float16)
    dout = randn(gen, 1, 4, 70, 48, dtype=torch.float16)
    keep = torch.rand(70, 45, generator=gen) > 0.2
    options = AttentionOptions(80**-0.5, False)
    out, lse = flash_attention(q, k, v, attn_mask=keep, return_lse=True)
    mask = keep.expand(1, 4, 70, 45)
    tensor = options._replace(kernel=_C.KERNEL_TENSOR)
    checked = backward_core(dout, q, k, v, out, lse, mask, tensor)
    assert checked_core() >= 3  # the delta pre-pass, dK/dV and dQ
    mc.set_checked(False)
    for got, want in zip(checked, backward_core(dout, q, k, v, out, lse, mask, tensor)):
        assert torch.equal(got, want)
