"""The CPU Metal device on what real-world Metal kernels use: each test's small kernel is
written for the test, after a pattern found in public kernels (MLX, llama.cpp)."""

from __future__ import annotations

import platform
import struct
import textwrap

import pytest
import torch

from flashattn_mps.metal_cpu import MetalCompileError, MetalDispatchError, compile_library

# slow: patterns of other projects' kernels (MLX, llama.cpp), each compiled for its own test
pytestmark = pytest.mark.slow

HEADER = "#include <metal_stdlib>\nusing namespace metal;\n"


def build(body: str, macros=None, name="ecosystem.metal"):
    return compile_library(HEADER + textwrap.dedent(body), macros=macros, name=name)


def test_an_overload_added_to_metal_fast_does_not_hide_the_float_one():
    # A library adds bfloat overloads to metal::fast (as MLX's bfloat math helpers do); fast::exp and
    # precise::exp of a float must still be the float functions, not a silent round trip through bfloat.
    lib = build("""
        namespace metal {
        namespace fast {
        METAL_FUNC bfloat exp(bfloat x) { return static_cast<bfloat>(fast::exp(static_cast<float>(x))); }
        }
        namespace precise {
        METAL_FUNC bfloat exp(bfloat x) { return static_cast<bfloat>(precise::exp(static_cast<float>(x))); }
        }
        }
        kernel void k(const device float *x [[buffer(0)]], device float *out [[buffer(1)]],
                      device bfloat *bout [[buffer(2)]], uint i [[thread_position_in_grid]]) {
          out[2 * i] = fast::exp(x[i]);
          out[2 * i + 1] = precise::exp(x[i]) + metal::fast::max(x[i], 0.0f);
          bout[i] = fast::exp(static_cast<bfloat>(x[i]));
        }""")
    x = torch.linspace(-2, 2, 32)
    out = torch.zeros(64)
    bout = torch.zeros(32, dtype=torch.bfloat16)
    lib.dispatch("k", (1,), (32,), [x, out, bout])
    want = torch.exp(x.double())
    assert (out[0::2].double() - want).abs().max() <= 1e-7 * want.abs().max()
    assert (out[1::2].double() - (want + x.double().clamp(min=0))).abs().max() <= 2e-7 * want.abs().max()
    torch.testing.assert_close(bout, torch.exp(x.bfloat16().float()).bfloat16(), rtol=0, atol=0)


def test_float_still_does_not_convert_implicitly_to_bfloat():
    with pytest.raises(MetalCompileError):
        build("""
            METAL_FUNC bfloat twice(bfloat x) { return x + x; }
            kernel void k(device bfloat *out [[buffer(0)]]) { out[0] = twice(1.5f); }""")


def test_function_constant_indices_up_to_65535():
    # MLX numbers its constants from 100 up, llama.cpp from 300 past 1000.
    lib = build("""
        constant bool has_bias [[function_constant(100)]];
        constant int scale [[function_constant(1024)]];
        constant float offset [[function_constant(65535)]];
        constant bool unset [[function_constant(302)]];
        kernel void k(device float *out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
          out[i] = float(i * scale) + (has_bias ? offset : 0.0f) + (is_function_constant_defined(unset) ? 1e6f : 0.0f);
        }""")
    out = torch.zeros(8)
    lib.dispatch("k", (1,), (8,), [out], constants={65535: 0.5, 100: True, 1024: 3})
    assert out.tolist() == [3.0 * i + 0.5 for i in range(8)]
    with pytest.raises(ValueError, match="65535"):
        lib.dispatch("k", (1,), (8,), [out], constants={65536: 1})
    with pytest.raises(MetalCompileError, match="65535"):
        build("""
            constant int too_far [[function_constant(65536)]];
            kernel void k(device int *out [[buffer(0)]]) { out[0] = too_far; }""")


