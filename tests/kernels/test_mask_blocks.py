"""The additive mask's block-class pre-pass (metal/fa_mask_blocks.h): the classes it writes for
crafted masks (zero blocks, -inf blocks, NaN or +inf inside an otherwise -inf block, partial blocks
at the edges, broadcast masks), the q and k maxima that let a -inf block be skipped only when its
scores are finite, and the forward's parity with float64 under float masks."""

from __future__ import annotations

import pytest
import torch

from flashattn_mps import _C, _sources, explain_plan, flash_attention
from helpers import ALL_DTYPES, core_options, max_error, randn, sdpa

SKIP, ZERO, ADD = 0, 1, 2
NEG_INF, NAN, INF = float("-inf"), float("nan"), float("inf")


def expected_classes(mask: torch.Tensor) -> torch.Tensor:
    """The class of each 8 x 8 block of each distinct broadcast block of a (B, H, L, S) mask view."""
    distinct = mask[tuple(slice(0, 1) if s == 0 else slice(None) for s in mask.stride())].double()
    b, h, rows, keys = distinct.shape
    out = torch.empty(b, h, (rows + 7) // 8, (keys + 7) // 8, dtype=torch.uint8)
    for rb in range(out.shape[2]):
        for kb in range(out.shape[3]):
            block = distinct[:, :, 8 * rb : 8 * rb + 8, 8 * kb : 8 * kb + 8].flatten(2)
            skip, zero = (block == NEG_INF).all(-1), (block == 0).all(-1)
            out[:, :, rb, kb] = torch.where(skip, SKIP, torch.where(zero, ZERO, ADD)).to(torch.uint8)
    return out


def run_pre_pass(q, k, v, mask):
    """Runs the forward through the core with a workspace of our own and returns it with the plan:
    the classes (bytes), then max |q| per 8 rows and max |k| per 8 keys (floats)."""
    _sources.ensure_registered()  # this test calls the core directly
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    tensors = {"q": q, "k": k, "v": v, "out": out, "mask": mask}
    options = core_options(scale=q.shape[-1] ** -0.5, kernel=_C.KERNEL_FORWARD)
    plan = _C.plan_forward(_C.DEVICE_CPU, tensors, options)
    workspace = torch.full((plan["workspace_bytes"] // 4,), NAN)
    _C.forward(_C.DEVICE_CPU, tensors, options, workspace)
    return workspace, plan, out


def split_workspace(workspace, q, k, mask):
    classes = expected_classes(mask)
    n = classes.numel()
    q_offset = (n + 3) // 4
    b, h, lq, _ = q.shape
    q_items = b * h * ((lq + 7) // 8)
    got = workspace.view(torch.uint8)[:n].view(classes.shape)
    q_max = workspace[q_offset : q_offset + q_items]
    k_max = workspace[q_offset + q_items :]
    return classes, got, q_max, k_max


def block_max(x):
    """max |x| per (batch, head, 8 rows), +inf where one is not finite."""
    b, h, n, _ = x.shape
    out = []
    for r in range(0, n, 8):
        block = x[:, :, r : r + 8].double()
        largest = block.abs().flatten(2).amax(-1)
        out.append(torch.where(block.isfinite().flatten(2).all(-1), largest, INF))
    return torch.stack(out, -1).flatten().float()


def crafted_mask(lq, lk, dtype):
    """Blocks of zeros, of -inf, -inf with one NaN, -inf with one +inf, -0.0, random values; edge
    blocks partial (lq, lk not multiples of 8)."""
    mask = torch.randn(lq, lk, generator=torch.Generator().manual_seed(5))
    mask[0:8, 0:8] = 0.0
    mask[0:8, 8:16] = NEG_INF
    mask[8:16, 0:8] = NEG_INF
    mask[11, 3] = NAN  # NaN inside an otherwise -inf block: added, so it reaches its row
    mask[8:16, 8:16] = NEG_INF
    mask[9, 12] = INF
    mask[16:, 16:] = NEG_INF  # the partial corner block
    mask[0:8, 16:24] = -0.0
    mask[16:, 0:8] = 0.0
    mask[16, 5] = 1e-3  # not zero in any dtype
    return mask.to(dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_classes_and_maxima_of_a_crafted_mask(gen, dtype):
    lq, lk = 21, 27
    q, k, v = (
        randn(gen, 1, 2, lq, 16, dtype=dtype),
        randn(gen, 1, 1, lk, 16, dtype=dtype),
        randn(gen, 1, 1, lk, 8, dtype=dtype),
    )
    q[0, 1, 19, 3] = INF  # the last (partial) row block of head 1
    k[0, 0, 9, 0] = NAN  # key block 1
    mask = crafted_mask(lq, lk, dtype)[None, None].expand(1, 2, lq, lk)
    workspace, plan, _ = run_pre_pass(q, k, v, mask)
    assert [d["function"].rsplit("_", 1)[0] for d in plan["dispatches"]] == ["fa_forward_mask_blocks", "fa_forward"]
    classes, got, q_max, k_max = split_workspace(workspace, q, k, mask)
    assert classes.shape == (1, 1, 3, 4)  # broadcast over the heads: classified once
    assert classes[0, 0].tolist() == [[ZERO, SKIP, ZERO, ADD], [ADD, ADD, ADD, ADD], [ADD, ADD, SKIP, SKIP]]
    assert torch.equal(got, classes)
    assert torch.equal(q_max, block_max(q)) and q_max[-1] == INF
    assert torch.equal(k_max, block_max(k)) and k_max[1] == INF


@pytest.mark.parametrize(
    "shape,expand",
    [
        ((1, 1, 1, 27), (2, 3, 21, 27)),  # one row of keys for every row, head and batch
        ((2, 1, 21, 1), (2, 3, 21, 27)),  # one entry per row: padding-style per batch
        ((2, 3, 21, 27), None),  # nothing broadcast
    ],
)
def test_broadcast_masks_are_classified_per_distinct_block(gen, shape, expand):
    lq, lk = 21, 27
    q, k, v = randn(gen, 2, 3, lq, 16), randn(gen, 2, 3, lk, 16), randn(gen, 2, 3, lk, 16)
    g = torch.Generator().manual_seed(2)
    base = torch.where(torch.rand(shape, generator=g) > 0.5, 0.0, NEG_INF)
    base[..., :1] = 0.0  # every row keeps key 0
    mask = base if expand is None else base.expand(expand)
    workspace, plan, out = run_pre_pass(q, k, v, mask)
    classes, got, _, _ = split_workspace(workspace, q, k, mask)
    distinct = [1 if s == 0 else n for s, n in zip(mask.stride(), mask.shape)]
    assert classes.shape == (distinct[0], distinct[1], (distinct[2] + 7) // 8, (distinct[3] + 7) // 8)
    assert torch.equal(got, classes)
    golden = sdpa(q.double(), k.double(), v.double(), attn_mask=mask.double(), scale=16**-0.5)
    reference = sdpa(q, k, v, attn_mask=mask, scale=16**-0.5)
    assert max_error(out, golden) <= max(1e-5, 5 * max_error(reference, golden))


def float_causal(lq, lk, dtype=torch.float32):
    """transformers' float causal mask: 0 on and below the diagonal, the dtype's -inf above."""
    return torch.zeros(lq, lk).masked_fill(torch.ones(lq, lk, dtype=torch.bool).triu(1), NEG_INF).to(dtype)


def padding_mask(lq, lk, kept):
    """A batch of key-padding masks: batch entry i keeps its first kept[i] keys."""
    keys = torch.arange(lk)
    rows = [torch.where(keys < n, 0.0, NEG_INF).expand(lq, lk) for n in kept]
    return torch.stack(rows)[:, None]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("mask_kind", ["causal", "padding", "nan", "masked-rows"])
def test_forward_parity_under_float_masks(gen, dtype, mask_kind):
    lq, lk = 77, 131
    q, k, v = (
        randn(gen, 2, 4, lq, 64, dtype=dtype),
        randn(gen, 2, 2, lk, 64, dtype=dtype),
        randn(gen, 2, 2, lk, 48, dtype=dtype),
    )
    if mask_kind == "causal":
        mask = float_causal(lq, lk, dtype)
    elif mask_kind == "padding":
        mask = padding_mask(lq, lk, [lk, 50]).expand(2, 4, lq, lk).to(dtype)
    elif mask_kind == "nan":  # a NaN inside an otherwise -inf block: its row is NaN, as SDPA's
        mask = float_causal(lq, lk, dtype)
        mask[40, 100] = NAN
    else:  # rows that see no key give 0
        mask = float_causal(lq, lk, dtype)
        mask[16:32] = NEG_INF
    out = flash_attention(q, k, v, attn_mask=mask, kernel="forward")
    golden = sdpa(q.double(), k.double(), v.double(), attn_mask=mask.double())
    reference = sdpa(q, k, v, attn_mask=mask)
    if mask_kind == "nan":
        assert out[:, :, 40].isnan().all() and golden[:, :, 40].isnan().all()
        keep = torch.arange(lq) != 40
        out, golden, reference = out[:, :, keep], golden[:, :, keep], reference[:, :, keep]
    if mask_kind == "masked-rows":
        assert (out[:, :, 16:32] == 0).all()
        keep = (torch.arange(lq) < 16) | (torch.arange(lq) >= 32)
        out, golden, reference = out[:, :, keep], golden[:, :, keep], reference[:, :, keep]
    assert max_error(out, golden) <= max(1e-5, 5 * max_error(reference, golden))


@pytest.mark.parametrize("poison", ["nan", "inf", "huge"])
def test_a_minus_inf_block_is_not_skipped_when_its_scores_may_not_be_finite(gen, poison):
    """Under a float causal mask a key above the diagonal whose scores are NaN or infinite (a NaN
    or infinite entry, or finite entries whose product overflows) makes every row NaN, as SDPA's:
    the pre-pass's maxima keep those blocks added."""
    q, k, v = randn(gen, 1, 1, 40, 16).abs() + 0.5, randn(gen, 1, 1, 40, 16), randn(gen, 1, 1, 40, 16)
    k[0, 0, 37, :] = {"nan": NAN, "inf": INF, "huge": 3e38}[poison]  # huge: every float score of key 37 is +inf
    mask = float_causal(40, 40)
    out = flash_attention(q, k, v, attn_mask=mask, kernel="forward")
    assert sdpa(q, k, v, attn_mask=mask).isnan().all() and out.isnan().all()


def test_the_pre_pass_is_planned_for_additive_masks_only(gen):
    q, k, v = randn(gen, 1, 2, 40, 32), randn(gen, 1, 2, 64, 32), randn(gen, 1, 2, 64, 32)
    functions = lambda **kw: [d["function"] for d in explain_plan(q, k, v, kernel="forward", **kw)["dispatches"]]  # noqa: E731
    assert functions(attn_mask=float_causal(40, 64)) == ["fa_forward_mask_blocks_float", "fa_forward_float"]
    assert functions(attn_mask=float_causal(40, 64) == 0) == ["fa_forward_float"]  # bool: the tiles' own vote
    assert functions() == ["fa_forward_float"]
    plan = explain_plan(q, k, v, kernel="forward", attn_mask=float_causal(40, 64))
    # classes of (5 x 8) blocks broadcast over the batch and heads, then 2 x 5 q and 2 x 8 k maxima
    assert plan["workspace_bytes"] == 4 * ((40 + 3) // 4 + 2 * 5 + 2 * 8)
    assert plan["dispatches"][1]["constants"][_C.FC_MASK_BLOCKS] == 1
    assert plan["dispatches"][0]["cost"]["min_bytes_written"] == plan["workspace_bytes"]


# --- the backward -----------------------------------------------------------------------------


def gradients(attention, dout, *inputs):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    attention(*inputs).backward(dout.to(inputs[0].dtype))
    return [t.grad for t in inputs]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("mask_kind", ["causal", "padding", "masked-rows"])
def test_gradients_under_float_masks(gen, dtype, mask_kind):
    lq, lk = 45, 70
    q, k, v = (
        randn(gen, 2, 4, lq, 32, dtype=dtype),
        randn(gen, 2, 2, lk, 32, dtype=dtype),
        randn(gen, 2, 2, lk, 24, dtype=dtype),
    )
    dout = randn(gen, 2, 4, lq, 24)
    if mask_kind == "causal":
        mask = float_causal(lq, lk, dtype)
    elif mask_kind == "padding":
        mask = padding_mask(lq, lk, [lk, 30]).expand(2, 4, lq, lk).to(dtype)
    else:
        mask = float_causal(lq, lk, dtype)
        mask[8:24] = NEG_INF
    mine = gradients(lambda a, b, c: flash_attention(a, b, c, attn_mask=mask), dout, q, k, v)
    # the helper's reference: rows that see no key give 0 and pass no gradient (the project's rule)
    golden = gradients(lambda a, b, c: sdpa(a, b, c, attn_mask=mask.double()), dout, q.double(), k.double(), v.double())
    reference = gradients(lambda a, b, c: sdpa(a, b, c, attn_mask=mask), dout, q, k, v)
    if mask_kind == "masked-rows":
        assert (mine[0][:, :, 8:24] == 0).all()
    for name, m, g, r in zip("qkv", mine, golden, reference):
        assert max_error(m, g) <= max(1e-5, 5 * max_error(r, g)), name


def run_backward(q, k, v, mask, dout, workspace):
    """The gradients through the core, with the given workspace (None: without the classes)."""
    _sources.ensure_registered()
    options = core_options(scale=q.shape[-1] ** -0.5, kernel=_C.KERNEL_FORWARD)
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32)
    forward_tensors = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "mask": mask}
    _C.forward(_C.DEVICE_CPU, forward_tensors, options, lambda n: torch.empty((n + 3) // 4))
    grads = {"dq": torch.empty_like(q), "dk": torch.empty_like(k), "dv": torch.empty_like(v)}
    tensors = {**forward_tensors, "dout": dout, "delta": torch.empty(q.shape[:-1]), **grads}
    _C.backward(_C.DEVICE_CPU, tensors, options, workspace)
    return grads, tensors


def test_the_classes_change_no_bit_of_any_result(gen):
    """Forward and backward with the classes (a workspace) and without them (the mask added
    everywhere, as before) agree bit for bit, NaN for NaN, including a NaN in V and a NaN dO row
    under -inf blocks (their dP keeps those blocks added) and a huge K key (its scores may not be
    finite by the bound: added)."""
    lq, lk = 40, 56
    q, k, v = randn(gen, 1, 2, lq, 16), randn(gen, 1, 2, lk, 16), randn(gen, 1, 2, lk, 16)
    dout = randn(gen, 1, 2, lq, 16)
    mask = float_causal(lq, lk)
    mask[:, 48:] = NEG_INF  # a padded tail
    mask = mask[None, None].expand(1, 2, lq, lk)
    cases = {"plain": (q, k, v, dout)}
    v_nan = v.clone()
    v_nan[0, 1, 50, 3] = NAN  # a padded key: only its dP and dV would see it
    cases["nan-v"] = (q, k, v_nan, dout)
    dout_nan = dout.clone()
    dout_nan[0, 0, 5, 0] = NAN
    cases["nan-dout"] = (q, k, v, dout_nan)
    k_huge = k.clone()
    k_huge[0, 0, 52] = 1e30
    cases["huge-k"] = (q, k_huge, v, dout)
    for name, (q_, k_, v_, dout_) in cases.items():
        with_classes, call = run_backward(q_, k_, v_, mask, dout_, lambda n: torch.empty((n + 3) // 4))
        out = call["out"]
        without, _ = run_backward(q_, k_, v_, mask, dout_, None)
        for grad in with_classes:
            assert torch.equal(with_classes[grad].nan_to_num(7.0), without[grad].nan_to_num(7.0)), (name, grad)
        # NaN in V or dO reaches the gradients through dP (0 * NaN) wherever the blocks stay added
        assert any(g.isnan().any() for g in with_classes.values()) == (name in ("nan-v", "nan-dout")), name
        workspace_out = torch.empty_like(out)
        options = core_options(scale=0.25, kernel=_C.KERNEL_FORWARD)
        tensors = {"q": q_, "k": k_, "v": v_, "mask": mask}
        _C.forward(_C.DEVICE_CPU, {**tensors, "out": workspace_out}, options, lambda n: torch.empty((n + 3) // 4))
        plain_out = torch.empty_like(out)
        _C.forward(_C.DEVICE_CPU, {**tensors, "out": plain_out}, options)  # no workspace: no classes
        assert torch.equal(workspace_out.nan_to_num(7.0), plain_out.nan_to_num(7.0)), name


def test_the_backward_pre_pass_writes_the_classes_and_four_maxima(gen):
    lq, lk = 21, 27
    q, k, v = randn(gen, 1, 2, lq, 16), randn(gen, 1, 1, lk, 16), randn(gen, 1, 1, lk, 8)
    dout = randn(gen, 1, 2, lq, 8)
    dout[0, 1, 3, 2] = INF
    mask = crafted_mask(lq, lk, torch.float32)[None, None].expand(1, 2, lq, lk)
    plan = explain_plan(q, k, v, attn_mask=mask, backward=True)["dispatches"]
    assert [d["function"] for d in plan][:2] == ["fa_backward_delta_float", "fa_backward_mask_blocks_float"]
    nbytes = plan[1]["cost"]["min_bytes_written"]
    workspace = torch.full((nbytes // 4,), NAN)
    _, tensors = run_backward(q, k, v, mask, dout, workspace)
    classes, got, q_max, rest = split_workspace(workspace, q, k, mask)
    assert torch.equal(got, classes)
    q_items, k_items = 2 * 3, 4
    k_max, do_max, v_max = rest[:k_items], rest[k_items : k_items + q_items], rest[k_items + q_items :]
    # q's maximum is +inf where a row's D is not finite: the NaN and +inf entries' rows 9 and 11
    # (row block 1 of both heads), and head 1's row 3 through dO's +inf
    delta_finite = torch.nn.functional.pad(tensors["delta"].isfinite(), (0, 3), value=True).view(1, 2, 3, 8).all(-1)
    assert torch.equal(q_max, torch.where(delta_finite.flatten(), block_max(q), INF))
    assert (q_max == INF).tolist() == [False, True, False, True, True, False]
    assert torch.equal(k_max, block_max(k))
    assert torch.equal(do_max, block_max(dout)) and do_max[3] == INF and torch.equal(v_max, block_max(v))
