"""The flash-attn API takes its arguments as flash-attn does: numbers as ints, numpy scalars or 0-d
tensors and window_size as a tensor of 2 ints (flash-attn's own tests draw it with torch.randint);
a paged varlen call runs its forward whatever requires grad and refuses only the backward; and
input errors flash-attn raises as RuntimeError are FlashAttnInputError, a ValueError and a
RuntimeError both."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashattn_mps import (
    FlashAttnInputError,
    FlashAttnTypeError,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)
from helpers import flash_inputs, packed_inputs, prefix_sums, randn


def test_window_and_numbers_as_tensors_match_ints(gen):
    q, k, v = flash_inputs(gen, 2, 13, 17, 4, 2, 16, 16, torch.float32)
    expected = flash_attn_func(q, k, v, 0.0, 0.3, True, (5, 0), 2.0)
    for window in (torch.tensor([5, 0]), (torch.tensor(5), torch.tensor(0)), (np.int64(5), 0), [5, torch.tensor(0)]):
        out = flash_attn_func(q, k, v, torch.tensor(0.0), torch.tensor(0.3), True, window, torch.tensor(2.0))
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out = flash_attn_func(q, k, v, np.float32(0.0), np.float64(0.3), True, torch.tensor([5, 0]), np.float32(2.0))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_varlen_and_kvcache_take_tensor_numbers(gen):
    lens = [5, 9, 3]
    q, k, v = packed_inputs(gen, lens, lens, 4, 2, 16, 16, torch.float32)
    cu = prefix_sums(lens)
    expected = flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, causal=True, window_size=(3, 0))
    out = flash_attn_varlen_func(
        q, k, v, cu, cu, torch.tensor(9), np.int32(9), causal=True, window_size=torch.tensor([3, 0])
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=0)

    q1 = randn(gen, 2, 1, 4, 16)
    k_cache, v_cache = randn(gen, 2, 20, 2, 16), randn(gen, 2, 20, 2, 16)
    lengths = torch.tensor([7, 20], dtype=torch.int32)
    expected = flash_attn_with_kvcache(q1, k_cache, v_cache, cache_seqlens=lengths, window_size=(4, 2), num_splits=2)
    out = flash_attn_with_kvcache(
        q1,
        k_cache,
        v_cache,
        cache_seqlens=lengths,
        window_size=(torch.tensor(4), torch.tensor(2, dtype=torch.int32)),
        num_splits=torch.tensor(2),
        softmax_scale=torch.tensor(0.3),
    )
    scaled = flash_attn_with_kvcache(
        q1, k_cache, v_cache, cache_seqlens=lengths, window_size=(4, 2), num_splits=2, softmax_scale=0.3
    )
    torch.testing.assert_close(out, scaled, rtol=0, atol=0)
    assert not torch.equal(out, expected)  # the tensor scale was applied


@pytest.mark.parametrize(
    "window, kind",
    [
        (torch.tensor([1.5, 2.0]), TypeError),  # not ints
        (torch.tensor([1, 2, 3]), TypeError),  # not 2
        ((torch.tensor([1, 2]), 0), TypeError),  # a side that is not 0-d
        ((True, 0), TypeError),
        (torch.tensor([-2, 0]), FlashAttnInputError),
    ],
)
def test_bad_windows_are_named(gen, window, kind):
    q, k, v = flash_inputs(gen, 1, 4, 4, 2, 2, 8, 8, torch.float32)
    with pytest.raises(kind, match="flash_attn_func: window_size"):
        flash_attn_func(q, k, v, window_size=window)


def test_paged_varlen_runs_forward_with_grad_and_refuses_backward(gen):
    lens_q, lens_k, page_size = [3, 6], [10, 7], 4
    q, keys, values = packed_inputs(gen, lens_q, lens_k, 4, 2, 16, 16, torch.float32)
    pages = 8
    table = torch.tensor([[5, 0, 3], [1, 7, 2]], dtype=torch.int32)
    k_pool, v_pool = randn(gen, pages, page_size, 2, 16), randn(gen, pages, page_size, 2, 16)
    cu_q, cu_k = prefix_sums(lens_q), prefix_sums(lens_k)
    args = (cu_q, cu_k, 6, 10)
    expected = flash_attn_varlen_func(q, k_pool, v_pool, *args, causal=True, block_table=table)
    q.requires_grad_(True)
    k_pool.requires_grad_(True)
    out = flash_attn_varlen_func(q, k_pool, v_pool, *args, causal=True, block_table=table)
    torch.testing.assert_close(out.detach(), expected, rtol=0, atol=0)
    assert out.requires_grad
    with pytest.raises(NotImplementedError, match="block_table") as raised:
        out.sum().backward()
    assert isinstance(raised.value, RuntimeError)


def test_input_errors_are_value_and_runtime_errors(gen):
    """What flash-attn checks (and raises RuntimeError for) raises FlashAttnInputError here."""
    lens = [3, 5]
    q, k, v = packed_inputs(gen, lens, lens, 2, 2, 8, 8, torch.float32)
    cu = prefix_sums(lens)
    pool = randn(gen, 4, 4, 2, 8)
    bad_table = torch.tensor([[9, 0], [1, 2]], dtype=torch.int32)
    calls = [
        ("block_table", lambda: flash_attn_varlen_func(q, pool, pool, cu, cu, 5, 5, block_table=bad_table)),
        ("cu_seqlens_q", lambda: flash_attn_varlen_func(q, k, v, cu + 1, cu, 5, 5)),
        ("max_seqlen_k", lambda: flash_attn_varlen_func(q, k, v, cu, cu, 5, 2)),
        ("cache_seqlens", lambda: flash_attn_with_kvcache(q[None, :1], pool[:1], pool[:1], cache_seqlens=9)),
        ("heads", lambda: flash_attn_func(randn(gen, 1, 4, 3, 8), randn(gen, 1, 4, 2, 8), randn(gen, 1, 4, 2, 8))),
        ("alibi_slopes", lambda: flash_attn_func(q[None], k[None], v[None], alibi_slopes=torch.ones(3))),
        ("window_size", lambda: flash_attn_func(q[None], k[None], v[None], window_size=(-3, 0))),
    ]
    for name, call in calls:
        with pytest.raises(FlashAttnInputError, match=name) as raised:
            call()
        assert isinstance(raised.value, ValueError) and isinstance(raised.value, RuntimeError), name


def test_a_window_of_tensors_is_one_host_read(gen, monkeypatch):
    """Both sides, as a (2,) tensor or a pair of 0-d tensors, come back in one read."""
    reads = []
    for name in ("tolist", "item", "__int__", "__index__", "__float__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _real=real, _name=name: reads.append(_name) or _real(self, *a)
        )
    q, k, v = flash_inputs(gen, 1, 6, 9, 2, 2, 8, 8, torch.float32)
    for window in (torch.tensor([3, 1]), (torch.tensor(3), torch.tensor(1))):
        reads.clear()
        flash_attn_func(q, k, v, window_size=window)
        assert reads == ["tolist"]


def test_dtype_errors_are_type_and_runtime_errors(gen):
    """flash-attn checks dtypes with RuntimeError too: FlashAttnTypeError is both."""
    lens = [3, 5]
    q, k, v = packed_inputs(gen, lens, lens, 2, 2, 8, 8, torch.float32)
    cu = prefix_sums(lens)
    pool = randn(gen, 4, 4, 2, 8)
    calls = [
        ("block_table", lambda: flash_attn_varlen_func(q, pool, pool, cu, cu, 5, 5, block_table=torch.zeros(2, 2))),
        ("cu_seqlens_k", lambda: flash_attn_varlen_func(q, k, v, cu, cu.long(), 5, 5)),
        ("share one dtype", lambda: flash_attn_func(q[None], k[None].half(), v[None])),
        ("alibi_slopes", lambda: flash_attn_func(q[None], k[None], v[None], alibi_slopes=torch.ones(2).double())),
        ("k_cache", lambda: flash_attn_with_kvcache(q[None, :1], pool[:1].half(), pool[:1], cache_seqlens=1)),
    ]
    for name, call in calls:
        with pytest.raises(FlashAttnTypeError, match=name) as raised:
            call()
        assert isinstance(raised.value, TypeError) and isinstance(raised.value, RuntimeError), name


def test_number_checks_compile_without_graph_breaks(gen):
    """The checks that accept tensors cost nothing traced when given plain numbers."""
    q, k, v = flash_inputs(gen, 1, 16, 16, 2, 2, 16, 16, torch.float32)
    options = dict(causal=True, window_size=(4, 0), softcap=2.0, softmax_scale=0.3)
    compiled = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, **options), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), flash_attn_func(q, k, v, **options), rtol=0, atol=0)
