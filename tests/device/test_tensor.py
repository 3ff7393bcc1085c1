"""Metal 4 tensor operations on the CPU Metal device: metal::tensor, MPP's matmul2d at each scope,
cooperative tensors and their reductions, under the emulated family's lane layout and under the
scrambled one, against float64. The kernels are written for these tests."""

from __future__ import annotations

import struct
import textwrap

import pytest
import torch

from flashattn_mps.metal_cpu import MetalCompileError, compile_library

SOURCE = textwrap.dedent("""
    #include <metal_stdlib>
    #include <metal_tensor>
    #include <metal_logging>
    #include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
    using namespace metal;
    using namespace mpp::tensor_ops;

    struct sizes { int m, n, k; };

    // A (M x K) and B (K x N) in memory, stored transposed or not; C (M x N) in memory. The
    // descriptor is 32 x 24 x 16: smaller tensors are masked.
    template <typename T, typename TC, bool TL, bool TR, bool ACC, int K>
    kernel void mm_memory(device T *a [[buffer(0)]], device T *b [[buffer(1)]], device TC *c [[buffer(2)]],
                          constant sizes &s [[buffer(3)]]) {
      using ext = dextents<int, 2>;
      auto ta = TL ? tensor(a, ext(s.m, s.k), array<int, 2>{1, s.m}) : tensor(a, ext(s.k, s.m), array<int, 2>{1, s.k});
      auto tb = TR ? tensor(b, ext(s.k, s.n), array<int, 2>{1, s.k}) : tensor(b, ext(s.n, s.k), array<int, 2>{1, s.n});
      auto tc = tensor(c, ext(s.n, s.m));
      constexpr auto desc = matmul2d_descriptor(32, 24, K, TL, TR, false,
          ACC ? matmul2d_descriptor::mode::multiply_accumulate : matmul2d_descriptor::mode::multiply);
      matmul2d<desc, execution_simdgroup> op;
      op.run(ta, tb, tc);
    }
    #define MM(name, T, TC, TL, TR, ACC, K) \\
      template [[host_name(name)]] kernel void mm_memory<T, TC, TL, TR, ACC, K>( \\
          device T *, device T *, device TC *, constant sizes &);
    MM("mm_half_nn", half, float, false, false, false, 16)
    MM("mm_half_nt", half, float, false, true, false, 16)
    MM("mm_half_tn", half, float, true, false, false, 16)
    MM("mm_half_tt", half, float, true, true, false, 16)
    MM("mm_bfloat_nt_acc", bfloat, float, false, true, true, 16)
    MM("mm_float_tn_acc", float, float, true, false, true, 16)
    MM("mm_half_into_half", half, half, false, false, false, 16)
    constant constexpr int dynamic_k = static_cast<int>(dynamic_extent);  // K from the tensors
    MM("mm_float_dynamic_k", float, float, false, false, false, dynamic_k)

    // 64 x 32 x 16 over the whole threadgroup (its 4 SIMD-groups): a cooperative destination
    // stored, and a destination in threadgroup memory copied out.
    template <typename Scope>
    kernel void mm_scope(device float *a [[buffer(0)]], device float *b [[buffer(1)]], device float *c [[buffer(2)]],
                         device float *c2 [[buffer(3)]], uint tid [[thread_index_in_threadgroup]]) {
      threadgroup float staging[64 * 32];
      auto ta = tensor(a, extents<int, 16, 64>());
      auto tb = tensor(b, extents<int, 32, 16>());
      auto tc = tensor(c, extents<int, 32, 64>());
      auto ts = tensor(staging, extents<int, 32, 64>());
      constexpr auto desc = matmul2d_descriptor(64, 32, 16);
      matmul2d<desc, Scope> op;
      auto acc = op.template get_destination_cooperative_tensor<decltype(ta), decltype(tb), float>();
      op.run(ta, tb, acc);
      for (uint16_t i = 0; i < acc.get_capacity(); i++)
        if (acc.is_valid_element(i)) acc[i] += 1.0f;
      acc.store(tc);
      auto whole = ta.slice(0, 0);
      op.run(whole, tb, ts);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (uint i = tid; i < 64 * 32; i += 128) c2[i] = staging[i];
    }
    template [[host_name("mm_simdgroups")]] kernel void mm_scope<execution_simdgroups<4>>(
        device float *, device float *, device float *, device float *, uint);

    // Cooperative inputs and destination in one SIMD-group, through the API only: C += A * B^T,
    // then the rows' max and sum of C.
    template <typename T>
    kernel void cooperative(device T *a [[buffer(0)]], device T *bt [[buffer(1)]], device float *c [[buffer(2)]],
                            device float *rows [[buffer(3)]]) {
      auto ta = tensor(a, extents<int, 16, 16>());
      auto tbt = tensor(bt, extents<int, 16, 32>());
      auto tc = tensor(c, extents<int, 32, 16>());
      constexpr auto desc = matmul2d_descriptor(16, 32, 16, false, true, true,
                                                matmul2d_descriptor::mode::multiply_accumulate);
      matmul2d<desc, execution_simdgroup> op;
      auto ca = op.template get_left_input_cooperative_tensor<T, T, float>();
      auto cb = op.template get_right_input_cooperative_tensor<T, T, float>();
      auto cc = op.template get_destination_cooperative_tensor<decltype(ca), decltype(cb), float>();
      ca.load(ta);
      cb.load(tbt);
      cc.load(tc);
      op.run(ca, cb, cc);
      cc.store(tc);
      auto high = op.template get_row_reduction_destination_cooperative_tensor<decltype(ta), decltype(tbt), float>();
      auto total = op.template get_row_reduction_destination_cooperative_tensor<decltype(ta), decltype(tbt), float>();
      reduce_rows(cc, high, reduction_operation::max, reduction_operation_identity<float>::max_identity);
      reduce_rows(cc, total, reduction_operation::sum, reduction_operation_identity<float>::sum_identity);
      for (uint16_t i = 0; i < high.get_capacity(); i++) {
        if (!high.is_valid_element(i)) continue;
        int r = high.get_multidimensional_index(i)[0];
        rows[2 * r] = high[i];
        rows[2 * r + 1] = total[i];
      }
    }
    template [[host_name("cooperative_half")]] kernel void cooperative<half>(device half *, device half *, device float *, device float *);
    template [[host_name("cooperative_bfloat")]] kernel void cooperative<bfloat>(device bfloat *, device bfloat *, device float *, device float *);

    // O = (S * scale) V with S = Q K^T: the scores stay in cooperative tensors, scaled by their
    // coordinates through the API, and become the second product's left input.
    kernel void two_products(device half *q [[buffer(0)]], device half *k [[buffer(1)]], device half *v [[buffer(2)]],
                             device float *o [[buffer(3)]]) {
      auto tq = tensor(q, extents<int, 16, 16>());
      auto tk = tensor(k, extents<int, 16, 32>());
      auto tv = tensor(v, extents<int, 16, 32>());
      auto to = tensor(o, extents<int, 16, 16>());
      constexpr auto qk_desc = matmul2d_descriptor(16, 32, 16, false, true);
      constexpr auto pv_desc = matmul2d_descriptor(16, 16, 32);
      matmul2d<qk_desc, execution_simdgroup> qk;
      matmul2d<pv_desc, execution_simdgroup> pv;
      auto scores = qk.get_destination_cooperative_tensor<decltype(tq), decltype(tk), float>();
      qk.run(tq, tk, scores);
      for (uint16_t i = 0; i < scores.get_capacity(); i++) {
        if (!scores.is_valid_element(i)) continue;
        auto at = scores.get_multidimensional_index(i);
        scores[i] *= at[0] <= at[1] + 8 ? 0.125f : 0.0f;  // a band of keys per row
      }
      auto p = pv.get_left_input_cooperative_tensor<half, half, float>(scores);
      auto out = pv.get_destination_cooperative_tensor<decltype(p), decltype(tv), float>();
      pv.run(p, tv, out);
      out.store(to);
    }

    // The same product, with the fragments copied into the cooperative tensors' slots by Apple10's
    // lane layout (as kernels tuned for one GPU generation do) instead of asking the API.
    kernel void assumes_apple10(device half *a [[buffer(0)]], device half *bt [[buffer(1)]], device float *c [[buffer(2)]],
                                ushort lane [[thread_index_in_simdgroup]]) {
      constexpr auto desc = matmul2d_descriptor(16, 32, 16, false, true, true,
                                                matmul2d_descriptor::mode::multiply_accumulate);
      matmul2d<desc, execution_simdgroup> op;
      auto ca = op.get_left_input_cooperative_tensor<half, half, float>();
      auto cb = op.get_right_input_cooperative_tensor<half, half, float>();
      auto cc = op.get_destination_cooperative_tensor<decltype(ca), decltype(cb), float>();
      const short fm = ((lane >> 2) & 4) | ((lane >> 1) & 3), fn = (((lane >> 2) & 2) | (lane & 1)) * 4;
      for (short i = 0; i < 8; i++) {
        short r = fm + (i >> 2) * 8, col = fn + (i & 3);
        ca[i] = a[r * 16 + col];
        cb[i] = bt[r * 16 + col];
        cb[8 + i] = bt[(16 + r) * 16 + col];
        cc[i] = c[r * 32 + col];
        cc[8 + i] = c[r * 32 + 16 + col];
      }
      op.run(ca, cb, cc);
      for (short i = 0; i < 8; i++) {
        short r = fm + (i >> 2) * 8, col = fn + (i & 3);
        c[r * 32 + col] = cc[i];
        c[r * 32 + 16 + col] = cc[8 + i];
      }
    }

    // Where each lane's slots are: row * 32 + column of a 16 x 32 destination, and n * 16 + k of
    // the right operand of Q * K^T (K's row n, column k), -1 for no element.
    kernel void layout_table(device int *out [[buffer(0)]], device int *right [[buffer(1)]],
                             ushort lane [[thread_index_in_simdgroup]]) {
      constexpr auto desc = matmul2d_descriptor(16, 32, 16, false, true);
      matmul2d<desc, execution_simdgroup> op;
      auto ca = op.get_left_input_cooperative_tensor<half, half, float>();
      auto cb = op.get_right_input_cooperative_tensor<half, half, float>();
      auto cc = op.get_destination_cooperative_tensor<decltype(ca), decltype(cb), float>();
      out[lane * 33] = cc.get_capacity();
      for (uint16_t i = 0; i < cc.get_capacity() && i < 32; i++) {
        auto at = cc.get_multidimensional_index(i);
        out[lane * 33 + 1 + i] = cc.is_valid_element(i) ? at[1] * 32 + at[0] : -1;
      }
      for (uint16_t i = 0; i < cb.get_capacity() && i < 16; i++) {
        auto at = cb.get_multidimensional_index(i);
        right[lane * 16 + i] = cb.is_valid_element(i) ? at[0] * 16 + at[1] : -1;
      }
    }

    constant os_log logger("tests", "tensor");
    kernel void language(device float *out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
      vec<half, 8> v(half(0.5h));
      v[7] = half(float(i));
      logger.log_debug("thread %u", i);
      out[4 * i] = float(v[0] + v[7]);
      out[4 * i + 1] = isunordered(float(i) - 1.0f, i == 2 ? NAN : 0.0f) ? 1.0f : 0.0f;
      out[4 * i + 2] = float(sizeof(decltype(metal::declval<vec<bfloat, 8>>())));
      out[4 * i + 3] = float(__METAL_VERSION__);
    }
    """)

