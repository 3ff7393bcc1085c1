"""The lean host path: cached plans still check every call's storage, new kernel text is
never run through an old pipeline, FLASHATTN_MPS_SKIP_EXECUTION skips only the kernels, and the two
autograd routes (an autograd.Function eagerly, the torch.library ops when traced) agree."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from flashattn_mps import _C, _sources, flash_attention
from flashattn_mps._api import describe
from helpers import FORWARD_NAMES, assert_matches_sdpa, core_options, max_error, randn, sdpa, slots


@pytest.fixture(autouse=True)
def sources():
    _sources.ensure_registered()  # some tests call the core directly


def run_python(source: str, **env) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_a_cached_plan_still_checks_the_storage_of_every_call(gen):
    q, k, v = randn(gen, 1, 2, 4, 8), randn(gen, 1, 2, 5, 8), randn(gen, 1, 2, 5, 8)
    out = torch.empty(1, 2, 4, 8)
    descs = [describe(t) for t in (q, k, v, out)]
    _C.forward(_C.DEVICE_CPU, slots(FORWARD_NAMES, descs), core_options(scale=0.5))  # plans and caches this shape
    assert_matches_sdpa(out, q, k, v, scale=0.5)
    for index, field, value, message in [
        (1, 1, 16, "k: the view"),
        (3, 0, 0, "out: the view"),
        (2, 2, 1 << 40, "v: the view"),
    ]:
        bad = list(descs)
        bad[index] = tuple(value if i == field else f for i, f in enumerate(descs[index]))
        with pytest.raises(ValueError, match=message):  # same shapes: a plan cache hit
            _C.forward(_C.DEVICE_CPU, slots(FORWARD_NAMES, bad), core_options(scale=0.5))


def test_tensors_and_descriptors_reach_the_core_alike(gen):
    q, k, v = randn(gen, 2, 4, 9, 16), randn(gen, 2, 2, 30, 16), randn(gen, 2, 2, 30, 8)[..., ::2]
    by_tensor, by_descriptor = torch.full((2, 4, 9, 4), float("nan")), torch.full((2, 4, 9, 4), float("nan"))
    _C.forward(_C.DEVICE_CPU, slots(FORWARD_NAMES, (q, k, v, by_tensor)), core_options(scale=0.3, causal=True))
    _C.forward(
        _C.DEVICE_CPU,
        slots(FORWARD_NAMES, [describe(t) for t in (q, k, v, by_descriptor)]),
        core_options(scale=0.3, causal=True),
    )
    assert torch.equal(by_tensor, by_descriptor)
    assert_matches_sdpa(by_tensor, q, k, v, causal=True, scale=0.3)


def test_the_workspace_callable_is_asked_only_when_the_plan_needs_it(gen):
    asked = []

    def workspace(nbytes):
        asked.append(nbytes)
        return torch.empty((nbytes + 3) // 4)

    q, k, v = randn(gen, 1, 2, 1, 16), randn(gen, 1, 1, 2000, 16), randn(gen, 1, 1, 2000, 16)
    out = torch.empty(1, 2, 1, 16)
    options = core_options(scale=0.25)
    _C.forward(_C.DEVICE_CPU, slots(FORWARD_NAMES, (q, k, v, out)), options, workspace)  # split-K decode
    assert asked == [_C.forward_workspace_bytes(_C.DEVICE_CPU, slots(FORWARD_NAMES, (q, k, v, out)), options)]
    assert_matches_sdpa(out, q, k, v, scale=0.25)
    _C.forward(_C.DEVICE_CPU, slots(FORWARD_NAMES, (q, k[:, :, :100], v[:, :, :100], out)), options, workspace)
    assert len(asked) == 1  # no split, no workspace
    with pytest.raises(TypeError, match="workspace: must be float32"):
        _C.forward(
            _C.DEVICE_CPU, slots(FORWARD_NAMES, (q, k, v, out)), options, lambda n: torch.empty(n, dtype=torch.float16)
        )


SKIP_EXECUTION = """
    import torch
    from flashattn_mps import _C, _sources
    _sources.ensure_registered()
    fields = dict(scale=0.25, causal=False, bottom_right=False, window_left=-1, window_right=-1, softcap=0.0,
                  dropout_p=0.0, kernel=_C.KERNEL_AUTO, num_splits=0, write_probs=False, max_q_len=0,
                  max_kv_len=0, unbatched=False, diagonal_offset=0, k_bits=0, k_group_size=0, v_bits=0, v_group_size=0, gpu_family=0)
    options = tuple(fields[name] for name in _C.OPTION_FIELDS)
    q, k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 50, 16), torch.randn(1, 2, 50, 16)
    out = torch.full((1, 2, 40, 16), float("nan"))
    _C.forward(_C.DEVICE_CPU, dict(q=q, k=k, v=v, out=out), options)
    try:  # the host work still runs: a bad call is refused
        _C.forward(_C.DEVICE_CPU, dict(q=q, k=k, v=v, out=torch.empty(1, 2, 40, 15)), options)
    except ValueError as e:
        print("refused", "must be (B, Hq, L, Ev)" in str(e))
    print("ran", bool(out.isfinite().all()))
