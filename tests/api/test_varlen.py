"""flash_attn_varlen_func: packed sequences in one launch (forward in every kernel, backward),
against float64 references on the unpacked pieces (helpers.reference per sequence)."""

from __future__ import annotations

import pytest
import torch

import flashattn_mps
from flashattn_mps import _C, _varlen, flash_attn_varlen_func
from flashattn_mps._options import AttentionOptions
from helpers import (
    ALL_DTYPES,
    FORWARD_NAMES,
    assert_gradients_match,
    check_packed,
    core_options,
    max_error,
    needs_torch_2_6,
    packed_inputs,
    per_sequence_reference,
    prefix_sums,
    randn,
    slopes,
    slots,
)

# Length mixes: empty and length-1 sequences, queries longer and shorter than keys, one long
# sequence among short ones; max_seqlen_q of at most 8 takes the decode kernel, longer the prefill.
MIXES = [
    ([3, 0, 1, 40], [5, 2, 1, 40]),
    ([1, 1, 1], [17, 0, 300]),
    ([33, 7], [7, 33]),
    ([0], [4]),
    ([5, 8, 2], [9, 8, 600]),
    ([20, 1, 0, 37], [20, 64, 3, 37]),
]
# (causal, window, softcap, ALiBi shape kind)
OPTIONS = [
    (False, (-1, -1), 0.0, None),
    (True, (-1, -1), 0.0, None),
    (False, (4, 2), 0.0, None),
    (True, (6, -1), 0.7, None),
    (False, (-1, -1), 0.0, "h"),
    (True, (3, -1), 0.0, "bh"),
    (False, (-1, 0), 1.5, "bh"),
]


@pytest.mark.parametrize("mix", range(len(MIXES)))
@pytest.mark.parametrize("option", range(len(OPTIONS)))
def test_forward_matches_each_sequence(gen, mix, option):
    lens_q, lens_k = MIXES[mix]
    causal, window, softcap, alibi_kind = OPTIONS[option]
    dtype = ALL_DTYPES[(mix + option) % 3]
    hq, hkv = [(4, 2), (2, 2), (6, 1)][(mix * 7 + option) % 3]
    e, ev = [(16, 16), (32, 24), (8, 40)][(mix + 2 * option) % 3]
    inputs = packed_inputs(gen, lens_q, lens_k, hq, hkv, e, ev, dtype)
    alibi = slopes(gen, alibi_kind, len(lens_q), hq)
    out = flash_attn_varlen_func(
        *inputs,
        prefix_sums(lens_q),
        prefix_sums(lens_k),
        max(lens_q),
        max(lens_k),
        causal=causal,
        window_size=window,
        softcap=softcap,
        alibi_slopes=alibi,
    )
    check_packed(out, inputs, lens_q, lens_k, causal=causal, window=window, softcap=softcap, alibi=alibi)


@pytest.mark.parametrize("kernel", [_C.KERNEL_SIMPLE, _C.KERNEL_FORWARD, _C.KERNEL_DECODE])
@pytest.mark.parametrize("causal", [False, True])
def test_every_kernel_reads_the_table(gen, kernel, causal):
    lens_q, lens_k = [4, 0, 9, 1], [6, 3, 9, 270]
    inputs = packed_inputs(gen, lens_q, lens_k, 4, 2, 16, 16, torch.float32)
    q, k, v = inputs
    cq, ck = prefix_sums(lens_q), prefix_sums(lens_k)
    table = torch.stack(
        [torch.zeros(4, dtype=torch.int32), cq[:-1], cq.diff(), torch.zeros(4, dtype=torch.int32), ck[:-1], ck.diff()],
        1,
    ).contiguous()
    out = torch.full((q.shape[0], 4, 16), float("nan"))
    views = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v, out)]
    _varlen.run_forward(
        *views,
        None,
        AttentionOptions(0.25, causal, (1, -1, -1), kernel=kernel),
        _varlen.sequence_args(table, max(lens_q), max(lens_k)),
    )
    check_packed(out, inputs, lens_q, lens_k, causal=causal, scale=0.25)


def test_rows_past_the_last_sequence_are_left_alone(gen):
    q, k, v = packed_inputs(gen, [10], [10], 2, 2, 16, 16, torch.float32)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu, cu, 4, 4)
    check_packed(out[:7], (q[:7], k[:7], v[:7]), [3, 4], [3, 4])


