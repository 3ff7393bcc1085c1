"""The prefill forward on Metal 4 tensor operations (kernel="tensor", metal/fa_forward_tensor.h) on the
CPU Metal device: parity against float64 by the project's rule in float16 and bfloat16, at head
dims 64, 128 and a padded one (80 beside Ev 48: width 96), with causal and windows, bool and
additive masks (rows that see no key), softcap, ALiBi, sinks, GQA, the log-sum-exp, packed
sequences, a paged cache and quantized K/V; under the emulated Apple10 lane layout here and under
the scrambled layout (a rule of no GPU) in child processes with two seeds, so a kernel that
assumed a layout would fail (the first of them also plans for Apple10, where "auto" takes the path,
and checks its outputs and the gradients from them). Also: the planner's rule (AUTO takes the path
only on Apple10), explain_plan's view of it and its cost, and the clear errors of kernel="tensor"
for what it does not take."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from flashattn_mps import _C, explain_plan, flash_attention, quantize_kv
from flashattn_mps._core import run_forward, sequence_args
from flashattn_mps._options import AttentionOptions
from helpers import check, check_packed, max_error, packed_inputs, prefix_sums, randn, sdpa, sdpa_inputs

DTYPES = [torch.float16, torch.bfloat16]


def tensor_plan(*args, **kwargs):
    [d] = explain_plan(*args, kernel="tensor", **kwargs)["dispatches"]
    assert d["function"].startswith("fa_forward_tensor_"), d["function"]
    return d


# Each case runs the tensor kernel once and checks it; the same list runs under every layout.
def case_plain(gen, dtype, e, causal):
    q, k, v = sdpa_inputs(gen, 1, 4, 2, 100, 130, e, e, dtype)
    out = flash_attention(q, k, v, causal=causal, kernel="tensor")
    check(out, (q, k, v), causal=causal)


def case_nan(gen, dtype):
    """A NaN in one query row makes that row NaN and no other (SDPA's rule), causal."""
    q, k, v = sdpa_inputs(gen, 1, 2, 2, 70, 70, 128, 128, dtype)
    q[0, 1, 33, 5] = float("nan")
    out = flash_attention(q, k, v, causal=True, kernel="tensor")
    assert out[0, 1, 33].isnan().all() and out.isnan().sum() == 128
    check(out, (q, k, v), causal=True)


def case_padded_width(gen, dtype):
    q, k, v = sdpa_inputs(gen, 2, 2, 1, 70, 45, 80, 48, dtype)
    assert tensor_plan(q, k, v)["macros"]["FA_BD"] == "96"
    check(flash_attention(q, k, v, kernel="tensor"), (q, k, v))


def case_variants(gen, dtype):
    """Bottom-right causal with a window, softcap and per-(batch, head) ALiBi; then sinks."""
    q, k, v = sdpa_inputs(gen, 2, 4, 2, 75, 90, 64, 64, dtype, q_scale=4.0)
    alibi = torch.rand(2, 4, generator=gen) * 0.5
    options = dict(causal=True, bottom_right=True, window=(20, -1), softcap=2.0, alibi=alibi)
    out = flash_attention(
        q, k, v, causal="bottom_right", window_size=(20, -1), softcap=2.0, alibi_slopes=alibi, kernel="tensor"
    )
    check(out, (q, k, v), **options)
    sinks = torch.randn(4, generator=gen)
    out = flash_attention(q, k, v, window_size=(7, 3), sinks=sinks, kernel="tensor")
    check(out, (q, k, v), window=(7, 3), sinks=sinks)


def check_masked(out, q, k, v, mask):
    """The project's rule against SDPA's float64 math with the mask (rows that see no key: zeros)."""
    golden = sdpa(*(t.double() for t in (q, k, v)), attn_mask=mask)
    error, reference_error = max_error(out, golden), max_error(sdpa(q, k, v, attn_mask=mask), golden)
    assert error <= max(1e-5, 5 * reference_error), (error, reference_error)


def case_masks(gen, dtype):
    """A broadcast bool mask and a float one; rows 3 and 40 see no key (zeros)."""
    q, k, v = sdpa_inputs(gen, 2, 2, 2, 66, 80, 128, 128, dtype)
    keep = torch.rand(2, 1, 66, 80, generator=gen) > 0.3
    keep[:, :, 3] = False
    out = flash_attention(q, k, v, attn_mask=keep, kernel="tensor")
    check_masked(out, q, k, v, keep)
    assert (out[:, :, 3] == 0).all()
    additive = torch.randn(66, 80, generator=gen) * 2
    additive[40] = float("-inf")
    additive[:, 70:] = float("-inf")
    out = flash_attention(q, k, v, attn_mask=additive, kernel="tensor")
    check_masked(out, q, k, v, additive)
    assert (out[:, :, 40] == 0).all()


def case_lse(gen, dtype):
    q, k, v = sdpa_inputs(gen, 1, 4, 1, 90, 70, 64, 64, dtype)
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True, kernel="tensor")
    scores = (q.double() @ k.double().transpose(-1, -2)) / 8.0
    scores = scores.masked_fill(torch.ones(90, 70, dtype=torch.bool).tril().logical_not(), float("-inf"))
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), rtol=1e-5, atol=2e-3)
    check(out, (q, k, v), causal=True)