"""


@pytest.mark.parametrize("skip", ["1", "0"])
@pytest.mark.slow
def test_skip_execution_skips_only_the_kernels(skip):
    printed = run_python(SKIP_EXECUTION, FLASHATTN_MPS_SKIP_EXECUTION=skip).split()
    assert printed == ["refused", "True", "ran", "False" if skip == "1" else "True"]


RE_REGISTER = """
    import torch
    from flashattn_mps import _C, _sources, flash_attention
    q, k, v = torch.randn(1, 1, 3, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    original = _sources.kernel_sources()["fa_simple.metal"]
    first = flash_attention(q, k, v, kernel="simple")
    line = "acc[c] = 0.0f;"
    assert original.count(line) == 1
    _C.register_source("fa_simple.metal", original.replace(line, "acc[c] = 0.0f; q_reg[c] = 0.0f;"))
    zeroed = flash_attention(q, k, v, kernel="simple")  # every score 0: the mean of v
    _C.register_source("fa_simple.metal", original)
    again = flash_attention(q, k, v, kernel="simple")
    mean = v.mean(dim=2, keepdim=True).expand(1, 1, 3, 8)
    print(torch.allclose(zeroed, mean, atol=1e-6), torch.equal(first, again), torch.allclose(first, mean))
"""


@pytest.mark.slow
def test_new_source_text_is_never_run_through_an_old_pipeline():
    assert run_python(RE_REGISTER).split() == ["True", "True", "False"]


def test_eager_autograd_takes_the_autograd_function_and_tracing_the_custom_op(gen):
    q, k, v = (randn(gen, 1, 2, 6, 8).requires_grad_() for _ in range(3))
    out = flash_attention(q, k, v, causal=True)
    assert type(out.grad_fn).__name__ == "_AttentionBackward"
    out.square().sum().backward()
    golden = [t.detach().double().requires_grad_() for t in (q, k, v)]
    sdpa(*golden, causal=True).square().sum().backward()
    for ours, want in zip((q, k, v), golden):
        assert max_error(ours.grad, want.grad) < 1e-5

    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(lambda a, b, c: flash_attention(a, b, c, causal=True))(q.detach(), k.detach(), v.detach())
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert "flashattn_mps.attention_forward.default" in targets, targets
    traced = graph(q.detach(), k.detach(), v.detach())
    assert torch.equal(traced, flash_attention(q.detach(), k.detach(), v.detach(), causal=True))


def test_threads_share_the_caches_safely(gen):
    """Calls of several shapes from several threads at once (plan-cache hits, misses and
    overwrites, the backends' caches) give each call its own result."""
    from concurrent.futures import ThreadPoolExecutor

    cases = [
        (randn(gen, 1, 2, lq, 16), randn(gen, 1, 1, lk, 16), randn(gen, 1, 1, lk, 8))
        for lq, lk in [(1, 40), (3, 9), (9, 17), (1, 600)]
    ]
    expected = [flash_attention(*case) for case in cases]

    def run(index):
        return all(torch.equal(flash_attention(*cases[(index + i) % 4]), expected[(index + i) % 4]) for i in range(12))

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(run, range(8)))
