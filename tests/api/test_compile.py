"""flash_attn_varlen_func and flash_attn_with_kvcache (appending, and paged with a block table)
under torch.compile(fullgraph=True, dynamic=True): no graph break, and the results (outputs,
gradients, the cache's contents) of the compiled call are the eager call's. Each compile takes tens
of seconds on a small machine, so these are few and marked slow. Traced entry points cannot read the
tables on the host, so the attention op checks them when it runs."""

from __future__ import annotations

import pytest
import torch

from flashattn_mps import flash_attn_varlen_func, flash_attn_with_kvcache


def _prefix_sums(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.slow
def test_varlen_compiles_fullgraph_forward_and_backward():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)

    def fn(q, k, v, cu_q, cu_k, max_q, max_k, sinks):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, sinks=sinks)

    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for lens_q, lens_k in (([3, 5, 2], [4, 5, 7]), ([6, 1], [9, 2])):  # a second shape: no recompile needed
        total_q, total_k = sum(lens_q), sum(lens_k)
        leaves = [
            torch.randn(total_q, 4, 16, generator=gen),
            torch.randn(total_k, 2, 16, generator=gen),
            torch.randn(total_k, 2, 8, generator=gen),
            torch.randn(4, generator=gen),
        ]
        args = (_prefix_sums(lens_q), _prefix_sums(lens_k), max(lens_q), max(lens_k))
        results = []
        for run in (compiled, fn):
            q, k, v, sinks = (t.clone().requires_grad_() for t in leaves)
            out = run(q, k, v, *args, sinks)
            grads = torch.autograd.grad(out.square().sum(), (q, k, v, sinks))
            results.append((out, *grads))
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_compiles_fullgraph_appending(paged):
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(1)
    batch, heads, kv_heads, dim, capacity, page = 2, 4, 2, 16, 32, 8
    cache = [torch.randn(batch, capacity, kv_heads, dim, generator=gen) for _ in range(2)]
    block_table = None
    if paged:  # the same positions, in pages stored in reverse order
        pages = batch * capacity // page
        cache = [c.reshape(pages, page, kv_heads, dim).flip(0).contiguous() for c in cache]
        block_table = torch.arange(pages - 1, -1, -1, dtype=torch.int32).reshape(batch, capacity // page)

    def fn(q, k_cache, v_cache, k, v, cache_seqlens, block_table):
        return flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            k,
            v,
            cache_seqlens=cache_seqlens,
            causal=True,
            block_table=block_table,
            return_softmax_lse=True,
        )

    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for new, lengths in ((1, [5, 17]), (3, [0, 20])):
        q = torch.randn(batch, new, heads, dim, generator=gen)
        k, v = (torch.randn(batch, new, kv_heads, dim, generator=gen) for _ in range(2))
        seqlens = torch.tensor(lengths, dtype=torch.int32)
        caches = [[c.clone() for c in cache] for _ in range(2)]
        got = compiled(q, *caches[0], k, v, seqlens, block_table)
        want = fn(q, *caches[1], k, v, seqlens, block_table)
        for a, b in zip((*got, *caches[0]), (*want, *caches[1])):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert not torch.equal(caches[0][0], cache[0])  # appended in place


def test_the_op_checks_the_sequence_table():
    """What a compiled call's entry point cannot check: a sequence longer than the grid's
    max_q_len, keys past k, and a block table naming a page outside the pool."""
    q, k = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    table = torch.tensor([[0, 0, 4, 0, 0, 4], [0, 4, 2, 0, 4, 2]], dtype=torch.int32)
    op = torch.ops.flashattn_mps.attention_forward
    out, _ = op(q, k, k, None, False, 0.5, None, True, sequences=table, max_q_len=4, max_kv_len=4)
    assert out.shape == (1, 2, 6, 8)
    with pytest.raises(ValueError, match="past max_q_len = 3"):
        op(q, k, k, None, False, 0.5, None, True, sequences=table, max_q_len=3, max_kv_len=4)
    with pytest.raises(ValueError, match="outside k's"):
        op(q, k[:, :, :5], k[:, :, :5], None, False, 0.5, None, True, sequences=table, max_q_len=4, max_kv_len=4)
    pool = torch.randn(3, 2, 4, 8)  # 3 pages of 4 positions, seen as (pages, Hkv, page_size, D)
    paged = torch.tensor([[0, 0, 2, 0, 0, 6]], dtype=torch.int32)
    with pytest.raises(ValueError, match="outside the pool of 3"):
        op(
            q,
            pool,
            pool,
            None,
            False,
            0.5,
            None,
            True,
            sequences=paged,
            max_q_len=2,
            max_kv_len=6,
            block_table=torch.tensor([[1, 3]], dtype=torch.int32),
        )