@pytest.mark.parametrize("case", range(4))
def test_gradients_match_each_sequence(gen, case):
    lens_q, lens_k = [
        ([3, 0, 1, 40], [5, 2, 1, 40]),
        ([33, 7], [7, 33]),
        ([1, 6], [70, 6]),
        ([20, 1, 0, 37], [20, 64, 3, 37]),
    ][case]
    causal, window, softcap, alibi_kind = OPTIONS[[1, 2, 3, 5][case]]
    hq, hkv = [(4, 2), (2, 2), (6, 3), (4, 1)][case]
    dtype = [torch.float32, torch.float16, torch.bfloat16, torch.float32][case]
    inputs = packed_inputs(gen, lens_q, lens_k, hq, hkv, 16, 24, dtype)
    alibi = slopes(gen, alibi_kind, len(lens_q), hq)
    options = dict(causal=causal, window=window, softcap=softcap, alibi=alibi)
    dout = randn(gen, sum(lens_q), hq, 24, dtype=dtype)
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = flash_attn_varlen_func(
        *leaves,
        prefix_sums(lens_q),
        prefix_sums(lens_k),
        max(lens_q),
        max(lens_k),
        causal=causal,
        window_size=window,
        softcap=softcap,
        alibi_slopes=alibi,
    )
    grads = torch.autograd.grad(out, leaves, dout)
    assert_gradients_match(grads, lambda *t: per_sequence_reference(*t, lens_q, lens_k, **options), inputs, dout)


def test_one_launch_over_every_sequence(gen):
    """The plan over a table: the table kernel, then one attention dispatch whose grid covers every
    sequence (B on the batch axis) and max_seqlen_q rows."""
    q, k, v = packed_inputs(gen, [40, 2, 17], [40, 5, 17], 4, 2, 16, 16, torch.float32)
    cq, ck = prefix_sums([40, 2, 17]), prefix_sums([40, 5, 17])
    table = torch.stack([cq[:-1] * 0, cq[:-1], cq.diff(), ck[:-1] * 0, ck[:-1], ck.diff()], 1).contiguous()
    out = torch.empty_like(q)
    views = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v, out)]
    _, scratch, max_q, max_kv, _ = _varlen.sequence_args(table, 40, 40)
    plan = _C.plan_forward(
        _C.DEVICE_CPU,
        slots(FORWARD_NAMES, views, sequences=table, sequence_scratch=scratch),
        core_options(scale=0.25, max_q_len=max_q, max_kv_len=max_kv),
    )
    assert [d["function"] for d in plan["dispatches"]] == ["fa_sequence_table_float", "fa_forward_float"]
    assert plan["dispatches"][1]["grid"] == (2, 4, 3)  # ceil(40 / 32) blocks, Hq, sequences
    assert plan["dispatches"][1]["constants"][12] == 1


def bad_call(gen, **change):
    q, k, v = packed_inputs(gen, [3, 4], [3, 4], 2, 2, 8, 8, torch.float32)
    args = dict(
        q=q,
        k=k,
        v=v,
        cu_seqlens_q=prefix_sums([3, 4]),
        cu_seqlens_k=prefix_sums([3, 4]),
        max_seqlen_q=4,
        max_seqlen_k=4,
    )
    args.update(change)
    return flash_attn_varlen_func(**args)


