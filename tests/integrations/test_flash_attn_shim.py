"""The flash_attn shim: opt-in, guarded (a real flash_attn always wins, also one that appears on
sys.path later), undone by uninstall, switched on for unmodified scripts by the environment
variable through the .pth line; FlashAttention-3's and -4's conventions; arguments it cannot run
refused by name."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import flashattn_mps
from flashattn_mps._shim import finder
from helpers import flash_inputs, packed_inputs, prefix_sums, randn, reference

ROOT = Path(flashattn_mps.__file__).resolve().parent.parent


@pytest.fixture
def shim():
    flashattn_mps.install_flash_attn_shim()
    yield
    flashattn_mps.uninstall_flash_attn_shim()


def test_install_serves_every_module_and_uninstall_removes_it(shim):
    import flash_attn
    from flash_attn import (  # noqa: F401
        flash_attn_func,
        flash_attn_kvpacked_func,
        flash_attn_qkvpacked_func,
        flash_attn_varlen_func,
        flash_attn_varlen_qkvpacked_func,
        flash_attn_with_kvcache,
    )
    from flash_attn.bert_padding import index_first_axis, pad_input, unpad_input  # noqa: F401
    from flash_attn.cute import flash_attn_func as fa4_func  # noqa: F401
    from flash_attn.layers.rotary import apply_rotary_emb  # noqa: F401
    from flash_attn_interface import flash_attn_func as fa3_func  # noqa: F401

    assert flash_attn.__version__.startswith("2.8.4+flashattn.mps.")
    flashattn_mps.uninstall_flash_attn_shim()
    assert "flash_attn" not in sys.modules and "flash_attn_interface" not in sys.modules
    with pytest.raises(ImportError):
        import flash_attn  # noqa: F401, F811


def test_a_real_flash_attn_wins_even_when_it_appears_later(shim, tmp_path, monkeypatch):
    real = tmp_path / "flash_attn"
    real.mkdir()
    (real / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # after the shim was installed
    monkeypatch.setattr(finder, "_stepped_aside", set())
    with pytest.warns(UserWarning, match="a real flash_attn is installed") as said:
        import flash_attn
    assert flash_attn.REAL and len([w for w in said if "steps aside" in str(w.message)]) == 1
    del sys.modules["flash_attn"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once only
        import flash_attn  # noqa: F401, F811
    del sys.modules["flash_attn"]


def _run(code: str, env_switch: str, site_dir: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != finder.ENVIRONMENT_SWITCH}
    env["PYTHONPATH"] = str(ROOT)
    if env_switch is not None:
        env[finder.ENVIRONMENT_SWITCH] = env_switch
    # site.addsitedir processes the .pth files as the interpreter does for site-packages.
    script = f"import site; site.addsitedir({str(site_dir)!r})\n" + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)


def test_environment_switch_through_the_pth_line(tmp_path):
    pth = ROOT / "flashattn_mps" / "_shim" / "flashattn_mps_flash_attn_shim.pth"
    (tmp_path / pth.name).write_text(pth.read_text())
    code = """
        import sys
        assert "torch" not in sys.modules, "the hook must not import torch at start"
        import flash_attn, flash_attn_interface
        print(flash_attn.__file__)
    """
    on = _run(code, "1", tmp_path)
    assert on.returncode == 0, on.stderr
    assert on.stdout.strip().endswith(os.path.join("_shim", "flash_attn", "__init__.py"))
    off = _run(code, None, tmp_path)
    assert off.returncode != 0 and "No module named 'flash_attn'" in off.stderr


def test_fa3_conventions(shim, gen):
    from flash_attn_interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

    q, k, v = flash_inputs(gen, 2, 9, 13, 4, 2, 16, 16, torch.float32)
    out = flash_attn_func(q, k, v, 0.3, True)  # softmax_scale 4th positional, then causal
    expected = flashattn_mps.flash_attn_func(q, k, v, softmax_scale=0.3, causal=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out2, lse = flash_attn_func(q, k, v, 0.3, True, return_attn_probs=True)
    assert torch.equal(out2, out) and lse.shape == (2, 4, 9)
    for name, kwargs in (
        ("qv", dict(qv=q)),
        ("q_descale", dict(q_descale=torch.ones(1))),
        ("attention_chunk", dict(attention_chunk=4)),
        ("sm_margin", dict(sm_margin=2)),
    ):
        with pytest.raises(NotImplementedError, match=f"flash_attn_func: {name} is not supported"):
            flash_attn_func(q, k, v, **kwargs)

    # seqused_k: each sequence uses only its first keys.
    lens_q, lens_k, used = [3, 5], [8, 6], [5, 6]
    qp, kp, vp = packed_inputs(gen, lens_q, lens_k, 4, 2, 16, 16, torch.float32)
    cu_q, cu_k = prefix_sums(lens_q), prefix_sums(lens_k)
    out = flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, 5, 8, seqused_k=torch.tensor(used, dtype=torch.int32))
    for b in range(2):
        keys = slice(int(cu_k[b]), int(cu_k[b]) + used[b])
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        ref = reference(*(t.double().transpose(0, 1)[None] for t in (qp[rows], kp[keys], vp[keys])))
        torch.testing.assert_close(out[rows].double(), ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    with pytest.raises(flashattn_mps.FlashAttnInputError, match=r"seqused_k\[0\] = 9"):
        flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, 5, 8, seqused_k=torch.tensor([9, 1], dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="seqused_q"):
        flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, 5, 8, seqused_q=torch.tensor(lens_q, dtype=torch.int32))

    # page_table is flash-attn 2's block_table.
    q1 = randn(gen, 2, 1, 4, 16)
    pool = randn(gen, 6, 4, 2, 16), randn(gen, 6, 4, 2, 16)
    table = torch.tensor([[5, 1], [0, 3]], dtype=torch.int32)
    lengths = torch.tensor([7, 3], dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(q1, *pool, cache_seqlens=lengths, page_table=table, return_softmax_lse=True)
    expected = flashattn_mps.flash_attn_with_kvcache(q1, *pool, cache_seqlens=lengths, block_table=table)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="rotary_seqlens"):
        flash_attn_with_kvcache(q1, *pool, cache_seqlens=lengths, page_table=table, rotary_seqlens=lengths)


def test_fa4_conventions(shim, gen):
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    q, k, v = flash_inputs(gen, 2, 9, 13, 4, 2, 16, 16, torch.float32)
    out, lse = flash_attn_func(q, k, v, causal=True)
    assert lse is None  # a tuple always; no lse unless asked or training
    torch.testing.assert_close(out, flashattn_mps.flash_attn_func(q, k, v, causal=True), rtol=0, atol=0)
    # (None, 4): unbounded left, 4 right; a pair summing below 0 is no window at all.
    out, _ = flash_attn_func(q, k, v, window_size=(None, 4))
    torch.testing.assert_close(out, flashattn_mps.flash_attn_func(q, k, v, window_size=(-1, 4)), rtol=0, atol=0)
    out, _ = flash_attn_func(q, k, v, window_size=(-1, 0))
    torch.testing.assert_close(out, flashattn_mps.flash_attn_func(q, k, v), rtol=0, atol=0)
    # learnable_sink with its gradient; the lse -inf for a row that sees no key (9 queries, 0 keys).
    sink = torch.randn(4, generator=gen).requires_grad_()
    out, lse = flash_attn_func(q, k, v, learnable_sink=sink, return_lse=True)
    out.sum().backward()
    sink_ref = sink.detach().clone().requires_grad_()
    flashattn_mps.flash_attn_func(q, k, v, sinks=sink_ref).sum().backward()
    torch.testing.assert_close(sink.grad, sink_ref.grad)
    qg = q.clone().requires_grad_()
    out, lse = flash_attn_func(qg, k, v)  # training: FA4 returns the lse unasked
    assert lse is not None and lse.shape == (2, 4, 9)
    out.sum().backward()  # out's gradient flows; one through lse is refused, not dropped
    with pytest.raises(NotImplementedError, match="gradient through lse"):
        flash_attn_func(qg, k, v)[1].sum().backward()
    _, lse = flash_attn_func(q, k[:, :0], v[:, :0], return_lse=True)
    assert bool((lse == -float("inf")).all())
    for name, kwargs in (
        ("score_mod", dict(score_mod=lambda *a: a[0])),
        ("gather_kv_indices", dict(gather_kv_indices=q)),
    ):
        with pytest.raises(NotImplementedError, match=name):
            flash_attn_func(q, k, v, **kwargs)

    lens = [3, 5]
    qp, kp, vp = packed_inputs(gen, lens, lens, 4, 2, 16, 16, torch.float32)
    cu = prefix_sums(lens)
    out, lse = flash_attn_varlen_func(qp, kp, vp, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, return_lse=True)
    expected = flashattn_mps.flash_attn_varlen_func(qp, kp, vp, cu, cu, 5, 5, causal=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert lse.shape == (4, 8)
    with pytest.raises(NotImplementedError, match="cu_seqlens_q=None"):
        flash_attn_varlen_func(q, k, v)


def test_bert_padding_and_rotary(shim, gen):
    from flash_attn.bert_padding import pad_input, unpad_input
    from flash_attn.layers.rotary import apply_rotary_emb

    x = randn(gen, 3, 7, 2, 4)
    mask = torch.arange(7).view(1, -1) < torch.tensor([[7], [2], [5]])
    rows, indices, cu, longest, used = unpad_input(x, mask)
    assert rows.shape == (14, 2, 4) and cu.tolist() == [0, 7, 9, 14] and longest == 7 and used.tolist() == [7, 2, 5]
    assert torch.equal(pad_input(rows, indices, 3, 7), x * mask[..., None, None])

    # Rotary (GPT-NeoX halves) by hand at positions offset + t; the packed form agrees.
    cos_angle = torch.rand(20, 4, generator=gen)
    cos, sin = cos_angle.cos(), cos_angle.sin()
    y = randn(gen, 2, 5, 3, 10)
    out = apply_rotary_emb(y, cos, sin, seqlen_offsets=torch.tensor([0, 4]))
    for b, offset in enumerate([0, 4]):
        c, s = cos[offset : offset + 5, None, :], sin[offset : offset + 5, None, :]
        x1, x2 = y[b, ..., :4], y[b, ..., 4:8]
        torch.testing.assert_close(out[b, ..., :8], torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1))
        torch.testing.assert_close(out[b, ..., 8:], y[b, ..., 8:])
    packed = apply_rotary_emb(
        y.reshape(10, 3, 10), cos, sin, seqlen_offsets=torch.tensor([0, 4]), cu_seqlens=torch.tensor([0, 5, 10])
    )
    torch.testing.assert_close(packed, out.reshape(10, 3, 10))


def test_the_build_puts_the_pth_line_at_the_top(tmp_path):
    """What a wheel installs into site-packages: the .pth beside the package."""
    build = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "-d", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    assert (tmp_path / "flashattn_mps_flash_attn_shim.pth").read_text().startswith("import os;")
    assert (tmp_path / "flashattn_mps" / "_shim" / "flash_attn" / "cute" / "interface.py").is_file()