G = torch.Generator().manual_seed(26)


@pytest.fixture(scope="module", params=["family", "scrambled"])
def layout_lib(request):
    """The library under the family's layout and under the scrambled one: (layout, library)."""
    return request.param, compile_library(SOURCE, name="tensor.metal", tensor_layout=request.param)


@pytest.fixture(scope="module")
def family_lib():
    return compile_library(SOURCE, name="tensor.metal", tensor_layout="family")


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=G).to(dtype)


@pytest.mark.parametrize(
    "kernel, dtype, tl, tr, acc",
    [
        ("mm_half_nn", torch.float16, False, False, False),
        ("mm_half_nt", torch.float16, False, True, False),
        ("mm_half_tn", torch.float16, True, False, False),
        ("mm_half_tt", torch.float16, True, True, False),
        ("mm_bfloat_nt_acc", torch.bfloat16, False, True, True),
        ("mm_float_tn_acc", torch.float32, True, False, True),
        ("mm_float_dynamic_k", torch.float32, False, False, False),
    ],
)
def test_matmul2d_on_tensors_in_memory_masks_beyond_their_extents(family_lib, kernel, dtype, tl, tr, acc):
    m, n, k = (30, 20, 16) if kernel != "mm_float_dynamic_k" else (32, 24, 11)
    a, b = randn(m, k, dtype=dtype), randn(k, n, dtype=dtype)
    c0 = randn(m, n)
    c = c0.clone()
    stored_a = a.T.contiguous() if tl else a
    stored_b = b.T.contiguous() if tr else b
    family_lib.dispatch(kernel, 1, 32, [stored_a, stored_b, c, struct.pack("3i", m, n, k)])
    want = a.double() @ b.double() + (c0.double() if acc else 0)
    assert (c.double() - want).abs().max() <= 1e-5 * max(1.0, want.abs().max())


