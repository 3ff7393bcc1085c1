"""What each rank of a test pool runs (distributed_pool.Pool.run(name, **kwargs)): context-parallel
calls on shards of one full sequence, every rank drawing the same full tensors, checked against
single-process flash_attention over the whole sequence and the float64 reference (tests/helpers),
by the project's rule: error <= max(1e-5, 5 x the same-dtype references' error)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import flashattn_mps as fa
from flashattn_mps import distributed as fad
from helpers import max_error, reference

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _full_inputs(seed, b, hq, hkv, seq, e, dtype, options):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(b, h, seq, e, generator=gen).to(dtype) for h in (hq, hkv, hkv, hq))
    extra = {}
    if "window" in options:
        extra["window_size"] = tuple(options["window"])
    if "softcap" in options:
        extra["softcap"] = options["softcap"]
    if options.get("alibi"):
        extra["alibi_slopes"] = torch.rand(hq, generator=gen) * 0.5
    if options.get("sinks"):
        extra["sinks"] = torch.randn(hq, generator=gen)
    return q, k, v, dout, extra


def _error_bound(actual, golden, *same_dtype) -> None:
    error = max_error(actual, golden)
    allowed = max(1e-5, 5 * max(max_error(s, golden) for s in same_dtype))
    assert error <= allowed, f"error {error:.3e} > {allowed:.3e}"


def attention_case(
    method, layout, causal, hkv, dtype, seq=48, hq=4, b=1, e=16, options=None, seed=0, unbatched=False, backward=True
):
    """fad.attention on this rank's shards against single-process flash_attention and the float64
    reference: out, lse, and (backward) dq, dk, dv and the sinks' gradient summed over the group."""
    options = options or {}
    dtype = DTYPES[dtype]
    q, k, v, dout, extra = _full_inputs(seed, b, hq, hkv, seq, e, dtype, options)
    sinks = extra.get("sinks")
    leaves = [t.clone().requires_grad_(backward) for t in (q, k, v)]
    local = [fad.shard(t, 2, layout=layout).detach().requires_grad_(backward) for t in (q, k, v)]
    local_sinks = None if sinks is None else sinks.clone().requires_grad_(backward)
    call_extra = {**extra, "sinks": local_sinks} if sinks is not None else extra
    if unbatched:
        local = [t.detach()[0].requires_grad_(backward) for t in local]
    out, lse = fad.attention(*local, causal=causal, method=method, layout=layout, return_lse=True, **call_extra)
    if unbatched:
        out, lse = out.unsqueeze(0), lse.unsqueeze(0)
    assert out.dtype == dtype and lse.dtype == torch.float32

    # single process over the whole sequence, same dtype
    one_sinks = None if sinks is None else sinks.clone().requires_grad_(backward)
    window = extra.get("window_size")
    flash_out, flash_lse = fa.flash_attention(
        *leaves,
        causal=causal,
        return_lse=True,
        window_size=window,
        softcap=extra.get("softcap", 0.0),
        alibi_slopes=extra.get("alibi_slopes"),
        sinks=one_sinks,
    )
    ref_options = dict(causal=causal, window=window, softcap=extra.get("softcap", 0.0), alibi=extra.get("alibi_slopes"))
    golden_inputs = [t.double().requires_grad_(backward) for t in (q, k, v)]
    golden_sinks = None if sinks is None else sinks.double().requires_grad_(backward)
    golden = reference(*golden_inputs, sinks=golden_sinks, **ref_options)
    same_dtype = reference(q, k, v, sinks=sinks, **ref_options)

    def mine(t):
        return fad.shard(t.detach(), 2, layout=layout)

    if backward:  # every collective before any check, so a failing rank leaves none waiting
        (out * mine(dout)).sum().backward()
        if sinks is not None:
            fad.all_reduce_gradients([local_sinks])
        (flash_out * dout).sum().backward()
        golden.backward(dout.double())
    _error_bound(out.detach(), mine(golden.detach()), mine(flash_out), mine(same_dtype))
    lse_error = (lse.detach() - mine(flash_lse)).abs().max().item()
    assert lse_error <= (1e-4 if dtype == torch.float32 else 2e-2), lse_error
    if not backward:
        return
    grads = [t.grad for t in local]
    if unbatched:
        grads = [g.unsqueeze(0) for g in grads]
    for name, got, flash_leaf, gold in zip("qkv", grads, leaves, golden_inputs):
        try:
            _error_bound(got, mine(gold.grad), mine(flash_leaf.grad))
        except AssertionError as e:
            raise AssertionError(f"d{name}: {e}") from None
    if sinks is not None:
        _error_bound(local_sinks.grad, golden_sinks.grad, one_sinks.grad)


