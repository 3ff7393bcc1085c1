"""flash_attn_with_kvcache: in-place appends (rotary both layouts), cache_seqlens, cache_batch_idx,
cache_leftpad, against a cache updated and attended by hand in float64 (helpers.reference
per batch entry)."""

from __future__ import annotations

import pytest
import torch

from flashattn_mps import flash_attn_func, flash_attn_with_kvcache
from flashattn_mps._options import AttentionOptions
from helpers import ALL_DTYPES, max_error, randn, reference, slopes


def rotary_reference(x, cos, sin, positions, interleaved):
    """Rotation as complex multiplication (interleaved pairs) or GPT-NeoX's rotate_half, in float64."""
    half = cos.shape[1]
    c, s = cos.double()[positions][:, :, None], sin.double()[positions][:, :, None]
    x = x.double().clone()
    rot = x[..., : 2 * half]
    if interleaved:
        pairs = torch.view_as_complex(rot.reshape(*rot.shape[:-1], half, 2).contiguous())
        x[..., : 2 * half] = torch.view_as_real(pairs * torch.complex(c, s)).flatten(-2)
    else:
        rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], -1)
        x[..., : 2 * half] = rot * torch.cat([c, c], -1) + rotated_half * torch.cat([s, s], -1)
    return x


def by_hand(q, k_cache, v_cache, k, v, lengths, rows, leftpad, causal, window, softcap, alibi, rotary):
    """The cache updated and attended in plain torch (float64): returns (out, k_cache, v_cache)."""
    q, k_cache, v_cache = q.double(), k_cache.double().clone(), v_cache.double().clone()
    new = 0 if k is None else k.shape[1]
    starts = torch.tensor(lengths)
    if rotary is not None:
        cos, sin, interleaved = rotary
        steps = torch.arange(q.shape[1]) if causal or window != (-1, -1) else torch.zeros(q.shape[1], dtype=torch.long)
        q = rotary_reference(q, cos, sin, starts[:, None] + steps, interleaved)
        if k is not None:
            k = rotary_reference(k, cos, sin, starts[:, None] + torch.arange(new), interleaved)
    outs = []
    for b in range(q.shape[0]):
        if k is not None:
            k_cache[rows[b], lengths[b] : lengths[b] + new] = k[b].double()
            v_cache[rows[b], lengths[b] : lengths[b] + new] = v[b].double()
        keys = slice(leftpad[b], lengths[b] + new)
        slope = None if alibi is None else (alibi if alibi.dim() == 1 else alibi[b])
        out = reference(
            q[b : b + 1].transpose(1, 2),
            k_cache[rows[b] : rows[b] + 1, keys].transpose(1, 2),
            v_cache[rows[b] : rows[b] + 1, keys].transpose(1, 2),
            causal=causal,
            bottom_right=True,
            window=window,
            softcap=softcap,
            alibi=slope,
        )
        outs.append(out.transpose(1, 2))
    return torch.cat(outs), k_cache, v_cache


# (batch, seqlen_q, new keys, cache rows, cache length, hq, hkv, e, ev)
SHAPES = [
    (3, 1, 1, 3, 40, 4, 2, 16, 16),
    (2, 4, 4, 5, 300, 2, 2, 32, 32),
    (4, 1, 0, 4, 20, 6, 3, 16, 8),
    (2, 12, 3, 2, 64, 4, 1, 32, 32),
    (1, 2, 2, 3, 700, 8, 2, 64, 64),
]
# (causal, window, softcap, ALiBi, rotary layout or None, cache_batch_idx, cache_leftpad)
OPTIONS = [
    (True, (-1, -1), 0.0, None, True, False, False),
    (True, (-1, -1), 0.0, None, False, True, True),
    (False, (-1, -1), 0.0, None, True, True, False),
    (False, (5, 2), 0.0, "h", None, False, True),
    (True, (8, -1), 1.2, "bh", False, False, False),
    (False, (-1, -1), 0.0, None, None, True, True),
]