def test_apple_internal_builtins_of_real_headers():
    # bfloat helpers written the way Apple-derived headers write them: the internal __metal_* math
    # builtins with a fast-math mode, the SIMD builtins, and internal traits under the pragma.
    lib = build("""
        #pragma METAL internals : enable
        template <typename T>
        constexpr constant bool is_word = _disjunction<is_same<T, int>, is_same<T, uint>>::value;
        #pragma METAL internals : disable
        namespace metal {
        METAL_FUNC bfloat exp(bfloat x) { return static_cast<bfloat>(__metal_exp(static_cast<float>(x), __METAL_MAYBE_FAST_MATH__)); }
        namespace fast {
        METAL_FUNC bfloat exp(bfloat x) { return static_cast<bfloat>(__metal_exp(static_cast<float>(x), __METAL_FAST_MATH__)); }
        METAL_FUNC bfloat fmax3(bfloat x, bfloat y, bfloat z) {
          return static_cast<bfloat>(__metal_fmax3(static_cast<float>(x), static_cast<float>(y), static_cast<float>(z), __METAL_FAST_MATH__));
        }
        }
        namespace precise {
        METAL_FUNC float log(float x) { return __metal_log(x, __METAL_PRECISE_MATH__); }
        }
        METAL_FUNC bfloat simd_sum(bfloat x) { return static_cast<bfloat>(__metal_simd_sum(static_cast<float>(x))); }
        METAL_FUNC bfloat simd_shuffle_down(bfloat x, ushort d) {
          return static_cast<bfloat>(__metal_simd_shuffle_down(static_cast<float>(x), d));
        }
        METAL_FUNC bfloat simd_shuffle_and_fill_up(bfloat x, bfloat fill, ushort d) {
          return static_cast<bfloat>(__metal_simd_shuffle_and_fill_up(static_cast<float>(x), static_cast<float>(fill), d,
                                                                     __metal_get_simdgroup_size(ushort())));
        }
        }
        kernel void k(const device bfloat *x [[buffer(0)]], device float *out [[buffer(1)]],
                      uint i [[thread_position_in_grid]]) {
          static_assert(is_word<int> && !is_word<float>, "_disjunction");
          bfloat v = x[i];
          out[8 * i + 0] = metal::exp(v);
          out[8 * i + 1] = fast::exp(v);
          out[8 * i + 2] = precise::log(float(i + 1));
          out[8 * i + 3] = simd_sum(v);
          out[8 * i + 4] = simd_shuffle_down(v, 1);
          out[8 * i + 5] = simd_shuffle_and_fill_up(v, bfloat(-1.0f), 2);
          out[8 * i + 6] = fast::fmax3(v, bfloat(0.25f), bfloat(-3.0f));
          out[8 * i + 7] = float(__metal_get_thread_index_in_simdgroup(ushort()) + __metal_get_simdgroup_size(uint()));
          out[256 + i] = float(__metal_nextafter(v, bfloat(INFINITY))) + __metal_nextafter(float(v), -INFINITY);
          out[288 + i] = __metal_simd_xor(i == 3 ? -0.0f : 0.0f);  // the bits: only lane 3's sign
        }""")
    x = torch.linspace(-1, 1, 32).bfloat16()
    out = torch.zeros(32 * 10)
    lib.dispatch("k", (1,), (32,), [x, out])
    o = out[:256].view(32, 8)
    xf = x.float()
    e = torch.exp(xf).bfloat16().float()
    assert torch.equal(o[:, 0], e) and torch.equal(o[:, 1], e)
    torch.testing.assert_close(o[:, 2], torch.log(torch.arange(1, 33).float()))
    assert torch.equal(
        o[:, 3], torch.full((32,), xf.sum().bfloat16().item())
    )  # sum of bfloat-exact values, exact in float
    assert torch.equal(o[:31, 4], xf[1:]) and o[31, 4] == xf[31]
    assert torch.equal(o[2:, 5], xf[:-2]) and torch.equal(o[:2, 5], torch.tensor([-1.0, -1.0]))
    assert torch.equal(o[:, 6], xf.clamp(min=0.25))
    assert torch.equal(o[:, 7], torch.arange(32).float() + 32)
    up = torch.nextafter(x, torch.tensor(float("inf")).bfloat16()).float()
    down = torch.nextafter(xf, torch.tensor(float("-inf")))
    assert torch.equal(out[256:288], up + down)
    assert (out[288:] == 0).all() and torch.signbit(out[288:]).all()


def test_an_unbound_optional_buffer_reads_zeroes_and_cannot_be_written():
    # A dead read of an optional pointer argument whose function constant is false (a mask pointer
    # read before the branch that would use it) reads zeroes instead of killing the process.
    lib = build("""
        constant bool has_mask [[function_constant(200)]];
        constant bool write_it [[function_constant(201)]];
        kernel void k(device float *out [[buffer(0)]], const device float *mask [[buffer(1), function_constant(has_mask)]],
                      device float *scratch [[buffer(2), function_constant(has_mask)]],
                      uint i [[thread_position_in_grid]]) {
          float m = mask[i * 1024];
          out[i] = has_mask ? m : m + 2.0f;
          if (write_it) scratch[i] = 1.0f;
        }""")
    out = torch.full((16,), -1.0)
    lib.dispatch("k", (1,), (16,), [out], constants={200: False, 201: False})
    assert out.tolist() == [2.0] * 16
    lib.dispatch("k", (1,), (16,), [out, torch.arange(16 * 1024).float()], constants={200: True, 201: False})
    assert out.tolist() == [1024.0 * i for i in range(16)]
    with pytest.raises(MetalDispatchError, match="'k'"):
        lib.dispatch("k", (1,), (16,), [out], constants={200: False, 201: True})


