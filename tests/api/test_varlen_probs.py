"""flash_attn_varlen_func(return_attn_probs=True): (out, softmax_lse, S_dmask) in flash-attn's padded
layout, against float64 references on each unpacked sequence: S_dmask's top-left [L_b, S_b] block of
sequence b is its undropped softmax (0 outside the block), its signs the very dropout mask the
forward applied (out is reconstructed from them), softmax_lse (nheads, total_q) with +inf for rows
that see no key."""

from __future__ import annotations

import math

import pytest
import torch

from flashattn_mps import _C, _varlen, flash_attn_varlen_func
from helpers import (
    FORWARD_NAMES,
    assert_gradients_match,
    core_options,
    max_error,
    packed_inputs,
    pieces,
    prefix_sums,
    randn,
    reference,
    slopes,
    slots,
    variant_scores,
)

# (lens_q, lens_k, dtype, (Hq, Hkv), causal, window, softcap, ALiBi kind, sinks, dropout_p, extra):
# empty and length-1 sequences, queries longer and shorter than keys, a sequence without keys;
# extra: rows past the grid's max_seqlen (max_seqlen_q, max_seqlen_k larger than any sequence)
# and rows of q past cu_seqlens_q[-1].
CASES = [
    ([3, 0, 1, 40], [5, 2, 1, 40], torch.float32, (4, 2), False, (-1, -1), 0.0, None, False, 0.0, 0),
    ([1, 1, 1], [17, 0, 30], torch.float16, (6, 1), True, (-1, -1), 0.0, None, False, 0.3, 0),
    ([33, 7], [7, 33], torch.bfloat16, (2, 2), False, (4, 2), 0.7, None, False, 0.2, 0),
    ([5, 8, 2], [9, 8, 60], torch.float32, (4, 2), True, (6, -1), 0.0, "bh", False, 0.5, 3),
    ([20, 1, 0, 12], [20, 40, 3, 12], torch.float16, (4, 1), False, (-1, -1), 0.0, "h", True, 0.0, 2),
    ([6, 9], [0, 9], torch.float32, (2, 1), True, (-1, -1), 1.0, None, True, 0.4, 1),
    ([2, 1, 3], [50, 20, 9], torch.bfloat16, (4, 2), True, (-1, 5), 0.0, "h", False, 0.25, 0),
    ([0], [4], torch.float32, (2, 2), False, (-1, -1), 0.0, None, False, 0.1, 0),
]


def sequence_probabilities(q, k, b, cq, ck, causal, window, softcap, alibi, sinks):
    """Sequence b's float64 softmax (1, H, L_b, S_b) (sinks in its denominator), its lse (1, H, L_b)
    (-inf for a row that sees no key and no sink) and which keys each row sees."""
    qb, kb = pieces(q, cq, b).double(), pieces(k, ck, b).double()
    slope = None if alibi is None else (alibi if alibi.dim() == 1 else alibi[b])
    scores, seen = variant_scores(qb, kb, causal, True, window, None, softcap, slope)
    logits = scores.masked_fill(~seen, -math.inf)
    if sinks is not None:
        logits = torch.cat([logits, sinks.double()[None, :, None, None].expand(*logits.shape[:-1], 1)], -1)
    lse = torch.logsumexp(logits, -1)
    probs = torch.where(seen, (scores - lse[..., None]).exp(), torch.zeros((), dtype=torch.float64))
    return probs, lse, seen


@pytest.mark.parametrize("case", range(len(CASES)))
def test_probs_lse_and_mask_match_each_sequence(gen, case):
    lens_q, lens_k, dtype, (hq, hkv), causal, window, softcap, alibi_kind, with_sinks, dropout_p, extra = CASES[case]
    q, k, v = packed_inputs(gen, lens_q, lens_k, hq, hkv, 16, 24, dtype)
    q = torch.cat([q * 2, randn(gen, extra, hq, 16, dtype=dtype)])  # rows past cu_seqlens_q[-1]
    alibi = slopes(gen, alibi_kind, len(lens_q), hq)
    sinks = randn(gen, hq) if with_sinks else None
    cq, ck = prefix_sums(lens_q), prefix_sums(lens_k)
    max_q, max_k = max(lens_q) + extra, max(lens_k) + extra
    out, lse, s_dmask = flash_attn_varlen_func(
        q,
        k,
        v,
        cq,
        ck,
        max_q,
        max_k,
        dropout_p=dropout_p,
        causal=causal,
        window_size=window,
        softcap=softcap,
        alibi_slopes=alibi,
        return_attn_probs=True,
        sinks=sinks,
    )
    assert out.shape == (q.shape[0], hq, 24) and out.dtype == dtype
    assert lse.shape == (hq, q.shape[0]) and lse.dtype == torch.float32
    assert s_dmask.shape == (len(lens_q), hq, max_q, max_k) and s_dmask.dtype == dtype
    assert torch.all(lse[:, int(cq[-1]) :] == math.inf)  # rows of no sequence see no key
    probs_bound = 1e-5 if dtype == torch.float32 else 1e-2
    dropped_any = False
    for b, (length, keys) in enumerate(zip(lens_q, lens_k)):
        probs, golden_lse, seen = sequence_probabilities(q, k, b, cq, ck, causal, window, softcap, alibi, sinks)
        block = s_dmask[b, :, :length, :keys]
        outside = s_dmask[b].clone()
        outside[:, :length, :keys] = 0
        assert torch.all(outside == 0) and not torch.signbit(outside).any()
        assert max_error(block.abs()[None], probs) <= probs_bound
        rows = lse[:, int(cq[b]) : int(cq[b + 1])][None]
        expected_lse = golden_lse.masked_fill(golden_lse == -math.inf, math.inf)  # flash-attn's convention
        assert max_error(rows, expected_lse) <= 1e-4 * max(
            1.0, expected_lse[expected_lse.isfinite()].abs().max().item() if expected_lse.isfinite().any() else 1.0
        )
        keep = ~torch.signbit(block)[None]
        if dropout_p == 0.0:
            assert keep.all()
        dropped_any |= bool((~keep & seen).any())
        # out rebuilt from the exposed mask: the forward dropped exactly these probabilities.
        options = dict(
            causal=causal,
            bottom_right=True,
            window=window,
            softcap=softcap,
            alibi=None if alibi is None else (alibi if alibi.dim() == 1 else alibi[b]),
            sinks=sinks,
            dropout_mask=keep,
            dropout_p=dropout_p,
        )
        inputs = [pieces(t, c, b) for t, c in ((q, cq), (k, ck), (v, ck))]
        golden = reference(
            *[t.double() for t in inputs], **{**options, "sinks": None if sinks is None else sinks.double()}
        )
        same_dtype = reference(*inputs, **{**options, "sinks": None if sinks is None else sinks.to(dtype)})
        actual = pieces(out, cq, b)
        assert max_error(actual, golden) <= max(1e-5, 5 * max_error(same_dtype, golden))
    assert dropped_any == (dropout_p > 0.0 and sum(lens_q) > 0)