@pytest.mark.parametrize("shape", range(len(SHAPES)))
@pytest.mark.parametrize("option", range(len(OPTIONS)))
def test_appends_in_place_and_attends(gen, shape, option):
    batch, lq, new, cache_rows, cache_len, hq, hkv, e, ev = SHAPES[shape]
    causal, window, softcap, alibi_kind, layout, with_rows, with_leftpad = OPTIONS[option]
    dtype = ALL_DTYPES[(shape + option) % 3]
    q = randn(gen, batch, lq, hq, e, dtype=dtype)
    k_cache = randn(gen, cache_rows, cache_len, hkv, e, dtype=dtype)
    v_cache = randn(gen, cache_rows, cache_len, hkv, ev, dtype=dtype)
    k = randn(gen, batch, new, hkv, e, dtype=dtype) if new else None
    v = randn(gen, batch, new, hkv, ev, dtype=dtype) if new else None
    lengths = [int(x) for x in torch.randint(0, cache_len - new + 1, (batch,), generator=gen)]
    lengths[0] = cache_len - new  # one row filled to the end
    rows = [int(x) for x in torch.randperm(cache_rows, generator=gen)[:batch]] if with_rows else list(range(batch))
    leftpad = [int(torch.randint(0, n + 1, (1,), generator=gen)) for n in lengths] if with_leftpad else [0] * batch
    rotary = None
    if layout is not None:
        angles = torch.rand(cache_len + lq, e // 4, generator=gen) * 6.0  # rotary_dim = E / 2
        rotary = (angles.cos().to(dtype), angles.sin().to(dtype), layout)
    alibi = slopes(gen, alibi_kind, batch, hq)
    before_k, before_v = k_cache.clone(), v_cache.clone()

    out, lse = flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        k,
        v,
        None if rotary is None else rotary[0],
        None if rotary is None else rotary[1],
        torch.tensor(lengths, dtype=torch.int32),
        torch.tensor(rows, dtype=torch.int32) if with_rows else None,
        torch.tensor(leftpad, dtype=torch.int32) if with_leftpad else None,
        causal=causal,
        window_size=window,
        softcap=softcap,
        rotary_interleaved=bool(layout),
        alibi_slopes=alibi,
        return_softmax_lse=True,
    )

    golden, golden_k, golden_v = by_hand(
        q, before_k, before_v, k, v, lengths, rows, leftpad, causal, window, softcap, alibi, rotary
    )
    # Every cache entry but the appended ones is bitwise untouched; those hold the (rotated) keys.
    written = torch.zeros(cache_rows, cache_len, dtype=torch.bool)
    for b in range(batch):
        written[rows[b], lengths[b] : lengths[b] + new] = True
    assert torch.equal(k_cache[~written], before_k[~written]) and torch.equal(v_cache[~written], before_v[~written])
    assert torch.equal(v_cache[written], golden_v[written].to(dtype))
    assert max_error(k_cache[written], golden_k[written]) <= (0.0 if rotary is None else 2e-2)
    # Attention over what the call wrote, against the float64 attention of those keys.
    if rotary is None:
        near, _, _ = by_hand(
            q,
            k_cache,
            v_cache,
            None,
            None,
            [n + new for n in lengths],
            rows,
            leftpad,
            causal,
            window,
            softcap,
            alibi,
            None,
        )
        assert max_error(out, near) <= max(1e-5, 5 * max_error(near.to(dtype), near) + 5e-3 * (dtype != torch.float32))
    else:
        assert max_error(out, golden) <= {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}[dtype]
    # lse: finite, or +inf (flash-attn's convention) only for rows that see no key (causal rows
    # before a short cache).
    assert lse.shape == (batch, hq, lq) and not lse.isnan().any() and not (lse == float("-inf")).any()
    assert torch.equal(lse == float("inf"), (golden == 0).all(-1).transpose(1, 2) & (lse == float("inf")))


@pytest.mark.parametrize(
    "change, error, words",
    [
        (dict(cache_seqlens=torch.tensor([3, 4], dtype=torch.int64)), TypeError, "cache_seqlens must be int32"),
        (dict(cache_seqlens=torch.tensor([3, 9], dtype=torch.int32)), ValueError, r"cache_seqlens\[1\] = 9 with 1 new"),
        (dict(cache_seqlens=torch.tensor([3], dtype=torch.int32)), ValueError, r"cache_seqlens must be \(2,\)"),
        (dict(cache_batch_idx=torch.tensor([0, 5], dtype=torch.int32)), ValueError, r"cache_batch_idx\[1\] = 5"),
        (dict(cache_leftpad=torch.tensor([4, 0], dtype=torch.int32)), ValueError, r"cache_leftpad\[0\] = 4"),
        (dict(block_table=torch.tensor([[0], [5]], dtype=torch.int32)), ValueError, "names page 5, outside the pool"),
        (dict(block_table=torch.tensor([[0], [1]])), TypeError, "block_table must be an int32"),
        (dict(block_table=torch.tensor([[0, 1]], dtype=torch.int32)), ValueError, r"block_table must be \(batch"),
        (
            dict(
                block_table=torch.tensor([[0], [1]], dtype=torch.int32),
                cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32),
            ),
            ValueError,
            "cannot be combined with block_table",
        ),
        (dict(num_splits=-1), ValueError, "num_splits"),
        (dict(k=None), ValueError, "k and v must be given together"),
    ],
)
def test_errors_name_the_argument(gen, change, error, words):
    args = dict(
        q=randn(gen, 2, 1, 2, 8),
        k_cache=randn(gen, 2, 9, 2, 8),
        v_cache=randn(gen, 2, 9, 2, 8),
        k=randn(gen, 2, 1, 2, 8),
        v=randn(gen, 2, 1, 2, 8),
        cache_seqlens=torch.tensor([3, 4], dtype=torch.int32),
    )
    args.update(change)
    before = args["k_cache"].clone()
    with pytest.raises(error, match=words):
        flash_attn_with_kvcache(**args)
    assert torch.equal(args["k_cache"], before)  # refused before anything was written