def test_a_general_protection_fault_is_named_as_such():
    # On x86 a non-canonical address faults without an address (SI_KERNEL): the message says so.
    lib = build("""
        kernel void k(device float *x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
          device float *wild = (device float *)(0x8000000000000000ul + ulong(x[i]));
          *wild = 1.0f;
        }""")
    fault = "general protection fault" if platform.machine() == "x86_64" else "invalid memory access"
    with pytest.raises(MetalDispatchError, match=fault):
        lib.dispatch("k", (1,), (4,), [torch.zeros(4)])


def test_a_long_compile_log_stays_whole():
    # 200 distinct errors: far beyond the message's 8 KiB, all kept in the exception's log.
    body = "\n".join(f"  float v{i} = undeclared_{i};" for i in range(200))
    with pytest.raises(MetalCompileError) as caught:
        build("kernel void k(device float *out [[buffer(0)]]) {\n" + body + "\n}")
    error = caught.value
    message = str(error)
    assert message.startswith("ecosystem.metal:") and "undeclared_0" in message.splitlines()[0]
    assert len(message) < 8192 and "undeclared_199" not in message
    assert error.log_path and error.log_path in message
    assert all(f"undeclared_{i}" in error.log for i in (0, 100, 199))
    assert "(200 errors," in message


def test_library_pieces_real_kernels_use():
    lib = compile_library(
        """
        #include <metal_stdlib>
        #include <metal_common>
        #include <metal_matrix>
        using namespace metal;
        template <class T> struct strip { using type = metal::remove_addrspace_t<T>; };
        kernel void k(const device float *x [[buffer(0)]], device float *out [[buffer(1)]],
                      uint i [[thread_position_in_grid]]) {
          static_assert(is_same_v<strip<float>::type, float>, "remove_addrspace_t");
          metal::array<float, 3> a = {1.0f, 2.0f, 3.0f};
          uniform<float> u = make_uniform(x[0]);
          float4 partial = {x[i], 2.0f};                 // lanes 2 and 3 are 0
          float4 one = {x[i]};                           // 1 lane, not a broadcast
          float4x4 m(2.0f);                              // diagonal
          m[3] = float4(1.0f, 2.0f, 3.0f, 4.0f);
          float4 mv = m * float4(1.0f, 1.0f, 1.0f, 1.0f);
          half4x4 h = half4x4(half(1.0h)) * half4x4(half(3.0h));
          device float *o = out + 16 * i;
          o[0] = a[0] + a[1] * a[2] + float(a.size());   // 1 + 6 + 3
          o[1] = u;
          o[2] = partial.y + partial.z + partial.w + one.x + one.y + one.w;
          o[3] = mv.x; o[4] = mv.w;
          o[5] = float(h[2][2]) + float(h[2][1]);
          float4x4 widened = (float4x4)h;                // another element type: explicit (llama.cpp)
          o[14] = widened[1][1] + float(half4x4(m)[3][0]);
          o[6] = quad_sum(x[i]);
          o[7] = quad_shuffle_xor(x[i], 1);
          o[8] = quad_broadcast(x[i], 3);
          o[9] = quad_prefix_exclusive_sum(x[i]);
          o[10] = float(uint16_t(quad_ballot(i % 2 == 0)));
          o[11] = simd_shuffle_and_fill_down(x[i], -x[i], 1, 4);
          o[12] = quad_shuffle_down(x[i], 1);
          o[13] = quad_is_first() ? 1.0f : 0.0f;
        }
        kernel void mm(const device float *a [[buffer(0)]], const device float *b [[buffer(1)]],
                       device float *out [[buffer(2)]]) {
          simdgroup_float8x8 ma, mb;
          simdgroup_load(ma, a, 8);
          simdgroup_load(mb, b, 8);
          simdgroup_float8x8 r = ma * mb + ma;
          simdgroup_store(r, out, 8);
        }""",
        name="ecosystem.metal",
    )
    x = torch.arange(32).float()
    out = torch.zeros(32 * 16)
    lib.dispatch("k", (1,), (32,), [x, out])
    o = out.view(32, 16)
    q = x.view(8, 4)
    assert (o[:, 0] == 10).all() and (o[:, 1] == 0).all()
    assert torch.equal(o[:, 2], x + 2)
    assert (o[:, 3] == 3).all() and (o[:, 4] == 4).all()  # row 0: 2 + 1; row 3: the last column's 4
    assert (o[:, 5] == 3).all()
    assert torch.equal(o[:, 6], q.sum(1).repeat_interleave(4))
    assert torch.equal(o[:, 7], q[:, [1, 0, 3, 2]].reshape(-1))
    assert torch.equal(o[:, 8], q[:, 3].repeat_interleave(4))
    assert torch.equal(o[:, 9], (q.cumsum(1) - q).reshape(-1))
    assert (o[:, 10] == 0b0101).all()
    fill = torch.cat([q[:, 1:], -q[:, :1]], 1).reshape(-1)
    assert torch.equal(o[:, 11], fill)
    assert torch.equal(o[:, 12], torch.cat([q[:, 1:], q[:, 3:]], 1).reshape(-1))
    assert torch.equal(o[:, 13], torch.tensor([1.0, 0, 0, 0] * 8))
    assert (o[:, 14] == 4).all()  # 3, and the last column's 1
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    r = torch.zeros(8, 8)
    lib.dispatch("mm", (1,), (32,), [a, b, r])
    torch.testing.assert_close(r, a @ b + a)


