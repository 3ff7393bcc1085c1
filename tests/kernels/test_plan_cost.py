"""explain_plan's cost of each dispatch (threadgroup memory, registers, FLOPs with and without padding,
minimum device bytes) against figures computed by hand, and its threadgroup memory against the
kernel-scope arrays the kernel source declares."""

from __future__ import annotations

import re

import pytest
import torch

from flashattn_mps import (
    _C,
    _varlen,
    explain_kvcache_plan,
    explain_plan,
    explain_varlen_plan,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)
from flashattn_mps._options import AttentionOptions
from helpers import DEFINITION, preprocessed


def inputs(b, hq, hkv, lq, lk, e, ev, dtype):
    q = torch.empty(b, hq, lq, e, dtype=dtype)
    k = torch.empty(b, hkv, lk, e, dtype=dtype)
    v = torch.empty(b, hkv, lk, ev, dtype=dtype)
    return q, k, v


def costs(plan):
    return [d["cost"] for d in plan["dispatches"]]


def test_forward_causal_with_padded_head_dims():
    # E = Ev = 72 pad to 80 (but only 9 slices are multiplied); fp16 at 80: BK 32, 4 SIMD-groups (32 rows per block). L = 100, S = 70:
    # the blocks at rows 0, 32, 64, 96 load 1, 2, 3, 3 key tiles (their last row, capped at S).
    q, k, v = inputs(2, 4, 2, 100, 70, 72, 72, torch.float16)
    [cost] = costs(explain_plan(q, k, v, causal=True, kernel="forward"))
    assert cost == {
        "threadgroup_bytes": 32 * (80 + 8 + 80 + 8) * 2 + 2 * 4,  # K and V tiles (rows padded by 8), votes
        # Q (half: 1 register per fragment), O and S (float: 2) and one K/V fragment in flight
        "registers": 80 // 8 + 80 // 8 * 2 + 32 // 8 * 2 + 1,
        # the 8-wide slices holding data: 72 of the padded 80 (fa_slices in fa_fragments.h)
        "flops": 2 * (2 * 4) * 9 * (32 * 32 * (72 + 72)),
        "tiles": (2 * 4) * 9,  # the key tiles visited: 1 + 2 + 3 + 3 per head
        # visible pairs per head: rows 0..69 see i + 1 keys, rows 70..99 all 70
        "useful_flops": 2 * (72 + 72) * (2 * 4) * (70 * 71 // 2 + 30 * 70),
        "min_bytes_read": 2 * 4 * 100 * 72 * 2 + 2 * 2 * 70 * (72 + 72) * 2,
        "min_bytes_written": 2 * 4 * 100 * 72 * 2,
    }


def test_split_decode_and_its_merge():
    # GQA 8 on one kv head: 8 rows in one threadgroup, COLS 4 (E = 100 pads to 128), batches of 4
    # keys, split into 11 shares of 288 keys (the last 121: scored as whole batches, 124).
    q, k, v = inputs(1, 8, 1, 1, 3001, 100, 100, torch.float16)
    plan = explain_plan(q, k, v)
    assert plan["split_count"] == 11 and plan["workspace_bytes"] == 11 * 8 * (100 + 2) * 4
    decode, merge = costs(plan)
    assert decode == {
        "threadgroup_bytes": (2 * 8 * 8 + 8 * 128) * 4,  # (max, sum) per SIMD-group and row, an output row each
        "registers": 8 * (2 * 4 + 4) + 2 * 4,  # per row query slice, accumulator, 4 partial scores; a K or V row
        "flops": 2 * 128 * (8 * (10 * 288 + 124) + 8 * 3001),  # scores of every batch, values of every key
        "tiles": 8 * (10 * 288 + 124),  # the scores computed
        "useful_flops": 2 * (100 + 100) * 8 * 3001,
        "min_bytes_read": 8 * 100 * 2 + 3001 * (100 + 100) * 2,
        "min_bytes_written": 11 * 8 * (100 + 2) * 4,
    }
    assert merge == {
        "threadgroup_bytes": 0,
        "registers": 4,
        "flops": 2 * 128 * 11 * 8,
        "tiles": 0,
        "useful_flops": 0,
        "min_bytes_read": 11 * 8 * (100 + 2) * 4,
        "min_bytes_written": 8 * 100 * 2,
    }


def test_simple_kernel_with_a_broadcast_mask():
    q, k, v = inputs(1, 2, 2, 5, 40, 40, 16, torch.float32)
    mask = torch.ones(40, dtype=torch.bool)  # one row of S bools, broadcast to (1, 2, 5, 40)
    [cost] = costs(explain_plan(q, k, v, attn_mask=mask, kernel="simple"))
    assert cost == {
        "threadgroup_bytes": 0,
        "registers": 2 * 18,  # a query row and an accumulator of 18 slices per lane (head dims to 576)
        "flops": 2 * 32 * (2 + 1) * 2 * 5 * 40,  # q.k over 2 slices of 32, the accumulator over 1
        "tiles": 2 * 5 * 40,  # the scores computed
        "useful_flops": 2 * (40 + 16) * 2 * 5 * 40,
        "min_bytes_read": (2 * 5 * 40 + 2 * 40 * 40 + 2 * 40 * 16) * 4 + 40,
        "min_bytes_written": 2 * 5 * 16 * 4,
    }


def test_causal_keys_past_the_queries_are_not_read():
    q, k, v = inputs(1, 4, 4, 2, 500, 64, 64, torch.bfloat16)
    plan = explain_plan(q, k, v, causal=True)  # row i sees keys 0..i: only keys 0 and 1 are read
    [cost] = costs(plan)
    assert cost["min_bytes_read"] == 4 * 2 * 64 * 2 + 4 * 2 * (64 + 64) * 2
    assert cost["useful_flops"] == 2 * 128 * 4 * (1 + 2)


ELEMENT_BYTES = {"float": 4, "half": 2, "bfloat": 2, "bool": 1}
TILE_VEC = 4  # FA_TILE_VEC of metal/fa_params.h: elements of one fa_tile_storage<T>


def declared_threadgroup_bytes(text: str, kernel: str, template_args: list, dtype: str) -> int:
    """Bytes of the kernel-scope `threadgroup T name[N];` arrays of kernel template `kernel`, N
    evaluated with the template arguments and the body's constexpr ints."""
    match = next(m for m in DEFINITION.finditer(text) if m.group(3) == kernel)
    names = [p.split()[-1] for p in match.group(1).split(",")]
    env = dict(zip(names, template_args), fa_tile_vectors=lambda n: (n + TILE_VEC - 1) // TILE_VEC)
    body = text[match.end() : text.find("\ntemplate", match.end())]
    for name, expr in re.findall(r"constexpr int (\w+) = ([^;?]+);", body):
        env[name] = eval(expr, {"__builtins__": {}}, env)
    total = 0
    for element, expr in re.findall(r"threadgroup ([\w<>]+) \w+\[([^\]]+)\];", body):
        if element == "fa_tile_storage<T>":
            size = TILE_VEC * ELEMENT_BYTES[dtype]
        else:
            size = ELEMENT_BYTES[dtype] if element == "T" else ELEMENT_BYTES[element]
        total += size * eval(expr, {"__builtins__": {}}, env)
    return total


@pytest.mark.parametrize(
    "dtype,e,ev,kernel",
    [
        (torch.float32, 256, 64, "forward"),
        (torch.float16, 128, 128, "forward"),
        (torch.bfloat16, 40, 200, "forward"),
        (torch.float32, 64, 64, "decode"),
        (torch.float16, 256, 100, "decode"),
        (torch.bfloat16, 16, 16, "simple"),
    ],
)
def test_threadgroup_bytes_match_the_kernel_source(dtype, e, ev, kernel):
    q, k, v = inputs(1, 4, 1, 3, 50, e, ev, dtype)
    d = explain_plan(q, k, v, kernel=kernel)["dispatches"][0]
    macros = d["macros"]
    type_name = macros["FA_DTYPE"]
    if kernel == "forward":
        args = ["T", int(macros["FA_BD"]), int(macros["FA_BDV"]), int(macros["FA_BK"]), int(macros["FA_WM"])]
    elif kernel == "decode":
        args = ["T", int(macros["FA_DECODE_COLS"]), int(macros["FA_DECODE_ROWS"])]
    else:
        args = ["T"]
    text = preprocessed(d["source"], macros)
    assert d["cost"]["threadgroup_bytes"] == declared_threadgroup_bytes(text, f"fa_{kernel}", args, type_name)


# --- the backward (explain_plan(backward=True)) ------------------------------------------------


def backward_costs(q, k, v, **options):
    plan = explain_plan(q, k, v, backward=True, **options)
    assert [d["function"].rsplit("_", 1)[0] for d in plan["dispatches"]] == [
        "fa_backward_delta",
        "fa_backward_dkdv",
        "fa_backward_dq",
    ]
    return [d["cost"] for d in plan["dispatches"]], plan["dispatches"][1]["macros"]


def test_backward_figures_by_hand():
    # fp32, E = Ev = 64: the forward's tiles on Apple9 (BK 32, 4 SIMD-groups: blocks of 32 rows or
    # keys; Apple7/8 halve BK to fit their tile cap: test_gpu_family.py).
    # B = 1, Hq = 4, Hkv = 2, L = S = 64, causal: 2 query blocks see 1 and 2 key tiles (dQ); 2 key
    # blocks are seen by 2 and 1 query tiles (dK/dV), per query head.
    q, k, v = inputs(1, 4, 2, 64, 64, 64, 64, torch.float32)
    (delta, dkdv, dq), macros = backward_costs(q, k, v, causal=True, gpu="apple9")
    assert macros["FA_BK"] == "32" and macros["FA_WM"] == "4"
    rows, pairs = 4 * 64, 4 * 64 * 65 // 2
    assert delta == {
        "threadgroup_bytes": 0,
        "registers": 0,
        "flops": 2 * rows * 64,
        "tiles": 0,
        "useful_flops": 2 * rows * 64,
        "min_bytes_read": 2 * rows * 64 * 4,
        "min_bytes_written": rows * 4,
    }
    tiles_bytes = 32 * (64 + 8 + 64 + 8) * 4 + 2 * 4
    io = 4 * 64 * 64 * 4 + 2 * 2 * 64 * 64 * 4 + rows * 64 * 4 + 2 * rows * 4  # q, k, v, dout, lse and D
    assert dkdv == {
        "threadgroup_bytes": tiles_bytes + 2 * 32 * 4,
        "registers": 8 * 2 * 4 + 32 // 8 * 4,
        "flops": 2 * (4 * 3) * 32 * 32 * (2 * 64 + 2 * 64),
        "tiles": 4 * 3,
        "useful_flops": 2 * pairs * (2 * 64 + 2 * 64),
        "min_bytes_read": io,
        "min_bytes_written": 2 * 2 * 64 * 64 * 4,
    }
    assert dq == {
        "threadgroup_bytes": tiles_bytes,
        "registers": 8 * 2 * 3 + 32 // 8 * 4,
        "flops": 2 * (4 * 3) * 32 * 32 * (2 * 64 + 64),
        "tiles": 4 * 3,
        "useful_flops": 2 * pairs * (2 * 64 + 64),
        "min_bytes_read": io,
        "min_bytes_written": rows * 64 * 4,
    }


def band_tiles(l, s, lo, hi, block, bk):
    """Independent count from the band's visibility matrix: (dK/dV query tiles, dQ key tiles) per
    query head, each block's range running from the first to the last row (key) that sees it."""
    i, j = torch.arange(l)[:, None], torch.arange(s)[None, :]
    seen = (j >= i + lo) & (j <= i + hi)

    def per_block(matrix):
        tiles = 0
        for start in range(0, matrix.shape[0], block):
            hits = matrix[start : start + block].any(0).nonzero()
            tiles += 0 if len(hits) == 0 else -(-(hits.max().item() - hits[0].item() + 1) // bk)
        return tiles

    return per_block(seen.T), per_block(seen)


@pytest.mark.parametrize("l, s, window", [(70, 90, (10, 0)), (90, 70, (5, 3)), (64, 200, (40, -1)), (33, 33, (0, 0))])
def test_backward_tiles_match_an_independent_count(l, s, window):
    q, k, v = inputs(2, 4, 2, l, s, 64, 64, torch.float32)
    (_, dkdv, dq), macros = backward_costs(
        q,
        k,
        v,
        causal="bottom_right" if window[1] == 0 else False,
        window_size=window,
        window_align="bottom_right" if window[1] else None,
    )
    d = s - l
    lo = d - window[0]
    hi = d + (window[1] if window[1] >= 0 else s)
    key_tiles, query_tiles = band_tiles(l, s, lo, hi, 8 * int(macros["FA_WM"]), int(macros["FA_BK"]))
    assert dkdv["tiles"] == 2 * 4 * key_tiles and dq["tiles"] == 2 * 4 * query_tiles


def test_backward_tiles_grow_with_the_window_not_with_s():
    def tiles(s, window):
        q, k, v = inputs(1, 2, 2, 256, s, 64, 64, torch.float16)
        (_, dkdv, dq), _ = backward_costs(q, k, v, causal="bottom_right", window_size=window)
        return dkdv["tiles"], dq["tiles"]

    short, long_ = tiles(1024, (128, 0)), tiles(8192, (128, 0))
    assert short == long_ and min(long_) > 0
    wide = tiles(8192, (512, 0))
    assert all(w > 2 * n for w, n in zip(wide, long_))
    assert all(full > 10 * n for full, n in zip(tiles(8192, (-1, -1)), long_))


# --- packed sequences and KV caches (explain_varlen_plan, explain_kvcache_plan) ----------------


@pytest.fixture
def core_plans(monkeypatch):
    """The plan of every C forward and backward call, made from the very arguments the call passed,
    and the workspace bytes each forward asked for: what ran, to hold the explain functions to."""
    seen = {"forward": [], "backward": [], "workspace": []}
    forward, backward = _C.forward, _C.backward

    def recorded_forward(device, tensors, options, workspace=None):
        seen["forward"].append(_C.plan_forward(device, tensors, options))
        if callable(workspace):
            asked = workspace
            workspace = lambda n: seen["workspace"].append(n) or asked(n)  # noqa: E731
        return forward(device, tensors, options, workspace)

    def recorded_backward(*args, **kwargs):
        seen["backward"].append(_C.plan_backward(*args, **kwargs))
        return backward(*args, **kwargs)

    monkeypatch.setattr(_C, "forward", recorded_forward)
    monkeypatch.setattr(_C, "backward", recorded_backward)
    return seen


def functions(dispatches):
    return [d["function"] for d in dispatches]


def test_explain_kvcache_plan_is_the_split_decode_that_runs(gen, core_plans):
    """A short q over a long cache: the table kernel, split-K decode and its merge. Explaining
    appends nothing and rotates nothing; the real call then plans exactly that and asks for the
    split's workspace."""
    q = torch.randn(2, 1, 4, 16, generator=gen).half()
    k_cache, v_cache = (torch.randn(2, 1024, 2, 16, generator=gen).half() for _ in range(2))
    new_k, new_v = (torch.randn(2, 1, 2, 16, generator=gen).half() for _ in range(2))
    cos, sin = torch.rand(1024, 4, generator=gen), torch.rand(1024, 4, generator=gen)
    args = dict(
        k=new_k,
        v=new_v,
        rotary_cos=cos,
        rotary_sin=sin,
        cache_seqlens=torch.tensor([600, 1000], dtype=torch.int32),
        causal=True,
    )
    before = [t.clone() for t in (q, k_cache, v_cache)]
    plan = explain_kvcache_plan(q, k_cache, v_cache, **args)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k_cache, v_cache)))  # nothing written
    assert functions(plan["dispatches"]) == ["fa_sequence_table_half", "fa_decode_half", "fa_decode_merge_half"]
    assert plan["split_count"] > 1 and plan["dispatches"][1]["grid"][0] == plan["split_count"]
    assert plan["dispatches"][0]["cost"]["min_bytes_written"] == 2 * _C.SEQUENCE_PARAMS_BYTES
    assert core_plans["forward"] == []
    flash_attn_with_kvcache(q, k_cache, v_cache, **args)
    assert core_plans["forward"] == [plan] and core_plans["workspace"] == [plan["workspace_bytes"]] != [0]
    assert not torch.equal(k_cache, before[1])  # the real call appended
    unsplit = explain_kvcache_plan(q, k_cache, v_cache, **args, num_splits=1)
    assert functions(unsplit["dispatches"]) == ["fa_sequence_table_half", "fa_decode_half"]
    flash_attn_with_kvcache(q, k_cache, v_cache, **args, num_splits=1)
    assert core_plans["forward"][1:] == [unsplit] and core_plans["workspace"] == [plan["workspace_bytes"]]