def test_matmul2d_rounds_once_into_a_half_destination(family_lib):
    a, b = randn(32, 16, dtype=torch.float16), randn(16, 24, dtype=torch.float16)
    c = torch.zeros(32, 24, dtype=torch.float16)
    family_lib.dispatch("mm_half_into_half", 1, 32, [a, b, c, struct.pack("3i", 32, 24, 16)])
    want = (a.float() @ b.float()).half()
    assert (c.float() - want.float()).abs().max() <= 2**-10 * want.float().abs().max()


@pytest.mark.parametrize("kernel", ["mm_simdgroups"])
def test_matmul2d_across_simdgroups(layout_lib, kernel):
    _, lib = layout_lib
    a, b = randn(64, 16), randn(16, 32)
    c, c2 = torch.zeros(64, 32), torch.zeros(64, 32)
    lib.dispatch(kernel, 1, 128, [a, b, c, c2])
    want = a.double() @ b.double()
    assert (c.double() - (want + 1)).abs().max() <= 1e-5
    assert (c2.double() - want).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cooperative_tensors_and_row_reductions(layout_lib, dtype):
    _, lib = layout_lib
    a, bt, c0 = randn(16, 16, dtype=dtype), randn(32, 16, dtype=dtype), randn(16, 32)
    c, rows = c0.clone(), torch.full((16, 2), float("nan"))
    name = "cooperative_half" if dtype == torch.float16 else "cooperative_bfloat"
    lib.dispatch(name, 1, 32, [a, bt, c, rows])
    want = c0.double() + a.double() @ bt.double().T
    assert (c.double() - want).abs().max() <= 1e-5
    assert (rows[:, 0].double() - want.max(1).values).abs().max() <= 1e-5
    assert (rows[:, 1].double() - want.sum(1)).abs().max() <= 1e-4