def test_the_conditional_operator_meets_half_and_vectors_as_msl_builtin_types():
    # llama.cpp writes `c ? p[i] : half2(-MAXHALF, -MAXHALF)` with p a `const device half2 *`,
    # `c ? x->d : x->d / 16.f` (half and float) and `c ? *(device T *)x : 0` (half and int): MSL's
    # builtin types meet by its arithmetic rules, which C++'s rules for classes do not give.
    lib = build("""
        struct block { half d; };
        METAL_FUNC void bump(thread int &n) { n += 1; }
        kernel void k(const device half2 *p [[buffer(0)]], const device block *b [[buffer(1)]],
                      const device half *h [[buffer(2)]], device float *out [[buffer(3)]],
                      device half2 *out2 [[buffer(4)]], threadgroup half *t [[threadgroup(0)]],
                      uint i [[thread_position_in_grid]]) {
          out2[i] = i < 3 ? p[i] : half2(-MAXHALF, -MAXHALF);
          const float d = i < 2 ? b[i].d : b[i].d / 16.f;         // float
          t[i] = i % 2 ? h[i] : 0;                                // half
          auto w = i % 2 ? h[i] : 1.5h;                           // half, not float
          float a = 1, c = 2;
          (i % 2 ? a : c) = 5;                                    // builtin lvalues stay lvalues
          int n = 0;
          i > 4 ? bump(n) : (void)0;                              // void operands
          int nested = i > 1 ? i > 2 ? 3 : 2 : 1;
          constexpr int tile = sizeof(half) > 1 ? 16 : 8;         // constant expressions
          device float *o = out + 8 * i;
          o[0] = d; o[1] = t[i]; o[2] = a + 10 * c; o[3] = n; o[4] = nested + tile;
          o[5] = float(sizeof(w)); o[6] = w;
        }""")
    p = torch.arange(16, dtype=torch.float16).view(8, 2)
    b = torch.arange(1, 9, dtype=torch.float16)
    h = torch.arange(8, dtype=torch.float16) * 0.5
    out = torch.zeros(64)
    out2 = torch.zeros(8, 2, dtype=torch.float16)
    lib.dispatch("k", (1,), (8,), [p, b, h, out, out2], threadgroup_memory=[16])
    want2 = torch.where(torch.arange(8).view(8, 1) < 3, p, torch.full_like(p, -65504.0))
    torch.testing.assert_close(out2, want2, rtol=0, atol=0)
    o = out.view(8, 8)
    i = torch.arange(8)
    odd = i % 2 == 1
    assert o[:, 0].tolist() == torch.where(i < 2, b.float(), b.float() / 16).tolist()
    assert o[:, 1].tolist() == torch.where(odd, h.float(), torch.zeros(8)).tolist()
    assert o[:, 2].tolist() == torch.where(odd, torch.full((8,), 25.0), torch.full((8,), 51.0)).tolist()
    assert o[:, 3].tolist() == (i > 4).float().tolist()
    assert o[:, 4].tolist() == (torch.tensor([1, 1, 2, 3, 3, 3, 3, 3]) + 16).float().tolist()
    assert o[:, 5].tolist() == [2.0] * 8
    assert o[:, 6].tolist() == torch.where(odd, h.float(), torch.full((8,), 1.5)).tolist()
    # MSL would assign to the chosen lvalue: assigning to a conditional of class-typed operands
    # that became a value must not compile (rather than write a temporary)
    with pytest.raises(MetalCompileError):
        build("""
            kernel void k(device half *x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
              half a = 1, c = 2;
              (i % 2 ? a : c) = x[0];
              x[i] = a + c;
            }""")


