"""The CPU Metal device on what real-world Metal kernels use (issue 18): each test's small kernel is
written for the test, after a pattern found in public kernels (MLX, llama.cpp)."""
from __future__ import annotations

import math
import struct
import textwrap

import pytest
import torch

from flashattn_mps.metal_cpu import MetalCompileError, compile_library

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