def test_a_destination_becomes_the_next_products_left_input(layout_lib):
    _, lib = layout_lib
    q, k, v = randn(16, 16, dtype=torch.float16), randn(32, 16, dtype=torch.float16), randn(32, 16, dtype=torch.float16)
    o = torch.zeros(16, 16)
    lib.dispatch("two_products", 1, 32, [q, k, v, o])
    s = q.double() @ k.double().T
    band = torch.arange(32)[None, :] <= torch.arange(16)[:, None] + 8
    p = (s * 0.125 * band).half().double()  # the left input holds half values
    assert (o.double() - p @ v.double()).abs().max() <= 1e-5


def test_a_kernel_assuming_apple10s_lane_layout_fails_under_the_scrambled_layout(layout_lib):
    layout, lib = layout_lib
    a, bt, c0 = randn(16, 16, dtype=torch.float16), randn(32, 16, dtype=torch.float16), randn(16, 32)
    c = c0.clone()
    lib.dispatch("assumes_apple10", 1, 32, [a, bt, c])
    error = (c.double() - (c0.double() + a.double() @ bt.double().T)).abs().max()
    assert (error > 0.1) if layout == "scrambled" else (error <= 1e-5)


def apple_table(family):
    """Where each lane's slots are, by the layouts MLX's and torch's kernels copy fragments by."""
    table = []
    for lane in range(32):
        if family == "apple10":
            fm, fn = (lane >> 2 & 4) | (lane >> 1 & 3), ((lane >> 2 & 2) | (lane & 1)) * 4
            slots = [(fm + (j % 8 >> 2) * 8, 16 * (j // 8) + fn + (j & 3)) for j in range(16)]
        else:  # Apple9: slots (Bn0[0..3] | Bn1[0..3] | Bn0[4..7] | Bn1[4..7]), columns {0, 1, 8, 9}
            fm, fn = (lane >> 4 & 1) * 4 + (lane >> 1 & 3), (lane >> 3 & 1) * 4 + (lane & 1) * 2
            slots = []
            for s in range(16):
                half, tile, j = s // 8, s % 8 // 4, s % 4
                slots.append((fm + half * 8, 16 * tile + fn + ((j & 1) | (j >> 1) << 3)))
        table.append([r * 32 + c for r, c in slots])
    return table


def apple_right_table(family):
    """Where each lane's slots of K^T's cooperative tensor are, as K's n * 16 + k: Apple10 lays it
    out as K is stored, Apple9 as K^T (torch's `BaseMPPFragK_Apple8`)."""
    table = []
    for lane in range(32):
        slots = []
        for s in range(16):
            if family == "apple10":
                fm, fn = (lane >> 2 & 4) | (lane >> 1 & 3), ((lane >> 2 & 2) | (lane & 1)) * 4
                e = s % 8
                n, k = 16 * (s // 8) + fm + (e >> 2) * 8, fn + (e & 3)
            else:
                fm0, fn0 = (lane >> 3 & 1) * 4 + (lane & 1) * 2, (lane >> 4 & 1) * 4 + (lane >> 1 & 3)
                e = s // 8 * 4 + s % 4
                n, k = 16 * (s % 8 // 4) + fm0 + (e & 1) + 8 * (e >> 1 & 1), fn0 + 8 * (e >> 2)
            slots.append(n * 16 + k)
        table.append(slots)
    return table


@pytest.mark.parametrize("family", ["apple10", "apple9"])
def test_the_family_layouts_are_the_ones_apples_kernels_assume(family):
    lib = compile_library(SOURCE, name="tensor.metal", gpu_family=family, tensor_layout="family")
    out, right = torch.full((32 * 33,), -2, dtype=torch.int32), torch.full((32 * 16,), -2, dtype=torch.int32)
    lib.dispatch("layout_table", 1, 32, [out, right])
    got = out.view(32, 33)
    assert (got[:, 0] == 16).all()
    assert got[:, 1:17].tolist() == apple_table(family)
    assert right.view(32, 16).tolist() == apple_right_table(family)


def test_the_scrambled_layout_holds_each_element_once_and_is_no_family_layout():
    lib = compile_library(SOURCE, name="tensor.metal", tensor_layout="scrambled")
    out = torch.full((32 * 33,), -2, dtype=torch.int32)
    lib.dispatch("layout_table", 1, 32, [out, torch.zeros(32 * 16, dtype=torch.int32)])
    got = out.view(32, 33)
    capacity = int(got[0, 0])
    assert (got[:, 0] == capacity).all() and capacity > 16
    held = got[:, 1 : 1 + capacity].flatten()
    held = held[held >= 0]
    assert sorted(held.tolist()) == list(range(16 * 32))
    assert got[:, 1:17].tolist() != apple_table("apple10")


def test_a_cooperative_tensor_of_another_operation_is_refused():
    source = SOURCE.split("struct sizes")[0] + textwrap.dedent("""
        kernel void k(device float *out [[buffer(0)]]) {
          matmul2d<matmul2d_descriptor(16, 32, 16), execution_simdgroup> op;
          matmul2d<matmul2d_descriptor(16, 16, 16), execution_simdgroup> other;
          auto a = op.get_left_input_cooperative_tensor<half, half, float>();
          auto b = op.get_right_input_cooperative_tensor<half, half, float>();
          auto c = other.get_destination_cooperative_tensor<decltype(a), decltype(b), float>();
          op.run(a, b, c);
        }""")
    with pytest.raises(MetalCompileError, match="the destination cooperative tensor is not this operation's"):
        compile_library(source, name="misuse.metal")


def test_metal_4_is_the_default_language_with_its_library_pieces(family_lib):
    out = torch.zeros(4 * 4)
    family_lib.dispatch("language", 1, 4, [out])
    o = out.view(4, 4)
    assert o[:, 0].tolist() == [0.5, 1.5, 2.5, 3.5]
    assert o[:, 1].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert (o[:, 2] == 16).all() and (o[:, 3] == 400).all()


def test_older_language_versions_and_the_option_checks():
    older = "#include <metal_stdlib>\nusing namespace metal;\nkernel void k(device int *o [[buffer(0)]]) { o[0] = __METAL_VERSION__; }"
    out = torch.zeros(1, dtype=torch.int32)
    compile_library(older, language_version="3.1").dispatch("k", 1, 1, [out])
    assert out.item() == 310
    with pytest.raises(MetalCompileError, match="tensor"):  # Metal 3.1 has no tensors
        compile_library(
            older.replace("o[0] = __METAL_VERSION__;", "metal::tensor<device int, metal::dextents<int, 1>> t;"),
            language_version="3.1",
        )
    with pytest.raises(ValueError, match="language_version"):
        compile_library(older, language_version="5.0")
    with pytest.raises(ValueError, match="gpu_family"):
        compile_library(older, gpu_family="apple8")
    with pytest.raises(ValueError, match="__METAL_VERSION__ is set by compile_library"):
        compile_library(older, macros={"__METAL_VERSION__": 300})


def test_the_family_and_layout_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("FLASHATTN_MPS_CPU_GPU_FAMILY", "apple7")
    with pytest.raises(ValueError, match="FLASHATTN_MPS_CPU_GPU_FAMILY"):
        compile_library(SOURCE)
    monkeypatch.setenv("FLASHATTN_MPS_CPU_GPU_FAMILY", "apple9")
    monkeypatch.setenv("FLASHATTN_MPS_CPU_TENSOR_LAYOUT", "scrambled")
    out = torch.full((32 * 33,), -2, dtype=torch.int32)
    compile_library(SOURCE, name="tensor.metal").dispatch(
        "layout_table", 1, 32, [out, torch.zeros(32 * 16, dtype=torch.int32)]
    )
    assert out.view(32, 33)[:, 1:17].tolist() != apple_table("apple9")