def test_limits_select_and_filled_matrices_as_llama_cpp_uses_them():
    lib = build("""
        kernel void k(const device uchar *bits [[buffer(0)]], device float *out [[buffer(1)]],
                      uint i [[thread_position_in_grid]]) {
          out[8 * i + 0] = select(1, -1, bits[i] & 4);            // an int condition: converts to bool
          out[8 * i + 1] = select(2.0f, 3.0f, int(i));
          simdgroup_float8x8 m = make_filled_simdgroup_matrix<float, 8>(1.5f);   // Rows = Cols
          threadgroup float tile[64];
          simdgroup_store(m, tile, 8);
          simdgroup_barrier(mem_flags::mem_threadgroup);
          out[8 * i + 2] = tile[i];
          out[8 * i + 3] = -FLT_MAX < 0 && FLT_MIN > 0 && FLT_EPSILON == 0x1.0p-23f ? FLT_MANT_DIG : 0;
          out[8 * i + 4] = float(HALF_MAX) + HALF_MANT_DIG + HALF_DIG;
          out[8 * i + 5] = INT_MAX == 2147483647 && UINT_MAX == 4294967295u && CHAR_BIT == 8 && SHRT_MIN == -32768
                           && LONG_MAX == 9223372036854775807L ? 1.0f : 0.0f;
          out[8 * i + 6] = isinf(float(HUGE_VALH)) ? 1.0f : 0.0f;
          out[8 * i + 7] = FLT_MAX;
        }""")
    bits = torch.arange(32, dtype=torch.uint8)
    out = torch.zeros(256)
    lib.dispatch("k", (1,), (32,), [bits, out])
    o = out.view(32, 8)
    assert o[:, 0].tolist() == [-1.0 if b & 4 else 1.0 for b in range(32)]
    assert o[:, 1].tolist() == [2.0] + [3.0] * 31
    assert o[:, 2].tolist() == [1.5] * 32
    assert o[:, 3].tolist() == [24.0] * 32
    assert o[:, 4].tolist() == [65504.0 + 11 + 3] * 32
    assert o[:, 5].tolist() == [1.0] * 32
    assert o[:, 6].tolist() == [1.0] * 32
    assert o[:, 7].tolist() == [torch.finfo(torch.float32).max] * 32


def test_macros_in_pragmas_are_expanded():
    # `#pragma unroll (MIN(DK8/2, 4*NSG))` in llama.cpp: the compiler proper expands macros where it
    # reads the pragma, so the preprocessing step must not leave them for it.
    lib = build("""
        #define MIN(x, y) ((x) < (y) ? (x) : (y))
        #define N 4
        kernel void k(device float *out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
          float s = 0;
        #pragma unroll (MIN(N, 8))
          for (int j = 0; j < N; j++) s += j;
        #pragma clang loop unroll_count(MIN(2, N))
          for (int j = 0; j < N; j++) s += 1;
          out[i] = s;
        }""")
    out = torch.zeros(4)
    lib.dispatch("k", (1,), (4,), [out])
    assert out.tolist() == [10.0] * 4


def test_half_and_bfloat_overloads_resolve_as_in_msl():
    lib = build("""
        METAL_FUNC float which(float) { return 1.0f; }
        METAL_FUNC float which(bfloat) { return 2.0f; }
        struct my_bfloat16 {  // a library's own 16-bit float type, converting through float
          uint16_t bits;
          constexpr operator float() const { return as_type<float>(uint(bits) << 16); }
        };
        kernel void k(const device half *x [[buffer(0)]], const device ushort *b [[buffer(1)]],
                      device float *out [[buffer(2)]], uint i [[thread_position_in_grid]]) {
          my_bfloat16 v{b[i]};
          half h = static_cast<half>(v);
          half implicit_h = v;
          bfloat bf = static_cast<bfloat>(v);
          out[4 * i + 0] = which(x[i]);       // f(half) picks f(float)
          out[4 * i + 1] = which(bf);
          out[4 * i + 2] = float(h) + float(implicit_h);
          out[4 * i + 3] = float(bf);
        }""")
    x = torch.linspace(-1, 1, 8).half()
    vals = torch.tensor([1.5, -2.25, 3.0, 0.5, 100.0, -0.125, 7.0, 1e-3]).bfloat16()
    bits = vals.view(torch.int16).clone()
    out = torch.zeros(32)
    lib.dispatch("k", (1,), (8,), [x, bits, out])
    o = out.view(8, 4)
    assert (o[:, 0] == 1).all() and (o[:, 1] == 2).all()
    assert torch.equal(o[:, 2], 2 * vals.float().half().float())
    assert torch.equal(o[:, 3], vals.float())


