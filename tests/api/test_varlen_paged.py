"""flash_attn_varlen_func(block_table=...): packed queries against a paged KV cache, read in place
through the block table by the prefill and the decode kernel, against float64 references on the
unpacked pieces (each sequence's keys gathered from its pages by hand)."""

from __future__ import annotations

import pytest
import torch

from flashattn_mps import (
    _C,
    _varlen,
    explain_kvcache_plan,
    explain_varlen_plan,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)
from flashattn_mps import metal_cpu as mc
from helpers import (
    ALL_DTYPES,
    BACKWARD_NAMES,
    check_packed,
    core_options,
    packed_inputs,
    prefix_sums,
    randn,
    slopes,
    slots,
)


def paged_pool(gen, keys, values, lens_k, page_size, extra_columns=1, spare=3):
    """keys, values (total_k, Hkv, D) packed as lens_k, moved into a pool of pages of page_size rows
    in shuffled order (spare pages no table names, one more table column than needed). Every pool
    row that holds no key is NaN, so a kernel reading past a sequence's keys shows."""
    batch = len(lens_k)
    columns = max([-(-n // page_size) for n in lens_k] + [1]) + extra_columns
    pool_pages = batch * columns + spare
    table = torch.randperm(pool_pages, generator=gen)[: batch * columns].reshape(batch, columns).to(torch.int32)
    pools = [torch.full((pool_pages, page_size, *t.shape[1:]), float("nan"), dtype=t.dtype) for t in (keys, values)]
    cu = prefix_sums(lens_k)
    for b, n in enumerate(lens_k):
        positions = torch.arange(n)
        page, row = table[b].long()[positions // page_size], positions % page_size
        for pool, packed in zip(pools, (keys, values)):
            pool[page, row] = packed[int(cu[b]) : int(cu[b + 1])]
    return pools[0], pools[1], table


def run_kernel(monkeypatch, kernel):
    """flash_attn_varlen_func's forward on the given _C.KERNEL_* code."""
    real = _varlen.run_forward
    monkeypatch.setattr(
        _varlen,
        "run_forward",
        lambda q, k, v, out, lse, options, *rest: real(q, k, v, out, lse, options._replace(kernel=kernel), *rest),
    )


# (lens_q, lens_k, page_size, (hq, hkv), (e, ev), kernel, (causal, window, softcap, ALiBi kind, sinks)):
# page sizes below the prefill's 32-key tiles (1, 3, 5: tiles straddle pages) and multiples of it
# (64: tiles inside a page, or straddling where a window starts the walk mid-page), empty and
# length-1 sequences, GQA, every option, each kernel forced and chosen.
CASES = [
    ([3, 0, 1, 40], [5, 2, 1, 40], 1, (4, 2), (16, 16), _C.KERNEL_FORWARD, (True, (-1, -1), 0.0, None, False)),
    ([20, 1, 0, 37], [20, 64, 3, 37], 3, (6, 1), (32, 24), _C.KERNEL_FORWARD, (True, (6, -1), 0.7, None, False)),
    ([33, 7], [7, 33], 16, (2, 2), (8, 40), _C.KERNEL_DECODE, (False, (-1, -1), 0.0, "bh", False)),
    ([1, 1, 1], [17, 0, 300], 64, (4, 2), (16, 16), _C.KERNEL_DECODE, (True, (-1, -1), 0.0, None, True)),
    ([5, 8, 2], [9, 8, 200], 64, (4, 1), (16, 16), _C.KERNEL_AUTO, (False, (4, 2), 0.0, None, False)),
    ([40, 12], [70, 12], 64, (4, 2), (16, 16), _C.KERNEL_FORWARD, (True, (20, -1), 0.0, "h", True)),
    ([9, 3], [50, 19], 5, (2, 2), (32, 24), _C.KERNEL_FORWARD, (False, (-1, 3), 1.5, None, False)),
    ([12, 0, 30], [12, 5, 45], 3, (4, 2), (16, 16), _C.KERNEL_AUTO, (True, (3, -1), 0.0, "bh", False)),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_paged_matches_each_sequence(gen, monkeypatch, case):
    lens_q, lens_k, page_size, (hq, hkv), (e, ev), kernel, options = CASES[case]
    causal, window, softcap, alibi_kind, with_sinks = options
    dtype = ALL_DTYPES[case % 3]
    q, k, v = packed_inputs(gen, lens_q, lens_k, hq, hkv, e, ev, dtype)
    k_pool, v_pool, table = paged_pool(gen, k, v, lens_k, page_size)
    alibi = slopes(gen, alibi_kind, len(lens_q), hq)
    sinks = torch.randn(hq, generator=gen) if with_sinks else None
    run_kernel(monkeypatch, kernel)
    out = flash_attn_varlen_func(
        q,
        k_pool,
        v_pool,
        prefix_sums(lens_q),
        prefix_sums(lens_k),
        max(lens_q),
        max(lens_k),
        causal=causal,
        window_size=window,
        softcap=softcap,
        alibi_slopes=alibi,
        block_table=table,
        sinks=sinks,
    )
    check_packed(
        out, (q, k, v), lens_q, lens_k, causal=causal, window=window, softcap=softcap, alibi=alibi, sinks=sinks
    )


# (lens_q, lens_k, page_size, (e, ev), dtype, kernel, dropout_p)
SAME_KERNEL = [
    ([30, 0, 17], [64, 1, 40], 32, (16, 16), torch.float16, _C.KERNEL_FORWARD, 0.0),  # pages of one tile
    ([30, 0, 17], [64, 1, 40], 3, (16, 16), torch.bfloat16, _C.KERNEL_FORWARD, 0.3),
    ([4, 2], [90, 33], 7, (16, 16), torch.float32, _C.KERNEL_DECODE, 0.3),
    ([19], [37], 6, (320, 320), torch.float32, _C.KERNEL_FORWARD, 0.0),  # head dims streamed in blocks
]


@pytest.mark.parametrize("case", range(len(SAME_KERNEL)))
def test_paged_equals_contiguous_in_the_same_kernel(gen, monkeypatch, case):
    """The same kernel over the pages and over the packed keys sums the same terms in the same
    order: the same bits (dropout too, its mask a function of (sequence, head, row, key))."""
    lens_q, lens_k, page_size, (e, ev), dtype, kernel, dropout_p = SAME_KERNEL[case]
    q, k, v = packed_inputs(gen, lens_q, lens_k, 4, 2, e, ev, dtype)
    k_pool, v_pool, table = paged_pool(gen, k, v, lens_k, page_size)
    run_kernel(monkeypatch, kernel)
    args = (prefix_sums(lens_q), prefix_sums(lens_k), max(lens_q), max(lens_k), dropout_p)
    outs = []
    for keys, values, pages in ((k_pool, v_pool, table), (k, v, None)):
        torch.manual_seed(7)  # the same dropout draw
        outs.append(flash_attn_varlen_func(q, keys, values, *args, causal=True, block_table=pages))
    assert torch.equal(outs[0], outs[1])


def test_kvcache_prefill_on_a_paged_cache(gen):
    """flash_attn_with_kvcache with more than 8 query rows on a paged cache: the planner takes the
    prefill kernel, as for a contiguous cache, and gives the contiguous call's bits (keys from
    cache_leftpad on, so tiles start inside a page)."""
    k, v = randn(gen, 2 * 30, 2, 16), randn(gen, 2 * 30, 2, 16)
    k_pool, v_pool, table = paged_pool(gen, k, v, [30, 30], 4, extra_columns=0)
    q = randn(gen, 2, 12, 4, 16)
    lengths, leftpad = torch.tensor([30, 21], dtype=torch.int32), torch.tensor([3, 5], dtype=torch.int32)
    out = flash_attn_with_kvcache(
        q, k_pool, v_pool, cache_seqlens=lengths, cache_leftpad=leftpad, block_table=table, causal=True
    )
    want = flash_attn_with_kvcache(
        q, k.reshape(2, 30, 2, 16), v.reshape(2, 30, 2, 16), cache_seqlens=lengths, cache_leftpad=leftpad, causal=True
    )
    assert torch.equal(out, want)
    plan = explain_kvcache_plan(
        q, k_pool, v_pool, cache_seqlens=lengths, cache_leftpad=leftpad, block_table=table, causal=True
    )
    assert [d["function"] for d in plan["dispatches"]] == ["fa_sequence_table_float", "fa_forward_float"]
    assert plan["dispatches"][1]["constants"][13] == 1  # FA_FC_PAGED


def test_paged_prefill_runs_clean_in_checked_mode(gen, checked_core):  # noqa: F811
    """The paged prefill (pages of 3 rows straddling the key tiles) under checked mode: no race,
    no access outside the guarded buffers, the unchecked bits."""
    lens_q, lens_k = [17, 2], [40, 9]
    q, k, v = packed_inputs(gen, lens_q, lens_k, 2, 1, 16, 16, torch.float32)
    k_pool, v_pool, table = paged_pool(gen, k, v, lens_k, 3)
    args = (q, k_pool, v_pool, prefix_sums(lens_q), prefix_sums(lens_k), max(lens_q), max(lens_k))
    out = flash_attn_varlen_func(*args, causal=True, block_table=table)
    assert checked_core() >= 2  # the table kernel, then the prefill
    mc.set_checked(False)
    assert torch.equal(out, flash_attn_varlen_func(*args, causal=True, block_table=table))


@pytest.mark.parametrize("lens_q, kernel", [([12, 30], "fa_forward_float"), ([1, 3], "fa_decode_float")])
def test_explain_names_the_paged_kernel_that_runs(gen, monkeypatch, lens_q, kernel):
    """explain_varlen_plan over a block table: the table kernel, then the paged attention kernel the
    real call runs (prefill for long q, decode for short), and no backward to explain."""
    lens_k = [20, 40]
    q, k, v = packed_inputs(gen, lens_q, lens_k, 4, 2, 16, 16, torch.float32)
    k_pool, v_pool, table = paged_pool(gen, k, v, lens_k, 3)
    args = (q, k_pool, v_pool, prefix_sums(lens_q), prefix_sums(lens_k), max(lens_q), max(lens_k))
    plan = explain_varlen_plan(*args, causal=True, block_table=table)
    assert [d["function"] for d in plan["dispatches"]][:2] == ["fa_sequence_table_float", kernel]
    assert plan["dispatches"][1]["constants"][13] == 1  # FA_FC_PAGED
    launched = []
    real = _C.forward
    monkeypatch.setattr(_C, "forward", lambda *a, **kw: launched.append(_C.plan_forward(*a[:3])) or real(*a, **kw))
    flash_attn_varlen_func(*args, causal=True, block_table=table)
    assert [d["function"] for d in launched[0]["dispatches"]] == [d["function"] for d in plan["dispatches"]]
    with pytest.raises(ValueError, match="forward only"):
        explain_varlen_plan(*args, causal=True, block_table=table, backward=True)


def test_gradients_are_refused_by_name(gen):
    """Inputs requiring grad run the forward (flash-attn does); only a backward reaching the paged
    call raises, naming block_table."""
    q, k, v = packed_inputs(gen, [3], [5], 2, 2, 16, 16, torch.float32)
    k_pool, v_pool, table = paged_pool(gen, k, v, [5], 4)
    args = (prefix_sums([3]), prefix_sums([5]), 3, 5)
    sinks = torch.zeros(2)
    for out, sink_options in (
        (flash_attn_varlen_func(q.clone().requires_grad_(), k_pool, v_pool, *args, block_table=table), {}),
        (
            flash_attn_varlen_func(q, k_pool, v_pool, *args, block_table=table, sinks=sinks.clone().requires_grad_()),
            {"sinks": sinks},
        ),
    ):
        assert out.requires_grad
        check_packed(out.detach(), (q, k, v), [3], [5], **sink_options)
        with pytest.raises(NotImplementedError, match=r"block_table \(a paged KV cache\) has no backward"):
            out.sum().backward()
    with torch.no_grad():
        out = flash_attn_varlen_func(q.clone().requires_grad_(), k_pool, v_pool, *args, block_table=table)
    check_packed(out, (q, k, v), [3], [5])


def test_the_backward_refuses_a_block_table(gen):
    """The C core has no backward over pages: a block table given to it is refused by name."""
    q, k, v = packed_inputs(gen, [3], [5], 2, 2, 16, 16, torch.float32)
    k_pool, _, table = paged_pool(gen, k, v, [5], 4)
    q4, pool4 = q.transpose(0, 1).unsqueeze(0), k_pool.transpose(1, 2)
    lse = torch.zeros(1, 2, 3)
    sequences = _varlen.sequence_args(torch.tensor([[0, 0, 3, 0, 0, 5]], dtype=torch.int32), 3, 5, table)
    with pytest.raises(ValueError, match="block_table: the backward does not read a paged KV cache"):
        table, scratch, max_q, max_kv, block_table = sequences
        grads = (torch.zeros_like(q4), torch.zeros_like(pool4), torch.zeros_like(pool4))
        _C.backward(
            _C.DEVICE_CPU,
            slots(
                BACKWARD_NAMES,
                (q4, pool4, pool4, q4, lse, q4, torch.zeros_like(lse), *grads),
                sequences=table,
                sequence_scratch=scratch,
                block_table=block_table,
            ),
            core_options(scale=0.25, bottom_right=True, max_q_len=max_q, max_kv_len=max_kv),
        )


def test_bad_paged_input_is_refused_by_name(gen):
    """Before any kernel runs: pages outside the pool (only those a sequence uses count: entry 77
    of row 0 is never read), wrong dtypes and shapes, keys past the table's positions."""
    q = randn(gen, 6, 2, 16)
    k_pool, v_pool = randn(gen, 5, 4, 2, 16), randn(gen, 5, 4, 2, 16)
    table = torch.tensor([[0, 77], [2, 3]], dtype=torch.int32)

    def call(k=k_pool, v=v_pool, block_table=table):
        return flash_attn_varlen_func(q, k, v, prefix_sums([3, 3]), prefix_sums([2, 7]), 3, 7, block_table=block_table)

    assert call().isfinite().all()
    for change, error, message in [
        (
            dict(block_table=torch.tensor([[0, 1], [2, 9]], dtype=torch.int32)),
            ValueError,
            r"block_table\[1\] names page 9, outside the pool of 5 pages",
        ),
        (dict(block_table=torch.tensor([[-1, 1], [2, 3]], dtype=torch.int32)), ValueError, "names page -1"),
        (dict(block_table=table.long()), TypeError, "block_table must be an int32"),
        (dict(block_table=table[:1]), ValueError, r"block_table must be \(batch, max_num_blocks\) = \(2"),
        (dict(block_table=table[:, :1]), ValueError, "cu_seqlens_k gives sequence 1 7 keys, past the 4 positions"),
        (dict(k=k_pool[0]), ValueError, "with block_table, k must be the 4-D pool"),
        (dict(v=v_pool.half()), TypeError, "v must share q's dtype"),
        (dict(v=v_pool[:, :3]), ValueError, "must share their pages"),
        (dict(k=k_pool[..., :8]), ValueError, "k's headdim must be q's"),
    ]:
        with pytest.raises(error, match=message):
            call(**change)