def shard_case(layout, seq=24):
    size, rank = dist.get_world_size(), dist.get_rank()
    x = torch.arange(2 * seq * 3, dtype=torch.float32).reshape(2, seq, 3)
    local = fad.shard(x, 1, layout=layout)
    pos = fad.positions(seq, layout=layout)
    assert torch.equal(local, x[:, pos]), (local, pos)
    assert torch.equal(fad.unshard(local, 1, layout=layout), x)
    assert torch.equal(fad.unshard(local.transpose(0, 1), 0, layout=layout), x.transpose(0, 1))
    chunks = 2 * size if layout == "zigzag" else size
    n = seq // chunks
    expected = [rank] if layout == "contiguous" else [rank, 2 * size - 1 - rank]
    assert pos.tolist() == [c * n + i for c in expected for i in range(n)]
    with pytest.raises(ValueError, match=f"not divisible by {chunks}"):
        fad.shard(x[:, :-1], 1, layout=layout)
    with pytest.raises(ValueError, match=f"seq_len {seq + 1} is not divisible by {chunks}"):
        fad.positions(seq + 1, layout=layout)


def errors_case():
    """Bad calls raise on every rank, never hang: shapes that differ across ranks, lengths the
    layout cannot cut, heads ulysses cannot split, unknown methods."""
    rank, size = dist.get_rank(), dist.get_world_size()
    q = torch.randn(1, 2, 4 + 2 * rank, 8)
    with pytest.raises(ValueError, match="differ across ranks"):
        fad.attention(q, q, q)
    with pytest.raises(ValueError, match="differ across ranks"):
        fad.unshard(torch.zeros(2 + 2 * rank), 0)
    odd = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match=rf"sequence length {3 * size} is not divisible by {2 * size}"):
        fad.attention(odd, odd, odd)
    q = torch.randn(1, size + 1, 4, 8)
    with pytest.raises(
        ValueError, match=rf"Hq \({size + 1}\) and Hkv \({size + 1}\) must be divisible by the group size {size}"
    ):
        fad.attention(q, q, q, method="ulysses")
    with pytest.raises(ValueError, match="method must be one of"):
        fad.attention(q, q, q, method="tree")
    with pytest.raises(ValueError, match="layout must be one of"):
        fad.attention(q, q, q, layout="striped")
    with pytest.raises(NotImplementedError, match="no hook"):
        fad.register_torch_provider()
    # the group still works afterwards
    ok = torch.randn(1, 2, 4, 8)
    fad.attention(ok, ok, ok, causal=True)


def kvcache_case(dtype="float32"):
    """Decoding against a cache sharded across ranks: merged by lse equals one cache holding all."""
    size, rank = dist.get_world_size(), dist.get_rank()
    dtype = DTYPES[dtype]
    gen = torch.Generator().manual_seed(5)
    b, h, d, per_rank = 2, 4, 16, 12
    q = torch.randn(b, 1, h, d, generator=gen).to(dtype)
    k_all = torch.randn(b, per_rank * size, h, d, generator=gen).to(dtype)
    v_all = torch.randn(b, per_rank * size, h, d, generator=gen).to(dtype)
    lengths = torch.tensor([per_rank * size, per_rank * size - 7], dtype=torch.int32)
    # rank r holds keys [r * per_rank, (r + 1) * per_rank); sequence 1 ends 7 keys early (last rank's part)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    local_lengths = (lengths - rank * per_rank).clamp(0, per_rank).to(torch.int32)
    out, lse = fad.kvcache_attention(q, k_all[:, mine].clone(), v_all[:, mine].clone(), cache_seqlens=local_lengths)
    whole, whole_lse = fa.flash_attn_with_kvcache(q, k_all, v_all, cache_seqlens=lengths, return_softmax_lse=True)
    assert (out.float() - whole.float()).abs().max() <= (1e-5 if dtype == torch.float32 else 2e-2)
    assert (lse - whole_lse).abs().max() <= 1e-4
    # rows with no key on a rank (flash-attn's +inf lse) are left out of the merge
    first = (lengths.clamp(max=per_rank)).to(torch.int32)
    out, _ = fad.kvcache_attention(
        q, k_all[:, mine].clone(), v_all[:, mine].clone(), cache_seqlens=first if rank == 0 else first * 0
    )
    alone = fa.flash_attn_with_kvcache(q, k_all[:, :per_rank], v_all[:, :per_rank], cache_seqlens=first)
    assert (out.float() - alone.float()).abs().max() <= (1e-5 if dtype == torch.float32 else 2e-2)