def test_simd_functions_act_on_the_active_lanes_in_divergent_control_flow():
    lib = build("""
        kernel void k(const device float *x [[buffer(0)]], device float *out [[buffer(1)]],
                      uint lane [[thread_index_in_simdgroup]], uint tid [[thread_index_in_threadgroup]]) {
          float v = x[tid];
          device float *o = out + 8 * tid;
          if (lane < 12) {
            o[0] = simd_sum(v);                                   // over lanes 0-11
            o[1] = float(uint64_t(simd_active_threads_mask()));
            o[2] = simd_is_first() ? 1.0f : 0.0f;
          } else {
            o[0] = simd_max(v);                                   // over lanes 12-31
            o[1] = float(uint64_t(simd_ballot(lane % 2 == 0)));   // even lanes among 12-31
            o[2] = simd_is_first() ? 1.0f : 0.0f;
          }
          if (lane % 3 == 0) o[3] = simd_prefix_exclusive_sum(1.0f);  // rank among lanes 0, 3, 6, ...
          threadgroup_barrier(mem_flags::mem_threadgroup);
          o[4] = simd_sum(v);                                     // reconverged: all 32 lanes
          if (lane >= 30) return;
          o[5] = simd_sum(1.0f);                                  // 30 lanes left
        }""")
    x = torch.arange(64).float()
    out = torch.full((64 * 8,), -7.0)
    lib.dispatch("k", (1,), (64,), [x, out])
    o = out.view(2, 32, 8)
    for s in range(2):
        xs = x[32 * s : 32 * s + 32]
        assert (o[s, :12, 0] == xs[:12].sum()).all() and (o[s, 12:, 0] == xs[12:].max()).all()
        assert (o[s, :12, 1] == 0xFFF).all()
        assert (o[s, 12:, 1] == sum(1 << i for i in range(12, 32, 2))).all()
        assert o[s, :, 2].nonzero().flatten().tolist() == [0, 12]
        assert o[s, 0::3, 3].tolist() == [float(i) for i in range(11)]
        assert (o[s, :, 4] == xs.sum()).all()
        assert (o[s, :30, 5] == 30).all() and (o[s, 30:, 5] == -7).all()


def test_address_spaces_stay_distinct():
    # Overloads and specialisations Metal tells apart by address space (MLX's complex.h, utils.h,
    # loaders): each call must reach its own one, as on a Mac.
    lib = build("""
        METAL_FUNC float space(device float &) { return 1.0f; }
        METAL_FUNC float space(constant float &) { return 2.0f; }
        METAL_FUNC float space(threadgroup float &) { return 3.0f; }
        METAL_FUNC float space(thread float &) { return 4.0f; }
        template <class T> METAL_FUNC float at(const device T *) { return 10.0f; }
        template <class T> METAL_FUNC float at(const threadgroup T *) { return 30.0f; }
        template <class P> struct kind { static constexpr int value = 0; };
        template <class T> struct kind<device T *> { static constexpr int value = 100; };
        template <class T> struct kind<threadgroup T *> { static constexpr int value = 300; };
        METAL_FUNC long offset(uint2 e, constant const int64_t strides[2]) { return e.x * strides[0] + e.y * strides[1]; }
        struct pair {  // members overloaded on the address space of `this`, with one body as MLX has them
          float a, b;
          constexpr pair(float x, float y) : a(x), b(y) {}
          constexpr pair(float x, float y) constant : a(x), b(y) {}
          pair() = default;
          pair() threadgroup = default;
          float sum() const thread { return a + b; }
          float sum() const device { return a + b; }
          float sum() const constant { return a + b; }
          float sum() const threadgroup { return a + b; }
        };
        struct tag {  // a constructor for constant objects only
          float v;
          constexpr tag(float x) constant : v(x) {}
        };
        constant pair k_pair = pair(1.0f, 2.0f);
        constant tag k_tag(5.0f);
        kernel void k(device float *out [[buffer(0)]], constant float *c [[buffer(1)]],
                      constant int64_t *strides [[buffer(2)]], device pair *pairs [[buffer(3)]],
                      uint i [[thread_position_in_grid]]) {
          threadgroup float tg[32];
          threadgroup pair tp;
          float local = 0.0f;
          tg[i] = float(i);
          if (i == 0) tp = pair(3.0f, 4.0f);
          threadgroup_barrier(mem_flags::mem_threadgroup);
          device float *o = out + 12 * i;
          o[0] = space(o[11]); o[1] = space(c[0]); o[2] = space(tg[i]); o[3] = space(local);
          o[4] = at(o) + at(tg);
          o[5] = float(kind<device float *>::value + kind<threadgroup float *>::value + kind<float *>::value);
          o[6] = float(offset(uint2(i, 1), strides));
          o[7] = k_pair.sum() + pairs[i].sum() + tp.sum() + pair(0.5f, 0.25f).sum();
          o[8] = k_tag.v;
        }""")
    out = torch.zeros(32 * 12)
    pairs = torch.arange(64).float()
    lib.dispatch("k", (1,), (32,), [out, torch.ones(1), torch.tensor([3, 1000]), pairs])
    o = out.view(32, 12)
    assert o[:, :4].tolist() == [[1.0, 2.0, 3.0, 4.0]] * 32
    assert (o[:, 4] == 40).all() and (o[:, 5] == 400).all()
    assert torch.equal(o[:, 6], 3 * torch.arange(32).float() + 1000)
    assert torch.equal(o[:, 7], 3 + pairs.view(32, 2).sum(1) + 7 + 0.75)
    assert (o[:, 8] == 5).all()