def case_varlen(gen, dtype):
    """Packed sequences through the sequence table, bottom-right causal; one empty sequence."""
    lens_q, lens_k = [70, 0, 9, 20], [90, 5, 9, 130]
    q, k, v = packed_inputs(gen, lens_q, lens_k, 4, 2, 64, 64, dtype)
    cq, ck = prefix_sums(lens_q), prefix_sums(lens_k)
    zeros = torch.zeros(4, dtype=torch.int32)
    table = torch.stack([zeros, cq[:-1], cq.diff(), zeros, ck[:-1], ck.diff()], 1).contiguous()
    out = torch.full((q.shape[0], 4, 64), float("nan"), dtype=dtype)
    views = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v, out)]
    options = AttentionOptions(0.125, True, (1, -1, -1), kernel=_C.KERNEL_TENSOR)
    run_forward(*views, None, options, sequence_args(table, max(lens_q), max(lens_k)))
    check_packed(out, (q, k, v), lens_q, lens_k, causal=True, scale=0.125)


def case_paged(gen, dtype):
    """K and V in pages of 16 rows of a pool, read through a shuffled block table."""
    b, l, hq, hkv, e, page, pages = 2, 40, 4, 2, 64, 16, 5
    keys = [70, 33]
    pool_k = randn(gen, b * pages, page, hkv, e, dtype=dtype)
    pool_v = randn(gen, b * pages, page, hkv, e, dtype=dtype)
    block_table = torch.randperm(b * pages, generator=gen).int().view(b, pages).contiguous()
    q = randn(gen, b, l, hq, e, dtype=dtype)
    out = torch.full((b, l, hq, e), float("nan"), dtype=dtype)
    zeros = torch.zeros(b, dtype=torch.int32)
    table = torch.stack(
        [torch.arange(b, dtype=torch.int32), zeros, zeros + l, zeros, zeros, torch.tensor(keys).int()], 1
    )
    views = [t.transpose(1, 2) for t in (q, pool_k, pool_v, out)]
    options = AttentionOptions(0.125, True, (1, -1, -1), kernel=_C.KERNEL_TENSOR)
    run_forward(*views, None, options, sequence_args(table.contiguous(), l, pages * page, block_table))
    for i in range(b):
        k = pool_k[block_table[i].long()].flatten(0, 1)[: keys[i]].transpose(0, 1)[None]
        v = pool_v[block_table[i].long()].flatten(0, 1)[: keys[i]].transpose(0, 1)[None]
        check(
            out[i : i + 1].transpose(1, 2),
            (q[i : i + 1].transpose(1, 2), k, v),
            causal=True,
            bottom_right=True,
            scale=0.125,
        )


def case_quantized(gen, dtype):
    q = randn(gen, 1, 4, 50, 64, dtype=dtype) * 2
    kq = quantize_kv(randn(gen, 1, 2, 77, 64, dtype=dtype), bits=8, group_size=32)
    vq = quantize_kv(randn(gen, 1, 2, 77, 64, dtype=dtype), bits=4, group_size=64)
    out = flash_attention(q, kq, vq, causal="bottom_right", kernel="tensor")
    check(out, (q, kq.dequantize(), vq.dequantize()), causal=True, bottom_right=True)


CASES = {
    **{
        f"plain-{str(dtype)[6:]}-{e}-{'causal' if causal else 'full'}": (case_plain, dtype, e, causal)
        for dtype in DTYPES
        for e, causal in ((64, False), (128, True))
    },
    "padded-float16": (case_padded_width, torch.float16),
    "nan-float16": (case_nan, torch.float16),
    **{f"variants-{str(dtype)[6:]}": (case_variants, dtype) for dtype in DTYPES},
    **{f"masks-{str(dtype)[6:]}": (case_masks, dtype) for dtype in DTYPES},
    "lse-bfloat16": (case_lse, torch.bfloat16),
    "varlen-float16": (case_varlen, torch.float16),
    "paged-bfloat16": (case_paged, torch.bfloat16),
    "quantized-float16": (case_quantized, torch.float16),
}


def run_case(name):
    fn, *args = CASES[name]
    fn(torch.Generator().manual_seed(sum(map(ord, name))), *args)


@pytest.mark.parametrize("name", list(CASES))
def test_tensor_forward_matches_float64(name):
    run_case(name)


def test_tensor_forward_runs_clean_in_checked_mode(checked_core):
    """No threadgroup race (the rows' statistics have one writer per word), uninitialised read or
    out-of-bounds access, with a band, partial tiles and GQA."""
    run_case("plain-float16-128-causal")
    assert checked_core() > 0