@pytest.mark.parametrize("paged", [False, True])
def test_sinks_as_flash_attn_func_on_the_valid_prefix(gen, paged):
    """Sinks count once per row over each batch entry's valid keys, contiguous or paged."""
    lengths, hq = [5, 11], 4
    q, sinks = randn(gen, 2, 3, hq, 16), randn(gen, hq)
    k_cache, v_cache = randn(gen, 2, 12, 2, 16), randn(gen, 2, 12, 2, 16)
    args = dict(cache_seqlens=torch.tensor(lengths, dtype=torch.int32), causal=True, sinks=sinks)
    if paged:  # two pages of 6 rows per entry, stored in reverse order
        pool_k = k_cache.reshape(4, 6, 2, 16).flip(0).contiguous()
        pool_v = v_cache.reshape(4, 6, 2, 16).flip(0).contiguous()
        out = flash_attn_with_kvcache(
            q, pool_k, pool_v, block_table=torch.tensor([[3, 2], [1, 0]], dtype=torch.int32), **args
        )
    else:
        out = flash_attn_with_kvcache(q, k_cache, v_cache, **args)
    for b, n in enumerate(lengths):
        expected = flash_attn_func(
            q[b : b + 1], k_cache[b : b + 1, :n], v_cache[b : b + 1, :n], causal=True, sinks=sinks
        )
        assert torch.allclose(out[b : b + 1], expected, atol=2e-6), b