def test_members_whose_bodies_differ_by_the_address_space_of_this_are_refused():
    # One body serves objects in every address space here, which is faithful only when the set's
    # bodies agree: a set whose bodies differ must not run with the wrong one.
    with pytest.raises(MetalCompileError, match="'get' is overloaded on the address space of `this` with bodies"):
        build("""
            struct box {
              float v;
              float get() const device { return v; }
              float get() const threadgroup { return 2.0f * v; }
            };
            kernel void k(device box *b [[buffer(0)]], device float *out [[buffer(1)]]) { out[0] = b[0].get(); }""")


@pytest.mark.parametrize(
    "statement",
    [
        "threadgroup float *t = out;",  # device to threadgroup
        "device float *d = (device float *)c;",  # constant to device, even cast
        "constant float *k = (constant float *)out;",  # device to constant
    ],
)
def test_address_space_conversions_are_refused_as_in_msl(statement):
    # the message names the address spaces as MSL does
    with pytest.raises(
        MetalCompileError,
        match=r"mismatching address spaces|'threadgroup float \*' with an lvalue of type 'device float \*'",
    ):
        build(f"""
            kernel void k(device float *out [[buffer(0)]], constant float *c [[buffer(1)]]) {{
              {statement}
            }}""")


def test_explicit_specialisation_at_class_scope():
    # Apple's compiler (clang) takes it; g++ did not.
    lib = build("""
        struct pick {
          template <int N> static float f(float x) { return x * N; }
          template <> float f<0>(float x) { return -x; }
        };
        kernel void k(device float *out [[buffer(0)]]) { out[0] = pick::f<0>(1.0f) + pick::f<3>(2.0f); }""")
    out = torch.zeros(1)
    lib.dispatch("k", (1,), (1,), [out])
    assert out.item() == 5


def test_explicit_instantiation_spelling_out_a_const_constant_parameter():
    lib = build("""
        struct params { float scale; };
        template <typename T>
        [[kernel]] void scaled(const constant params *p [[buffer(0)]], device T *out [[buffer(1)]],
                               uint i [[thread_position_in_grid]]) {
          out[i] = T(p->scale * float(i) + 1.0f);
        }
        template [[host_name("scaled_float")]] [[kernel]] void scaled<float>(
            const constant params *p [[buffer(0)]], device float *out [[buffer(1)]], uint i [[thread_position_in_grid]]);
        template [[host_name("scaled_half")]] [[kernel]] void scaled<half>(
            const constant params *p [[buffer(0)]], device half *out [[buffer(1)]], uint i [[thread_position_in_grid]]);
        """)
    for name, dtype in (("scaled_float", torch.float32), ("scaled_half", torch.float16)):
        out = torch.zeros(8, dtype=dtype)
        lib.dispatch(name, (1,), (8,), [struct.pack("f", 0.5), out])
        assert torch.equal(out, (0.5 * torch.arange(8) + 1).to(dtype))