@pytest.mark.parametrize(
    "change, error, words",
    [
        (dict(cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int64)), TypeError, "cu_seqlens_q must be int32"),
        (dict(cu_seqlens_k=[0, 3, 7]), TypeError, "cu_seqlens_k must be an int32"),
        (dict(cu_seqlens_q=torch.tensor([0, 5, 3], dtype=torch.int32)), ValueError, "non-decreasing"),
        (dict(cu_seqlens_q=torch.tensor([1, 3, 7], dtype=torch.int32)), ValueError, "must start at 0"),
        (dict(cu_seqlens_k=torch.tensor([0, 3, 9], dtype=torch.int32)), ValueError, "past the 7 packed rows"),
        (dict(cu_seqlens_k=torch.tensor([0, 7], dtype=torch.int32)), ValueError, "cu_seqlens_k must be (3,)"),
        (dict(max_seqlen_q=3), ValueError, "max_seqlen_q = 3"),
        (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k must be in"),
        (dict(max_seqlen_k=4.0), TypeError, "max_seqlen_k must be an int"),
        (dict(dropout_p=1.5), ValueError, "dropout_p must be in"),
        (dict(sinks=torch.zeros(3)), ValueError, "sinks must be (Hq,)"),
        (
            dict(block_table=torch.zeros(2, 1, dtype=torch.int32)),
            ValueError,
            "with block_table, k must be the 4-D pool",
        ),
    ],
)
def test_errors_name_the_argument(gen, change, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        bad_call(gen, **change)


@pytest.mark.parametrize(
    "entry", [[0, 0, 5, 0, 0, 5], [0, 5, 3, 0, 5, 3], [0, -4, 3, 9, 1, 2**31 - 1], [7, 2**31 - 1, -1, -5, 6, 4]]
)
def test_core_clamps_a_table_it_cannot_trust(gen, entry):
    """The C layer cannot read a table in device memory: out-of-range entries are clamped by the
    table kernel into the views (never an access outside them), cutting the sequence short."""
    q, k, v = packed_inputs(gen, [6], [6], 2, 2, 8, 8, torch.float32)
    table = torch.tensor([entry, [0, 0, 2, 0, 0, 2]], dtype=torch.int32)
    out = torch.zeros_like(q)
    views = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v, out)]
    for kernel in (_C.KERNEL_DECODE, _C.KERNEL_FORWARD, _C.KERNEL_SIMPLE):
        _varlen.run_forward(
            *views, None, AttentionOptions(0.3, False, (1, -1, -1), kernel=kernel), _varlen.sequence_args(table, 4, 4)
        )
        assert out.isfinite().all()


