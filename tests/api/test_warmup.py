"""flashattn_mps.warmup: after it, the first real call of the warmed shapes compiles and builds
nothing (the backends' caches hold every library and pipeline it needs) and finds its plans cached,
forward and backward, on the CPU Metal device; the random state is left alone."""

from __future__ import annotations

import torch

import flashattn_mps
from flashattn_mps import _C


def snapshot():
    return _C.backend_builds(), _C.plan_cache_counts()


def test_after_warmup_the_first_call_compiles_nothing(gen):
    # a shape and option set no other test uses, so the warmup itself must plan
    q = torch.randn(1, 3, 13, 24, generator=gen)
    k, v = torch.randn(1, 1, 29, 24, generator=gen), torch.randn(1, 1, 29, 24, generator=gen)
    made = flashattn_mps.warmup(q, k, v, causal=True, backward=True, dropout_p=0.25)
    assert made["plans"] >= 2 and made["builds"] >= 0  # kernels other tests built may be cached already
    rng = torch.get_rng_state()
    again = flashattn_mps.warmup(q, k, v, causal=True, backward=True, dropout_p=0.25)
    assert again["plans"] == 0 and again["builds"] == 0
    assert torch.equal(torch.get_rng_state(), rng)  # the dropout seed draw was undone

    builds, plans = snapshot()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flashattn_mps.flash_attention(*leaves, causal=True, dropout_p=0.25)
    out.backward(torch.randn(out.shape, generator=gen))
    after_builds, after = snapshot()
    assert after_builds == builds
    for key in ("forward_misses", "backward_misses"):
        assert after[key] == plans[key], key


def test_warmup_takes_another_function_and_its_layout(gen):
    q = torch.randn(2, 7, 2, 16, generator=gen)  # flash-attn's (B, L, H, D)
    assert flashattn_mps.warmup(q, q, q, function=flashattn_mps.flash_attn_func, causal=True)["plans"] >= 1
    builds, plans = snapshot()
    flashattn_mps.flash_attn_func(q, q, q, causal=True)
    assert snapshot() == (builds, {**plans, "forward_hits": plans["forward_hits"] + 1})