def test_the_compiler_must_be_clang(tmp_path, monkeypatch):
    # Kernels need clang's address spaces: without clang the message says what to install.
    monkeypatch.delenv("FLASHATTN_MPS_CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    source = "kernel void k(device float *out [[buffer(0)]]) { out[0] = 1.0f; }  // no clang"
    with pytest.raises(
        MetalCompileError, match=r"clang\+\+ 16 or newer, and PATH holds none .* apt-get install clang-16"
    ):
        build(source)
    gxx = tmp_path / "g++"  # what g++ says it is
    gxx.write_text("#!/bin/sh\necho 'g++ (Debian 12.2.0-14) 12.2.0'\n")
    gxx.chmod(0o755)
    monkeypatch.setenv("FLASHATTN_MPS_CXX", str(gxx))
    with pytest.raises(
        MetalCompileError, match=r"g\+\+' \(from FLASHATTN_MPS_CXX\) is not clang 16 or newer \(it says: g\+\+ \(Debian"
    ):
        build(source)


def test_a_kernel_over_32_kib_fails_at_its_dispatch_not_the_library():
    # Metal refuses such a kernel when its pipeline is created (MLX's steel attention instantiates
    # some it never dispatches): the library's other kernels compile and run.
    lib = build("""
        kernel void big(device float *out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
          threadgroup float tile[8193];
          tile[i] = 1.0f;
          out[i] = tile[i];
        }
        kernel void small(device float *out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
          threadgroup float tile[32];
          tile[i] = float(i);
          out[i] = tile[i];
        }""")
    out = torch.zeros(32)
    lib.dispatch("small", (1,), (32,), [out])
    assert torch.equal(out, torch.arange(32).float())
    with pytest.raises(ValueError, match=r"kernel 'big': threadgroup memory exceeds 32768 bytes"):
        lib.dispatch("big", (1,), (32,), [out])


@pytest.mark.parametrize("checked", [False, True])
def test_vectors_aligned_only_to_their_element_load_and_store_as_on_apple_gpus(checked):
    # ggml's kernel_mul_mm writes float4s into output rows of any length, so at addresses that are
    # multiples of 4 but not of 16; Apple GPUs need only the element's alignment. Here each float4
    # and half4 starts 1 or 2 elements past an aligned address: in device memory, through a
    # reference argument, a member and a swizzle, and in threadgroup memory, read back by a
    # neighbouring thread; checked mode finds nothing wrong with such accesses.
    lib = compile_library(
        HEADER
        + textwrap.dedent("""
        METAL_FUNC float4 sum(const device float4 &a, const device float4 &b) { return a + b; }
        kernel void k(const device float *x [[buffer(0)]], device float *y [[buffer(1)]],
                      const device half *hx [[buffer(2)]], device half *hy [[buffer(3)]],
                      uint i [[thread_position_in_grid]]) {
          threadgroup float4 tile[33];
          threadgroup half4 htile[33];
          const device float4 *a = (const device float4 *)(x + 1) + i, *b = (const device float4 *)(x + 2) + i;
          ((threadgroup float4 *)((threadgroup float *)tile + 1))[i] = sum(*a, *b);
          ((threadgroup half4 *)((threadgroup half *)htile + 2))[i] = *((const device half4 *)(hx + 1) + i) +
                                                                    *((const device half4 *)(hx + 2) + i);
          threadgroup_barrier(mem_flags::mem_threadgroup);
          uint j = i ^ 1;
          *((device float4 *)(y + 1) + i) = ((threadgroup float4 *)((threadgroup float *)tile + 1))[j];
          ((device float4 *)(y + 2 + 4 * 32))[i].yz = a->zw;
          device float4 *c = (device float4 *)(y + 3 + 8 * 32) + i;
          float p = b->x, q = b->y, r = b->z, s = b->w; // scalars the optimiser makes one float4
          c->x = p + 1.0f, c->y = q + 2.0f, c->z = r + 3.0f, c->w = s + 4.0f;
          *((device half4 *)(hy + 1) + i) = ((threadgroup half4 *)((threadgroup half *)htile + 2))[j];
        }"""),
        name="aligned.metal",
        checked=checked,
    )
    x = torch.randn(4 * 32 + 4, generator=torch.Generator().manual_seed(0))
    hx = x.half()
    y = torch.zeros(12 * 32 + 12)
    hy = torch.zeros(4 * 32 + 4, dtype=torch.float16)
    lib.dispatch("k", (1,), (32,), [x, y, hx, hy])
    neighbour = torch.arange(32) ^ 1
    want_y = torch.zeros_like(y)
    want_y[1 : 1 + 4 * 32] = (x[1 : 1 + 4 * 32] + x[2 : 2 + 4 * 32]).view(32, 4)[neighbour].flatten()
    want_y[2 + 4 * 32 :][: 4 * 32].view(32, 4)[:, 1:3] = x[1 : 1 + 4 * 32].view(32, 4)[:, 2:4]
    want_y[3 + 8 * 32 :][: 4 * 32] = (x[2 : 2 + 4 * 32].view(32, 4) + torch.tensor([1.0, 2.0, 3.0, 4.0])).flatten()
    want_hy = torch.zeros_like(hy)
    want_hy[1 : 1 + 4 * 32] = (hx[1 : 1 + 4 * 32] + hx[2 : 2 + 4 * 32]).view(32, 4)[neighbour].flatten()
    assert torch.equal(y, want_y)
    assert torch.equal(hy, want_hy)