def test_core_rejects_malformed_tables(gen):
    q, k, v = packed_inputs(gen, [6], [6], 2, 2, 8, 8, torch.float32)
    storage = torch.empty(4096)
    out = storage[:96].view(6, 2, 8)
    views = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v, out)]
    good = torch.zeros(2, 6, dtype=torch.int32)
    run = lambda seq: _varlen.run_forward(*views, None, AttentionOptions(0.3, False), seq)
    with pytest.raises(TypeError, match="sequences: the table must be int32"):
        run(_varlen.sequence_args(good.float(), 4, 4))
    with pytest.raises(ValueError, match=r"contiguous \(B, 6\)"):
        run(_varlen.sequence_args(torch.zeros(2, 5, dtype=torch.int32), 4, 4))
    with pytest.raises(ValueError, match=r"contiguous \(B, 6\)"):
        run(_varlen.sequence_args(torch.zeros(6, 2, dtype=torch.int32).t(), 4, 4))
    with pytest.raises(ValueError, match="sequence_scratch: needs"):
        run((good, torch.empty(3), 4, 4, None))
    with pytest.raises(ValueError, match="max_seqlen_q and max_seqlen_k"):
        run(_varlen.sequence_args(good, -1, 4))
    with pytest.raises(ValueError, match="overlaps"):
        run((good, storage[: 2 * _C.SEQUENCE_PARAMS_BYTES // 4], 4, 4, None))


@pytest.mark.parametrize("through", ["position_ids", "flash_kwargs"])
def test_transformers_padding_free_llama_matches_eager_per_sequence(monkeypatch, through):
    """A tiny random Llama on a packed batch (position_ids restarting at 0, or flash-attn's
    cu_seq_lens / max_length kwargs) against eager attention on each sequence alone; the
    varlen kernels run (one forward call per layer) and the logits match."""
    needs_torch_2_6("transformers")
    transformers = pytest.importorskip("transformers")
    from flashattn_mps.integrations import transformers as fa_transformers

    name = fa_transformers.register(cpu=True)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM(config).eval()
    eager.set_attn_implementation("eager")
    ours = transformers.LlamaForCausalLM(config).eval()
    ours.load_state_dict(eager.state_dict())
    ours.set_attn_implementation(name)
    lengths = [5, 1, 9]
    ids = [torch.randint(0, 64, (n,)) for n in lengths]
    packed = torch.cat(ids)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    calls, host_checks = [], []
    from flashattn_mps import _core

    run, check = _core.forward, _varlen._check_prefix_sums
    monkeypatch.setattr(
        _core,
        "forward",
        lambda device, tensors, *a: (
            tensors.get("sequences") is not None and calls.append(1) or run(device, tensors, *a)
        ),
    )
    monkeypatch.setattr(_varlen, "_check_prefix_sums", lambda *a, **k: host_checks.append(1) or check(*a, **k))
    extra = {}
    if through == "flash_kwargs":
        cu = prefix_sums(lengths)
        extra = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
    logits = ours(packed, position_ids=positions, **extra).logits[0]
    assert len(calls) == config.num_hidden_layers
    # Prefix sums built from position_ids are good by construction: no per-layer host read of them;
    # the caller's flash kwargs are validated (q's and k's) in every layer.
    assert len(host_checks) == (0 if through == "position_ids" else 2 * config.num_hidden_layers)
    expected = torch.cat([eager(x[None]).logits[0] for x in ids])
    assert max_error(logits, expected) < 1e-4


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_sinks_forward_and_gradients_per_sequence(gen, dtype, causal):
    """Sinks in the packed launch: each sequence's rows count exp(sink) once; dsinks sums every
    sequence's rows (an empty sequence and unused rows of q past the last sequence add nothing)."""
    lens_q, lens_k = [5, 0, 12, 1], [7, 3, 12, 30]
    q, k, v = packed_inputs(gen, lens_q, lens_k, 4, 2, 16, 16, dtype)
    q = torch.cat([q, randn(gen, 3, 4, 16, dtype=dtype)])  # rows past cu_seqlens_q[-1]: no sequence's
    sinks = randn(gen, 4)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    out = flash_attn_varlen_func(
        *leaves[:3], prefix_sums(lens_q), prefix_sums(lens_k), max(lens_q), max(lens_k), causal=causal, sinks=leaves[3]
    )
    used = sum(lens_q)
    check_packed(out[:used], (q[:used], k, v), lens_q, lens_k, causal=causal, sinks=sinks.to(dtype))
    dout = randn(gen, *out.shape, dtype=dtype)
    (out[:used] * dout[:used]).sum().backward()
    golden = [t.detach().double().requires_grad_() for t in (q[:used], k, v, sinks)]
    expected = per_sequence_reference(*golden[:3], lens_q, lens_k, causal=causal, sinks=golden[3])
    (expected * dout[:used].double()).sum().backward()
    assert torch.all(leaves[0].grad[used:] == 0)
    bound = 2e-5 if dtype == torch.float32 else 4e-2
    for name, got, want in (
        ("dq", leaves[0].grad[:used], golden[0].grad),
        ("dk", leaves[1].grad, golden[1].grad),
        ("dv", leaves[2].grad, golden[2].grad),
        ("dsinks", leaves[3].grad, golden[3].grad),
    ):
        assert max_error(got, want) <= bound * max(1.0, want.abs().max().item()), (name, max_error(got, want))


def test_dropout_drops_as_flash_attn_func_on_a_batch(gen):
    """Dropout in the packed launch keys each element by (sequence, head, row in the sequence,
    key in the sequence): sequences of equal lengths drop exactly what flash_attn_func drops for
    the same batch under the same seed, forward and gradients (flash_attn_func's mask is checked
    against its exposed probabilities in kernels/test_dropout.py); another seed drops differently."""
    batch, length, keys = 3, 9, 13
    q, k, v = randn(gen, batch, length, 4, 16), randn(gen, batch, keys, 2, 16), randn(gen, batch, keys, 2, 16)
    packed = [t.reshape(-1, *t.shape[2:]).detach().requires_grad_() for t in (q, k, v)]
    batched = [t.detach().requires_grad_() for t in (q, k, v)]
    cu_q, cu_k = prefix_sums([length] * batch), prefix_sums([keys] * batch)
    torch.manual_seed(11)
    out = flash_attn_varlen_func(*packed, cu_q, cu_k, length, keys, dropout_p=0.3, causal=True)
    torch.manual_seed(11)
    expected = flashattn_mps.flash_attn_func(*batched, dropout_p=0.3, causal=True)
    assert torch.allclose(out, expected.reshape(out.shape), atol=1e-6)
    dout = randn(gen, *expected.shape)
    out.backward(dout.reshape(out.shape))
    expected.backward(dout)
    for got, want in zip(packed, batched):
        assert torch.allclose(got.grad, want.grad.reshape(got.grad.shape), atol=1e-5)
    torch.manual_seed(12)
    other = flash_attn_varlen_func(*(t.detach() for t in packed), cu_q, cu_k, length, keys, dropout_p=0.3, causal=True)
    assert not torch.allclose(other, out)
