"""The CPU Metal device, with purpose-built kernels checked against NumPy/torch."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest
import torch

from flashattn_mps import metal_cpu
from flashattn_mps.metal_cpu import MetalCompileError, MetalDispatchError, compile_library

HEADER = "#include <metal_stdlib>\nusing namespace metal;\n"


def build(body: str, macros=None, name="test.metal"):
    return compile_library(HEADER + textwrap.dedent(body), macros=macros, name=name)


def test_builtins_in_a_3d_dispatch():
    lib = build("""
        kernel void ids(device uint *out [[buffer(0)]],
                        uint3 tpig [[thread_position_in_grid]],
                        uint3 tgpig [[threadgroup_position_in_grid]],
                        uint3 tpitg [[thread_position_in_threadgroup]],
                        uint tiitg [[thread_index_in_threadgroup]],
                        uint3 tptg [[threads_per_threadgroup]],
                        uint3 tgpg [[threadgroups_per_grid]],
                        ushort lane [[thread_index_in_simdgroup]],
                        uint sg [[simdgroup_index_in_threadgroup]],
                        uint width [[threads_per_simdgroup]],
                        uint sgs [[simdgroups_per_threadgroup]],
                        uint2 tpig2 [[thread_position_in_grid]]) {
          uint flat = (tpig.z * (tgpg.y * tptg.y) + tpig.y) * (tgpg.x * tptg.x) + tpig.x;
          device uint *o = out + flat * 16;
          o[0] = tpig.x; o[1] = tpig.y; o[2] = tpig.z;
          o[3] = tgpig.x; o[4] = tgpig.y; o[5] = tgpig.z;
          o[6] = tpitg.x; o[7] = tpitg.y; o[8] = tpitg.z;
          o[9] = tiitg; o[10] = lane; o[11] = sg; o[12] = width; o[13] = sgs;
          o[14] = tpig2.x + tpig2.y; o[15] = tptg.x * tptg.y * tptg.z;
        }""")
    grid, group = (3, 2, 2), (8, 5, 2)
    n = np.prod(grid) * np.prod(group)
    out = torch.zeros(n * 16, dtype=torch.int32)
    lib.dispatch("ids", grid, group, [out])
    rows = out.view(-1, 16).numpy()
    seen = set()
    for r in rows:
        tpig, tgpig, tpitg = r[0:3], r[3:6], r[6:9]
        assert (tpig == tgpig * np.array(group) + tpitg).all()
        tiitg = tpitg[0] + tpitg[1] * group[0] + tpitg[2] * group[0] * group[1]
        assert r[9] == tiitg and r[10] == tiitg % 32 and r[11] == tiitg // 32
        assert r[12] == 32 and r[13] == 3 and r[15] == 80 and r[14] == tpig[0] + tpig[1]
        seen.add(tuple(tpig))
    assert len(seen) == n


@pytest.mark.parametrize("kind", ["argument", "kernel_scope"])
def test_threadgroup_reduction_with_barriers(kind):
    decl = (
        ("threadgroup float *shared [[threadgroup(0)]],", "")
        if kind == "argument"
        else ("", "threadgroup float shared[256];")
    )
    lib = build(f"""
        kernel void reduce(const device float *x [[buffer(0)]], device float *out [[buffer(1)]],
                           {decl[0]}
                           uint tid [[thread_index_in_threadgroup]], uint group [[threadgroup_position_in_grid]]) {{
          {decl[1]}
          shared[tid] = x[group * 256 + tid];
          threadgroup_barrier(mem_flags::mem_threadgroup);
          for (uint stride = 128; stride > 0; stride /= 2) {{
            if (tid < stride) {{ shared[tid] += shared[tid + stride]; }}
            threadgroup_barrier(mem_flags::mem_threadgroup);
          }}
          if (tid == 0) {{ out[group] = shared[0]; }}
        }}""")
    x = torch.randn(7 * 256)
    out = torch.zeros(7)
    lib.dispatch("reduce", (7,), (256,), [x, out], threadgroup_memory=[1024] if kind == "argument" else [])
    torch.testing.assert_close(out, x.view(7, 256).sum(1), rtol=1e-5, atol=1e-5)


def test_kernel_scope_arrays_are_shared_per_threadgroup_not_per_thread():
    lib = build("""
        kernel void share(device int *out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]],
                          uint group [[threadgroup_position_in_grid]]) {
          threadgroup int a[64];
          threadgroup int b[64];
          a[tid] = int(tid) + 1000 * int(group);
          b[tid] = -int(tid);
          threadgroup_barrier(mem_flags::mem_threadgroup);
          out[group * 64 + tid] = a[63 - tid] + b[(tid + 1) % 64] * 0;
        }""")
    out = torch.zeros(4 * 64, dtype=torch.int32)
    lib.dispatch("share", (4,), (64,), [out])
    expected = torch.tensor([63 - t + 1000 * g for g in range(4) for t in range(64)], dtype=torch.int32)
    assert torch.equal(out, expected)


SIMD_FUNCTIONS = """
    kernel void simd_ops(const device float *x [[buffer(0)]], device float *out [[buffer(1)]],
                         const device int *ix [[buffer(2)]], device int *iout [[buffer(3)]],
                         uint lane [[thread_index_in_simdgroup]], uint sg [[simdgroup_index_in_threadgroup]]) {
      uint i = sg * 32 + lane;
      float v = x[i];
      device float *o = out + i * 12;
      o[0] = simd_sum(v);
      o[1] = simd_max(v);
      o[2] = simd_min(v);
      o[3] = simd_product(v);
      o[4] = simd_shuffle(v, (lane * 7 + 3) % 32);
      o[5] = simd_shuffle_xor(v, 5);
      o[6] = simd_shuffle_up(v, 3);
      o[7] = simd_shuffle_down(v, 4);
      o[8] = simd_broadcast(v, 17);
      o[9] = simd_prefix_exclusive_sum(v);
      o[10] = simd_all(v > -10.0f) ? 1.0f : 0.0f;
      o[11] = simd_any(v > 1.5f) ? 1.0f : 0.0f;
      int iv = ix[i];
      iout[i * 3 + 0] = simd_sum(iv);
      iout[i * 3 + 1] = simd_max(iv);
      iout[i * 3 + 2] = simd_prefix_exclusive_sum(iv);
    }"""


def test_every_simd_function():
    lib = build(SIMD_FUNCTIONS)
    gen = torch.Generator().manual_seed(3)
    x = (torch.rand(64, generator=gen) * 2 - 1).float()
    x[40] = 2.0  # only the second SIMD-group has a value above 1.5
    ix = torch.randint(-50, 50, (64,), generator=gen, dtype=torch.int32)
    out = torch.zeros(64 * 12)
    iout = torch.zeros(64 * 3, dtype=torch.int32)
    lib.dispatch("simd_ops", (1,), (64,), [x, out, ix, iout])
    o = out.view(64, 12).numpy()
    io = iout.view(64, 3).numpy()
    for sg in range(2):
        v = x[sg * 32 : (sg + 1) * 32].numpy().astype(np.float64)
        iv = ix[sg * 32 : (sg + 1) * 32].numpy()
        for lane in range(32):
            r = o[sg * 32 + lane]
            np.testing.assert_allclose(r[0], v.sum(), rtol=1e-5, atol=1e-6)
            assert r[1] == np.float32(v.max()) and r[2] == np.float32(v.min())
            np.testing.assert_allclose(r[3], np.prod(v), rtol=1e-4, atol=1e-30)
            assert r[4] == np.float32(v[(lane * 7 + 3) % 32])
            assert r[5] == np.float32(v[lane ^ 5])
            assert r[6] == np.float32(v[lane - 3] if lane >= 3 else v[lane])  # out of range: own value
            assert r[7] == np.float32(v[lane + 4] if lane + 4 < 32 else v[lane])
            assert r[8] == np.float32(v[17])
            np.testing.assert_allclose(r[9], v[:lane].sum(), rtol=1e-5, atol=1e-6)
            assert r[10] == 1.0 and r[11] == (1.0 if sg == 1 else 0.0)
            assert io[sg * 32 + lane].tolist() == [iv.sum(), iv.max(), iv[:lane].sum()]


def test_simdgroup_matrix_lane_layout():
    lib = build("""
        kernel void layout(const device float *src [[buffer(0)]], device float *out [[buffer(1)]],
                           uint lane [[thread_index_in_simdgroup]]) {
          simdgroup_matrix<float, 8, 8> m;
          simdgroup_load(m, src, 8);
          out[lane * 2 + 0] = m.thread_elements()[0];
          out[lane * 2 + 1] = m.thread_elements()[1];
        }""")
    src = torch.arange(64, dtype=torch.float32)  # element (row r, col c) = 8r + c
    out = torch.zeros(64)
    lib.dispatch("layout", (1,), (32,), [src, out])
    for lane in range(32):
        row = (lane // 16) * 4 + (lane // 2) % 4
        col = ((lane // 8) % 2) * 4 + (lane % 2) * 2
        assert out[lane * 2].item() == 8 * row + col and out[lane * 2 + 1].item() == 8 * row + col + 1


@pytest.mark.parametrize("dtype,tname", [(torch.float32, "float"), (torch.float16, "half"), (torch.bfloat16, "bfloat")])
def test_simdgroup_matrix_gemm(dtype, tname):
    # C (16x16) = A (16x24) * B (24x16) + C0 with 8x8 tiles, a strided store, origin offsets and a
    # transposed load of B from its (16x24) transpose. matrix_origin is (column, row) of the loaded
    # matrix (metal-flash-attention's reading; the MSL specification does not spell it out).
    lib = build(f"""
        kernel void gemm(const device {tname} *a [[buffer(0)]], const device {tname} *bt [[buffer(1)]],
                         device float *c [[buffer(2)]], uint lane [[thread_index_in_simdgroup]],
                         uint sg [[simdgroup_index_in_threadgroup]]) {{
          uint tile_row = sg / 2, tile_col = sg % 2;
          simdgroup_matrix<float, 8, 8> acc;
          simdgroup_load(acc, c, 16, ulong2(tile_col * 8, tile_row * 8));
          for (uint kk = 0; kk < 24; kk += 8) {{
            simdgroup_matrix<{tname}, 8, 8> ma, mb;
            simdgroup_load(ma, a, 24, ulong2(kk, tile_row * 8));
            simdgroup_load(mb, bt, 24, ulong2(tile_col * 8, kk), true);
            simdgroup_multiply_accumulate(acc, ma, mb, acc);
          }}
          simdgroup_store(acc, c, 16, ulong2(tile_col * 8, tile_row * 8));
        }}""")
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(16, 24, generator=gen).to(dtype)
    b = torch.randn(24, 16, generator=gen).to(dtype)
    c0 = torch.randn(16, 16, generator=gen)
    c = c0.clone()
    lib.dispatch("gemm", (1,), (128,), [a, b.t().contiguous(), c])
    expected = a.double() @ b.double() + c0.double()
    torch.testing.assert_close(c.double(), expected, rtol=1e-5, atol=1e-4)


def test_half_and_bfloat_round_every_operation():
    lib = build("""
        kernel void ops(const device half *a [[buffer(0)]], const device half *b [[buffer(1)]],
                        device half *out [[buffer(2)]],
                        const device bfloat *ba [[buffer(3)]], const device bfloat *bb [[buffer(4)]],
                        device bfloat *bout [[buffer(5)]], uint i [[thread_position_in_grid]]) {
          half s = a[i] + b[i];
          half p = s * a[i];
          half d = p - b[i] / a[i];
          out[i * 3 + 0] = s; out[i * 3 + 1] = p; out[i * 3 + 2] = d;
          bfloat bs = ba[i] + bb[i];
          bfloat bp = bs * ba[i];
          bfloat bd = bp - bb[i] / ba[i];
          bout[i * 3 + 0] = bs; bout[i * 3 + 1] = bp; bout[i * 3 + 2] = bd;
        }""")
    gen = torch.Generator().manual_seed(11)
    n = 4096
    a = (torch.randn(n, generator=gen) * 3).half()
    b = (torch.randn(n, generator=gen) * 300).half()
    ba, bb = a.bfloat16(), (torch.randn(n, generator=gen) * 1000).bfloat16()
    out = torch.zeros(n * 3, dtype=torch.float16)
    bout = torch.zeros(n * 3, dtype=torch.bfloat16)
    lib.dispatch("ops", (n // 64,), (64,), [a, b, out, ba, bb, bout])
    an, bn = a.numpy(), b.numpy()
    with np.errstate(over="ignore"):  # float16 overflow to inf is part of what is compared
        s = an + bn  # numpy float16 arithmetic rounds every operation
        p = s * an
        d = p - bn / an
    expected = np.stack([s, p, d], 1).reshape(-1)
    assert np.array_equal(out.numpy().view(np.uint16), expected.view(np.uint16))
    bs = ba + bb  # torch's CPU bfloat16 ops compute in float and round each result
    bp = bs * ba
    bd = bp - bb / ba
    assert torch.equal(bout.view(torch.int16), torch.stack([bs, bp, bd], 1).reshape(-1).view(torch.int16))


def test_vectors_swizzles_and_math():
    lib = build("""
        kernel void vec(const device float4 *x [[buffer(0)]], device float *out [[buffer(1)]],
                        uint i [[thread_position_in_grid]]) {
          float4 v = x[i];
          float2 lo = v.xy;
          v.zw = lo.yx * 2.0f;
          half4 h = half4(v);
          float3 c = float3(lo, 1.0f) + float3(h.xyz);
          device float *o = out + i * 12;
          o[0] = v.z; o[1] = v.w; o[2] = c.x; o[3] = c.z;
          o[4] = exp2(v.x); o[5] = exp(v.y); o[6] = log2(fabs(v.x) + 1.0f); o[7] = rsqrt(fabs(v.y) + 1.0f);
          o[8] = fma(v.x, v.y, 1.0f); o[9] = max(NAN, v.x); o[10] = clamp(v.x, -0.5f, 0.5f);
          o[11] = select(1.0f, 2.0f, v.x > 0.0f) + float(isnan(NAN)) * 10.0f + float(isinf(INFINITY)) * 100.0f;
        }""")
    x = torch.randn(64, 4)
    out = torch.zeros(64 * 12)
    lib.dispatch("vec", (2,), (32,), [x, out])
    o = out.view(64, 12)
    xs, ys = x[:, 0], x[:, 1]
    torch.testing.assert_close(o[:, 0], ys * 2)
    torch.testing.assert_close(o[:, 1], xs * 2)
    torch.testing.assert_close(o[:, 2], xs + xs.half().float())
    torch.testing.assert_close(o[:, 3], 1.0 + (ys * 2).half().float())
    torch.testing.assert_close(o[:, 4], torch.exp2(xs))
    torch.testing.assert_close(o[:, 5], torch.exp(ys))
    torch.testing.assert_close(o[:, 6], torch.log2(xs.abs() + 1))
    torch.testing.assert_close(o[:, 7], torch.rsqrt(ys.abs() + 1))
    torch.testing.assert_close(o[:, 8], xs * ys + 1)
    torch.testing.assert_close(o[:, 9], xs)  # max returns the non-NaN operand (MSL fmax rule)
    torch.testing.assert_close(o[:, 10], xs.clamp(-0.5, 0.5))
    torch.testing.assert_close(o[:, 11], torch.where(xs > 0, 2.0, 1.0) + 110.0)


def test_function_constants_and_macros():
    lib = build(
        """
        constant int scale_by [[function_constant(0)]];
        constant bool add_one [[function_constant(1)]];
        constant float unused_value [[function_constant(2)]];
        constant bool add_two = add_one && scale_by > 2;
        kernel void fc(device int *out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
          int v = int(i) * scale_by * MACRO_FACTOR;
          if (add_one) { v += 1; }
          if (add_two) { v += 2; }
          out[i * 2] = v;
          out[i * 2 + 1] = is_function_constant_defined(unused_value) ? 1 : 0;
        }""",
        macros={"MACRO_FACTOR": 10},
    )
    out = torch.zeros(64, dtype=torch.int32)
    lib.dispatch("fc", (1,), (32,), [out], constants={0: 3, 1: True})
    assert out[0::2].tolist() == [i * 30 + 3 for i in range(32)] and out[1::2].sum() == 0
    lib.dispatch("fc", (1,), (32,), [out], constants={0: 2, 1: False, 2: 1.5})
    assert out[0::2].tolist() == [i * 20 for i in range(32)] and (out[1::2] == 1).all()


def test_atomics_across_threadgroups():
    lib = build("""
        kernel void count(device atomic_uint *u [[buffer(0)]], device atomic_int *s [[buffer(1)]],
                          device atomic_float *f [[buffer(2)]], uint i [[thread_position_in_grid]]) {
          atomic_fetch_add_explicit(u, 1u, memory_order_relaxed);
          atomic_fetch_add_explicit(s, (i % 2) ? 1 : -2, memory_order_relaxed);
          atomic_fetch_add_explicit(f, 0.5f, memory_order_relaxed);
        }""")
    u, s, f = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), torch.zeros(1)
    lib.dispatch("count", (64,), (128,), [u, s, f])
    assert u.item() == 8192 and s.item() == -4096 and f.item() == 4096.0


def test_bytes_buffers_and_storage_offsets():
    lib = build("""
        struct args { int n; float add; };
        kernel void addk(device float *x [[buffer(0)]], constant args &a [[buffer(1)]],
                         uint i [[thread_position_in_grid]]) {
          if (int(i) < a.n) { x[i] += a.add; }
        }""")
    base = torch.zeros(100)
    view = base[10:50]
    lib.dispatch("addk", (2,), (32,), [view, struct.pack("if", 40, 2.5)])
    assert base[10:50].eq(2.5).all() and base[:10].eq(0).all() and base[50:].eq(0).all()


def test_a_constant_buffer_aliasing_a_written_one_is_refused():
    lib = build("""
        kernel void ca(constant float *c [[buffer(0)]], device float *o [[buffer(1)]],
                       device const float *r [[buffer(2)]], uint i [[thread_position_in_grid]]) {
          o[i] = c[i] + r[i];
        }
        template <typename T>
        kernel void tc(constant T *c [[buffer(0)]], device T *o [[buffer(1)]], uint i [[thread_position_in_grid]]) {
          o[i] = c[i] + 1;
        }
        template [[host_name("tc_float")]] kernel void tc<float>(constant float *, device float *, uint);""")
    x, y = torch.ones(8), torch.zeros(8)
    lib.dispatch("ca", (1,), (8,), [x, y, x])  # constant and read-only views of one buffer may alias
    assert y.eq(2).all()
    for kernel, buffers in (("ca", [y[2:], y, x]), ("tc_float", [y, y[4:]])):
        with pytest.raises(ValueError, match=rf"kernel '{kernel}': the constant buffer \[\[buffer\(0\)\]\] overlaps"):
            lib.dispatch(kernel, (1,), (4,), buffers)


def test_attention_without_a_sequence_table_binds_no_written_tensor_as_constant():
    # the kernels read the sequence buffer (10 forward, 15 backward) as constant memory; without a
    # table it once stood in with the output, which the check above refuses
    import flashattn_mps

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 9, 16, generator=gen).requires_grad_()
    k, v = (torch.randn(1, 2, 12, 16, generator=gen).requires_grad_() for _ in range(2))
    flashattn_mps.flash_attention(q, k, v, causal=True).sum().backward()  # forward and backward kernels
    flashattn_mps.flash_attention(q[:, :, :1].detach(), k.detach(), v.detach())  # decode
    assert q.grad.isfinite().all() and k.grad.isfinite().all()


def test_compile_error_names_file_and_line():
    with pytest.raises(MetalCompileError, match=r"broken\.metal:5:.*error"):
        build(
            """
            kernel void k(device float *x [[buffer(0)]]) {
              x[0] = undefined_name;
            }""",
            name="broken.metal",
        )


DIVERGENT = {
    "partial_barrier": (
        """
        kernel void bad(device float *x [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
          if (tid < 40) {
            threadgroup_barrier(mem_flags::mem_threadgroup);
          }
          x[tid] = 1.0f;
        }""",
        r"threadgroup_barrier",
    ),
    "divergent_simdgroup_barrier": (
        """
        kernel void bad(device float *x [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
          float v = 1.0f;
          if (lane < 16) {
            simdgroup_barrier(mem_flags::mem_threadgroup);
          } else {
            v = simd_sum(v);
          }
          x[lane] = v;
        }""",
        r"simdgroup_barrier",
    ),
    "barrier_lines_differ": (
        """
        kernel void bad(device float *x [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
          if (tid < 32) {
            threadgroup_barrier(mem_flags::mem_threadgroup);
          } else {
            threadgroup_barrier(mem_flags::mem_threadgroup);
          }
          x[tid] = 1.0f;
        }""",
        r"threadgroup_barrier",
    ),
}


@pytest.mark.parametrize("case", sorted(DIVERGENT))
def test_divergence_is_diagnosed_not_hung(case):
    source, construct = DIVERGENT[case]
    lib = build(source, name=f"{case}.metal")
    with pytest.raises(MetalDispatchError) as info:
        lib.dispatch("bad", (2,), (64,), [torch.zeros(64)])
    message = str(info.value)
    assert "bad" in message and f"{case}.metal:" in message
    assert pytest.importorskip("re").search(construct, message), message


def test_bad_dispatch_arguments():
    lib = build("""
        kernel void k(device float *x [[buffer(0)]], device float *y [[buffer(1)]],
                      uint i [[thread_position_in_grid]]) { y[i] = x[i]; }""")
    x = torch.zeros(32)
    with pytest.raises(ValueError, match="kernel 'nope' is not in this library"):
        lib.dispatch("nope", (1,), (32,), [x, x])
    with pytest.raises(ValueError, match="1025 threads"):
        lib.dispatch("k", (1,), (1025,), [x, x])
    with pytest.raises(ValueError, match=r"buffers\[1\] is on meta"):
        lib.dispatch("k", (1,), (32,), [x, x.to("meta")])
    with pytest.raises(TypeError, match=r"buffers\[0\] must be a CPU torch.Tensor or bytes"):
        lib.dispatch("k", (1,), (32,), [[1.0], x])
    with pytest.raises(ValueError, match=r"buffer\(1\)"):
        lib.dispatch("k", (1,), (32,), [x])
    with pytest.raises(ValueError, match="grid dimensions"):
        lib.dispatch("k", (0,), (32,), [x, x])
    with pytest.raises(ValueError, match="totals 40000 bytes"):
        lib.dispatch("k", (1,), (32,), [x, x], threadgroup_memory=[40000])


@pytest.mark.slow
def test_concurrent_compilation_from_two_processes(tmp_path):
    source = (
        HEADER
        + f"// {uuid.uuid4()}\n"
        + textwrap.dedent("""
        kernel void k(device float *x [[buffer(0)]], uint i [[thread_position_in_grid]]) { x[i] = float(i); }""")
    )
    script = textwrap.dedent(f"""
        import torch
        from flashattn_mps.metal_cpu import compile_library
        lib = compile_library({source!r})
        x = torch.zeros(64)
        lib.dispatch("k", (2,), (32,), [x])
        assert torch.equal(x, torch.arange(64.0))
        print("ok")
    """)
    env = dict(os.environ, FLASHATTN_MPS_CACHE=str(tmp_path))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and out.strip() == "ok", err
    assert any(name.endswith(".so") for name in os.listdir(tmp_path))


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHATTN_MPS_CACHE", str(tmp_path / "kernels"))
    assert metal_cpu.cache_dir() == str(tmp_path / "kernels")
    assert os.path.isdir(tmp_path / "kernels")