def compile_case(method):
    """torch.compile(fullgraph=True) traces a context-parallel block (the ops and their fakes),
    forward and backward, and computes what eager does."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 8, 32, generator=gen)
    weight = torch.randn(32, 96, generator=gen) * 0.2

    def block(x, weight):
        q, k, v = (x @ weight).view(1, 8, 3, 4, 8).permute(2, 0, 3, 1, 4)
        return fad.attention(q, k, v, causal=True, method=method).sum()

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    eager_w, compiled_w = (weight.clone().requires_grad_() for _ in range(2))
    eager = block(x, eager_w)
    traced = compiled(x, compiled_w)
    eager.backward()
    traced.backward()
    assert (eager - traced).abs().max() <= 1e-5
    assert (eager_w.grad - compiled_w.grad).abs().max() <= 1e-5


def llama_case(method, layout="zigzag", steps=3):
    """A tiny Llama trains a few SGD steps context-parallel (fad.patch, position_ids from
    fad.positions, gradients summed by all_reduce_gradients) with the loss of one process
    training on the whole sequence."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    seq = 32
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 64, (1, seq), generator=gen)
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)  # next token, shifted globally
    count = (targets != -100).sum()
    torch.manual_seed(0)
    single = LlamaForCausalLM(config)
    torch.manual_seed(0)
    parallel = LlamaForCausalLM(config)
    single_opt = torch.optim.SGD(single.parameters(), lr=0.5)
    parallel_opt = torch.optim.SGD(parallel.parameters(), lr=0.5)
    ids_local, targets_local = fad.shard(ids, 1, layout=layout), fad.shard(targets, 1, layout=layout)
    positions = fad.positions(seq, layout=layout)[None]

    def loss_of(logits, labels):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / count

    for _ in range(steps):
        whole = loss_of(single(ids).logits, targets)
        whole.backward()
        single_opt.step()
        single_opt.zero_grad()
        with fad.patch(method=method, layout=layout):
            local = loss_of(parallel(ids_local, position_ids=positions).logits, targets_local)
        local.backward()
        fad.all_reduce_gradients(parallel)
        parallel_opt.step()
        parallel_opt.zero_grad()
        total = local.detach().clone()
        dist.all_reduce(total)
        assert abs(total.item() - whole.item()) <= 1e-4, (total.item(), whole.item())


def helpers_case():
    """average_loss: the group's mean as the value, 1/P of each rank's own loss as its gradient;
    all_reduce_gradients sums; a device gloo cannot take (MPS's case; "meta" here) is staged."""
    size, rank = dist.get_world_size(), dist.get_rank()
    loss = torch.tensor(float(rank + 1), requires_grad=True)
    mean = fad.average_loss(loss)
    assert mean.item() == sum(range(1, size + 1)) / size
    mean.backward()
    assert loss.grad.item() == 1.0 / size
    weight = torch.nn.Parameter(torch.zeros(3))
    weight.grad = torch.full((3,), float(rank))
    fad.all_reduce_gradients([weight])
    assert weight.grad.tolist() == [float(sum(range(size)))] * 3
    assert not fad._stages_through_cpu(torch.zeros(1), None)
    assert fad._stages_through_cpu(torch.zeros(1, device="meta"), None)