def test_gradients_flow_through_out_with_the_probs(gen):
    """return_attn_probs changes nothing else (same seed, same out and gradients), and the gradients
    are those of the reference applying the exposed mask: the backward regenerates it."""
    lens_q, lens_k = [7, 0, 1, 12], [9, 4, 6, 12]
    q, k, v = packed_inputs(gen, lens_q, lens_k, 4, 2, 16, 16, torch.float32)
    cq, ck = prefix_sums(lens_q), prefix_sums(lens_k)
    dout = randn(gen, q.shape[0], 4, 16)
    results = []
    for probs in (True, False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(5)
        got = flash_attn_varlen_func(*leaves, cq, ck, 12, 12, dropout_p=0.3, causal=True, return_attn_probs=probs)
        out = got[0] if probs else got
        results.append((out, torch.autograd.grad(out, leaves, dout), got[2] if probs else None))
    (out, grads, s_dmask), (plain_out, plain_grads, _) = results
    assert torch.equal(out, plain_out) and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    for b in range(len(lens_q)):
        keep = ~torch.signbit(s_dmask[b, :, : lens_q[b], : lens_k[b]])[None]

        def per_sequence(qp, kp, vp, b=b, keep=keep):
            return reference(qp, kp, vp, causal=True, bottom_right=True, dropout_mask=keep, dropout_p=0.3)

        piece_grads = [pieces(g, c, b) for g, c in ((grads[0], cq), (grads[1], ck), (grads[2], ck))]
        inputs = [pieces(t, c, b) for t, c in ((q, cq), (k, ck), (v, ck))]
        # gradients of this sequence's out alone: the other sequences' rows give none to its pieces
        assert_gradients_match(piece_grads, per_sequence, inputs, pieces(dout, cq, b))


def test_return_attn_probs_errors(gen):
    q, k, v = packed_inputs(gen, [3], [3], 2, 2, 8, 8, torch.float32)
    cu = prefix_sums([3])
    with pytest.raises(TypeError, match="return_attn_probs must be a bool"):
        flash_attn_varlen_func(q, k, v, cu, cu, 3, 3, return_attn_probs=1)
    with pytest.raises(NotImplementedError, match="return_attn_probs=True with a block_table"):
        flash_attn_varlen_func(
            q, k, v, cu, cu, 3, 3, return_attn_probs=True, block_table=torch.zeros(1, 1, dtype=torch.int32)
        )


def test_core_refuses_the_probability_pass_through_a_block_table():
    """The simple kernel reads keys in place: the C layer refuses write_probs with a paged table
    instead of reading the pool as if it were one sequence's keys."""
    q, out, lse = torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1)
    pool = torch.zeros(4, 2, 4, 8)  # (pages, Hkv, page_size, E)
    table = torch.tensor([[0, 0, 1, 0, 0, 6]], dtype=torch.int32)
    sequences = _varlen.sequence_args(table, 1, 6, torch.tensor([[3, 1, 0, 2]], dtype=torch.int32))
    with pytest.raises(
        ValueError, match="block_table: a paged KV cache is read by the prefill and decode kernels only"
    ):
        table, scratch, max_q, max_kv, block_table = sequences
        _C.forward(
            _C.DEVICE_CPU,
            slots(
                FORWARD_NAMES,
                (q, pool, pool, out, lse),
                rng_state=torch.zeros(4),
                sequences=table,
                sequence_scratch=scratch,
                block_table=block_table,
            ),
            core_options(write_probs=True, max_q_len=max_q, max_kv_len=max_kv),
            torch.zeros(16),
        )
