"""The SDPA drop-in with tensor subclasses that dispatch for themselves (__torch_dispatch__): a
wrapper keeps its elements elsewhere, so the call goes to torch's own SDPA (which dispatches to the
subclass) and explain says why; the tracing machinery's fake tensors still reach the custom ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from flashattn_mps import explain, patch, scaled_dot_product_attention
from helpers import max_error, randn


class Wrapped(torch.Tensor):
    """A minimal wrapper subclass: no storage of its own, every op unwraps, runs and rewraps."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), dtype=inner.dtype, device=inner.device
        )

    def __init__(self, inner: torch.Tensor):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(x):
            return x.inner if isinstance(x, Wrapped) else x

        def wrap(x):
            return Wrapped(x) if isinstance(x, torch.Tensor) else x

        return tree_map(wrap, func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {})))


def test_a_wrapper_subclass_goes_to_torch(gen, core_calls):
    q, k, v = randn(gen, 1, 2, 5, 8), randn(gen, 1, 2, 6, 8), randn(gen, 1, 2, 6, 8)
    mask = torch.rand(5, 6, generator=gen) > 0.3
    golden = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    for args in ((Wrapped(q), k, v, mask), (q, k, Wrapped(v), mask), (q, k, v, Wrapped(mask))):
        text = explain(*args)
        assert text.startswith("torch's") and "Wrapped" in text and "__torch_dispatch__" in text, text
        with patch(cpu=True):
            out = F.scaled_dot_product_attention(*args)
        assert isinstance(out, Wrapped)
        assert max_error(out.inner, golden) < 1e-5
    assert core_calls["forward"] == 0


def test_functional_tensors_go_to_torch(gen, core_calls):
    q, k, v = randn(gen, 1, 2, 5, 8), randn(gen, 1, 2, 6, 8), randn(gen, 1, 2, 6, 8)
    functional = [torch._to_functional_tensor(t) for t in (q, k, v)]
    text = explain(*functional)
    assert text.startswith("torch's") and "functional tensors" in text, text
    with patch(cpu=True):
        out = F.scaled_dot_product_attention(*functional)
    golden = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert max_error(torch._from_functional_tensor(out), golden) < 1e-5
    assert core_calls["forward"] == 0


def test_a_dtensor_goes_to_torch(gen, core_calls, tmp_path, monkeypatch):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    except ImportError:  # torch 2.4: DTensor's module before it became public in torch 2.5
        from torch.distributed._tensor import DTensor, Shard, distribute_tensor

    from flashattn_mps import _sdpa

    # torch's own SDPA on CPU DTensors costs tens of seconds here (DTensor propagates shardings
    # through its decomposition), so torch's function is replaced by a recorder: what is checked is
    # that the call reaches it, with the DTensors untouched, and never the kernels.
    reached = []
    monkeypatch.setattr(_sdpa, "_original_sdpa", lambda *args, **kwargs: reached.append((args, kwargs)) or "torch")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        q, k, v = randn(gen, 1, 2, 7, 8), randn(gen, 1, 2, 9, 8), randn(gen, 1, 2, 9, 8)
        dq, dk, dv = (distribute_tensor(t, mesh, [Shard(1)]) for t in (q, k, v))  # heads sharded (TP)
        text = explain(dq, dk, dv, is_causal=True)
        assert text.startswith("torch's") and "DTensor" in text, text
        with patch(cpu=True):
            assert F.scaled_dot_product_attention(dq, dk, dv, is_causal=True) == "torch"
        ((args, kwargs),) = reached
        assert all(isinstance(t, DTensor) for t in args) and args[0] is dq and kwargs["is_causal"] is True
        assert core_calls["forward"] == 0
    finally:
        dist.destroy_process_group()


def test_fake_tensors_go_to_torch_outside_tracing_and_to_the_ops_inside(gen):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = FakeTensorMode()
    q = mode.from_tensor(randn(gen, 1, 2, 5, 8))
    text = explain(q, q, q)
    assert text.startswith("torch's") and "FakeTensor" in text, text
    graph = make_fx(lambda a: scaled_dot_product_attention(a, a, a, is_causal=True), tracing_mode="fake")(
        randn(gen, 1, 2, 5, 8)
    )
    assert "flashattn_mps.attention_forward" in str(graph.code)