@pytest.mark.parametrize("case", range(4))
def test_paged_cache_through_shuffled_block_tables(gen, case):
    """A paged pool with shuffled pages gives what the same cache laid out contiguously gives,
    appends land in the right pages, and every other page entry stays bitwise untouched."""
    batch, lq, new, page, pages_per_seq, hq, hkv, d = [
        (3, 1, 1, 16, 5, 4, 2, 16),
        (2, 3, 2, 7, 9, 2, 2, 32),
        (2, 1, 0, 32, 3, 8, 2, 64),
        (2, 12, 4, 5, 20, 4, 1, 16),
    ][case]
    dtype = ALL_DTYPES[case % 3]
    causal = case != 2
    capacity = page * pages_per_seq
    pool_pages = batch * pages_per_seq + 3  # spare pages that no table names
    order = torch.randperm(pool_pages, generator=gen)
    table = order[: batch * pages_per_seq].reshape(batch, pages_per_seq).to(torch.int32)
    k_pool = randn(gen, pool_pages, page, hkv, d, dtype=dtype)
    v_pool = randn(gen, pool_pages, page, hkv, d, dtype=dtype)
    contiguous_k = k_pool[table.long()].reshape(batch, capacity, hkv, d).clone()
    contiguous_v = v_pool[table.long()].reshape(batch, capacity, hkv, d).clone()
    q = randn(gen, batch, lq, hq, d, dtype=dtype)
    k = randn(gen, batch, new, hkv, d, dtype=dtype) if new else None
    v = randn(gen, batch, new, hkv, d, dtype=dtype) if new else None
    lengths = torch.tensor(
        [capacity - new] + [int(x) for x in torch.randint(0, capacity - new + 1, (batch - 1,), generator=gen)],
        dtype=torch.int32,
    )
    before_k, before_v = k_pool.clone(), v_pool.clone()
    out = flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=lengths, block_table=table, causal=causal)
    want = flash_attn_with_kvcache(q, contiguous_k, contiguous_v, k, v, cache_seqlens=lengths, causal=causal)
    # The same kernel reads both (decode for lq <= 8, prefill above): the same sums.
    assert torch.equal(out, want)
    assert torch.equal(k_pool[table.long()].reshape(batch, capacity, hkv, d), contiguous_k)
    assert torch.equal(v_pool[table.long()].reshape(batch, capacity, hkv, d), contiguous_v)
    written = torch.zeros(pool_pages, page, dtype=torch.bool)
    for b in range(batch):
        for t in range(int(lengths[b]), int(lengths[b]) + new):
            written[table[b, t // page], t % page] = True
    assert torch.equal(k_pool[~written], before_k[~written]) and torch.equal(v_pool[~written], before_v[~written])


def test_core_clamps_block_tables_it_cannot_trust(gen):
    """The C layer never reads a block table in device memory: entries outside the pool and
    lengths past the table are clamped by the kernel, so the dispatch stays inside the pool."""
    from flashattn_mps import _C, _varlen

    q, pool = randn(gen, 2, 1, 2, 16), randn(gen, 3, 4, 2, 16)
    out = torch.zeros(2, 1, 2, 16)
    entries = torch.tensor([[0, 0, 1, 0, 0, 2**31 - 1], [1, 0, 1, 0, 3, 9]], dtype=torch.int32)
    bad_pages = torch.tensor([[-7, 2**31 - 1], [3, 99]], dtype=torch.int32)
    views = [t.transpose(1, 2) for t in (q, pool, pool, out)]
    for kernel in (_C.KERNEL_DECODE, _C.KERNEL_FORWARD):  # both read pages through the table
        out.fill_(float("nan"))
        _varlen.run_forward(
            *views,
            None,
            AttentionOptions(0.25, False, (1, -1, -1), kernel=kernel),
            _varlen.sequence_args(entries, 1, 8, bad_pages),
        )
        assert out.isfinite().all(), kernel
    with pytest.raises(TypeError, match="block_table: must be a contiguous"):
        _varlen.run_forward(
            *views,
            None,
            AttentionOptions(0.25, False, (1, -1, -1)),
            _varlen.sequence_args(entries, 1, 8, bad_pages.float()),
        )
    with pytest.raises(ValueError, match="prefill and decode kernels only"):
        _varlen.run_forward(
            *views,
            None,
            AttentionOptions(0.25, False, (1, -1, -1), kernel=_C.KERNEL_SIMPLE),
            _varlen.sequence_args(entries, 1, 8, bad_pages),
        )


def test_paged_decode_example_matches_recomputation(monkeypatch, capsys):
    """benchmarks/example_paged_decode.py: a tiny decoder's greedy tokens through a paged cache
    equal those of recomputing the prefix every step (the script asserts it)."""
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "example_paged_decode.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--device", "cpu", "--steps", "3"])
    runpy.run_path(str(script), run_name="__main__")
    assert "decodes exactly the recomputed tokens" in capsys.readouterr().out


@pytest.mark.parametrize("paged", [False, True])
def test_num_splits_sets_the_decode_split(gen, monkeypatch, paged):
    """num_splits as flash-attn documents it: 1 keeps the keys in one share, n > 1 splits them into
    n shares (merged exactly), 0 leaves it to the planner; the results agree to rounding."""
    from flashattn_mps import _C

    plans = []
    real = _C.forward

    def planned(*args, **kwargs):  # the plan of each call, from the same descriptors (without the workspace)
        plans.append(_C.plan_forward(*args[:3])["split_count"])
        return real(*args, **kwargs)

    monkeypatch.setattr(_C, "forward", planned)
    lengths = [300, 700]
    q, k_cache, v_cache = randn(gen, 2, 1, 4, 16), randn(gen, 2, 768, 2, 16), randn(gen, 2, 768, 2, 16)
    args = dict(cache_seqlens=torch.tensor(lengths, dtype=torch.int32))
    if paged:  # pages of 64 rows, stored in reverse order
        pool_k = k_cache.reshape(24, 64, 2, 16).flip(0).contiguous()
        pool_v = v_cache.reshape(24, 64, 2, 16).flip(0).contiguous()
        table = (23 - torch.arange(24, dtype=torch.int32)).reshape(2, 12)
        caches, args["block_table"] = (pool_k, pool_v), table
    else:
        caches = (k_cache, v_cache)
    outs = {n: flash_attn_with_kvcache(q, *caches, num_splits=n, **args) for n in (0, 1, 3, 200)}
    # 200 is capped at 128 shares, and a share is whole turns of 16 keys: 44 shares of 700 keys.
    assert plans[1:] == [1, 3, 44]
    for n, out in outs.items():
        assert torch.allclose(out, outs[1], atol=2e-6), n