@pytest.mark.parametrize(
    "lens_q, lens_k, attention",
    [
        ([40, 2, 17], [40, 5, 17], ["fa_forward_float"]),
        ([3, 1, 0], [700, 9, 4], ["fa_decode_float", "fa_decode_merge_float"]),
    ],
)
def test_explain_varlen_plan_is_the_kernel_that_runs(gen, core_plans, lens_q, lens_k, attention):
    """Prefill for long sequences, split decode for short ones: the plan explain_varlen_plan gives is
    the one the real call makes, and the output is bit for bit the reported kernel's (forced through
    the core), not another's."""
    q, k, v = (
        torch.randn(sum(lens_q), 4, 16, generator=gen),
        torch.randn(sum(lens_k), 2, 16, generator=gen),
        torch.randn(sum(lens_k), 2, 16, generator=gen),
    )
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (lens_q, lens_k))
    call = (q, k, v, cu_q, cu_k, max(lens_q), max(lens_k))
    plan = explain_varlen_plan(*call, causal=True)
    assert functions(plan["dispatches"]) == ["fa_sequence_table_float", *attention]
    assert plan["dispatches"][1]["constants"][12] == 1  # FA_FC_SEQUENCES
    out = flash_attn_varlen_func(*call, causal=True)
    assert core_plans["forward"] == [plan]
    table = _varlen.packed_table(cu_q, cu_k)

    def forced(kernel):
        result = torch.zeros_like(out)
        views = [_varlen.packed_view(t) for t in (q, k, v, result)]
        _varlen.run_forward(
            *views,
            None,
            AttentionOptions(16**-0.5, True, (1, -1, -1), kernel=kernel),
            _varlen.sequence_args(table, max(lens_q), max(lens_k)),
        )
        return result

    reported = _C.KERNEL_FORWARD if attention[0] == "fa_forward_float" else _C.KERNEL_DECODE
    others = {_C.KERNEL_SIMPLE, _C.KERNEL_FORWARD, _C.KERNEL_DECODE} - {reported}
    assert torch.equal(forced(reported), out)
    assert not any(torch.equal(forced(kernel), out) for kernel in others)