def auto_planned_for_apple10():
    """With FLASHATTN_MPS_GPU_FAMILY=apple10 the CPU device plans for an M5: "auto" takes the tensor
    path for prefill, and its outputs and the gradients computed from them (and from its lse) match
    float64 (test_gpu_family's check)."""
    import test_gpu_family

    q = torch.empty(1, 2, 70, 64, dtype=torch.float16)
    assert explain_plan(q, q, q, causal=True)["dispatches"][0]["function"] == "fa_forward_tensor_half"
    gen = torch.Generator().manual_seed(5)
    for dtype, e in ((torch.float16, 64), (torch.bfloat16, 64), (torch.float16, 128)):
        test_gpu_family.assert_matches_sdpa(dtype, e, gen)


CHILD = """
import os
import test_tensor_forward as t
for name in t.CASES:
    t.run_case(name)
if os.environ.get("FLASHATTN_MPS_GPU_FAMILY") == "apple10":
    t.auto_planned_for_apple10()
print("ok")
"""
SEEDS = ["11", "2026"]


@pytest.fixture(scope="module", autouse=True)
def scrambled_runs(request):
    """The cases in processes whose cooperative tensors are laid out by the scrambled rule (fresh
    processes: the device reads the layout once), one per seed, started with the module so they run
    beside its other tests; {seed: process}, empty when no scrambled test is selected."""
    if not any("scrambled_layout" in item.name for item in request.session.items):
        yield {}
        return
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")])
    runs = {
        seed: subprocess.Popen(
            [sys.executable, "-c", CHILD],
            env=dict(
                os.environ,
                FLASHATTN_MPS_CPU_TENSOR_LAYOUT="scrambled",
                FLASHATTN_MPS_CPU_TENSOR_LAYOUT_SEED=seed,
                PYTHONPATH=path,
                **({"FLASHATTN_MPS_GPU_FAMILY": "apple10"} if seed == SEEDS[0] else {}),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in SEEDS
    }
    yield runs
    for run in runs.values():
        if run.poll() is None:
            run.kill()
            run.communicate()


@pytest.mark.parametrize("seed", SEEDS)
def test_every_case_under_the_scrambled_layout(scrambled_runs, seed):
    """The same cases under the scrambled layout of this seed: a kernel that assumed a layout would
    fail here. The first seed's process also plans for Apple10 (auto_planned_for_apple10)."""
    out, err = scrambled_runs[seed].communicate()
    assert scrambled_runs[seed].returncode == 0 and out.strip() == "ok", err[-3000:]


def test_auto_takes_the_tensor_path_only_on_apple10():
    q = torch.empty(1, 8, 256, 128, dtype=torch.float16)
    for gpu in ("apple7", "apple8", "apple9"):
        assert explain_plan(q, q, q, gpu=gpu)["dispatches"][0]["function"] == "fa_forward_half"
    plan = explain_plan(q, q, q, gpu="apple10")
    [d] = plan["dispatches"]
    assert d["function"] == "fa_forward_tensor_half" and d["macros"]["FA_LANGUAGE_VERSION"] == "400"
    assert d["macros"]["FA_BD"] == "128" and d["threadgroup"] == (128, 1, 1) and d["grid"][0] == 256 // 64
    cost = d["cost"]
    assert cost["registers"] == 120 and cost["threadgroup_bytes"] == 64 * 136 * 2 + 4 * 64 * 4
    assert cost["flops"] == cost["useful_flops"]  # D = 128 and L, S multiples of the tiles: no padding
    assert 0 < d["estimate"]["fraction_of_peak"] <= 1
    # what the path does not take stays on the simdgroup kernel under AUTO
    for args, kwargs in (
        ((q.float(), q.float(), q.float()), {}),
        ((torch.empty(1, 8, 256, 256, dtype=torch.float16),) * 3, {}),
        ((q, q, q), {"dropout_p": 0.1}),
    ):
        assert explain_plan(*args, gpu="apple10", **kwargs)["dispatches"][0]["function"].startswith("fa_forward_")
        assert "tensor" not in explain_plan(*args, gpu="apple10", **kwargs)["dispatches"][0]["function"]
    short = torch.empty(1, 8, 8, 128, dtype=torch.float16)
    assert explain_plan(short, q, q, gpu="apple10")["dispatches"][0]["function"] == "fa_decode_half"


def test_tensor_kernel_names_what_it_does_not_take(gen):
    q, k, v = sdpa_inputs(gen, 1, 2, 2, 20, 20, 64, 64, torch.float32)
    with pytest.raises(ValueError, match="kernel='tensor'.*float32"):
        flash_attention(q, k, v, kernel="tensor")
    q, k, v = sdpa_inputs(gen, 1, 2, 2, 20, 20, 160, 64, torch.float16)
    with pytest.raises(ValueError, match="kernel='tensor'.*head dims E or Ev above 128"):
        flash_attention(q, k, v, kernel="tensor")
    q, k, v = sdpa_inputs(gen, 1, 2, 2, 20, 20, 64, 64, torch.float16)
    with pytest.raises(ValueError, match="kernel='tensor'.*dropout_p"):
        flash_attention(q, k, v, kernel="tensor", dropout_p=0.2)
    with pytest.raises(ValueError, match="kernel must be one of"):
        flash_attention(q, k, v, kernel="tensors")