def test_explain_varlen_plan_with_probs_and_backward(gen, core_plans):
    """return_attn_probs adds the probability pass (the table kernel and fa_simple under
    FA_DROPOUT_PROBS); backward=True gives the gradients' dispatches after the table kernel; both
    as the real calls plan them. Explaining draws nothing from torch's generator."""
    q, k, v = (torch.randn(30, 2, 16, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 12, 12, 30], dtype=torch.int32)
    call = (q, k, v, cu, cu, 18, 18)
    options = dict(dropout_p=0.3, window_size=(5, 1), softcap=0.5, sinks=torch.zeros(2))
    rng = torch.get_rng_state()
    plan = explain_varlen_plan(*call, **options, return_attn_probs=True)
    backward = explain_varlen_plan(*call, **options, backward=True)
    assert torch.equal(torch.get_rng_state(), rng)
    assert functions(plan["dispatches"]) == [
        "fa_sequence_table_float",
        "fa_forward_float",
        "fa_sequence_table_float",
        "fa_simple_float",
    ]
    assert plan["dispatches"][3]["constants"][_C.FC_DROPOUT] == _C.DROPOUT_PROBS
    assert plan["dispatches"][3]["grid"] == (-(-18 // 4), 2, 3)  # max_seqlen_q in rows of 4, heads, sequences
    assert functions(backward["dispatches"]) == [
        "fa_sequence_table_float",
        "fa_backward_delta_float",
        "fa_backward_dkdv_float",
        "fa_backward_dq_float",
    ]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _, _ = flash_attn_varlen_func(*leaves, *call[3:], **options, return_attn_probs=True)
    out.backward(torch.randn_like(out))  # a gradient of out's layout, as the plan assumes
    assert [d for p in core_plans["forward"] for d in p["dispatches"]] == plan["dispatches"]
    assert core_plans["backward"] == [backward["dispatches"]]


def test_explain_functions_share_the_calls_checks(gen):
    """The explain functions refuse what the functions refuse, with the same messages; a refused
    cache call writes nothing (every check runs before the cache is appended to)."""
    q, k, v = (torch.randn(7, 2, 8, generator=gen) for _ in range(3))
    bad = torch.tensor([0, 5, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="explain_varlen_plan: cu_seqlens_q must be non-decreasing"):
        explain_varlen_plan(q, k, v, bad, torch.tensor([0, 3, 7], dtype=torch.int32), 5, 4)
    with pytest.raises(TypeError, match="explain_varlen_plan: backward must be a bool"):
        explain_varlen_plan(
            q,
            k,
            v,
            torch.tensor([0, 7], dtype=torch.int32),
            torch.tensor([0, 7], dtype=torch.int32),
            7,
            7,
            backward=None,
        )
    q, k_cache, v_cache = torch.randn(1, 1, 2, 8), torch.zeros(1, 16, 2, 8), torch.zeros(1, 16, 2, 8)
    new = torch.ones(1, 1, 2, 8)
    with pytest.raises(ValueError, match=r"explain_kvcache_plan: cache_seqlens\[0\] = 16 with 1 new keys"):
        explain_kvcache_plan(q, k_cache, v_cache, new, new, cache_seqlens=16)
    for bad_option in (dict(softmax_scale="x"), dict(alibi_slopes=torch.ones(3)), dict(sinks=torch.ones(5))):
        with pytest.raises((TypeError, ValueError), match="flash_attn_with_kvcache"):
            flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=3, **bad_option)
        assert not k_cache.any() and not v_cache.any()
