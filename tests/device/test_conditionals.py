"""The CPU Metal device's rewrite of the conditional operator (csrc/cpu_device/prepass.c) finds
where a condition and an operand end when angle brackets are near: template-ids (their commas
included, nested, qualified, as MLX's headers write `is_same_v<T, U> ? a : b`) and comparisons and
shifts, which are not template arguments."""

from __future__ import annotations

import textwrap

import torch

from flashattn_mps.metal_cpu import compile_library

SOURCE = """
#include <metal_stdlib>
using namespace metal;

template <typename T, int N>
struct box {
  static constant constexpr const int value = N; // MLX's STEEL_CONST
};

// MLX's pattern: a type trait chooses between operands of the template's type (here half and int,
// which meet as half only by MSL's rules: the rewrite must still take place).
template <typename T>
T zero_unless_half(T v) {
  return is_same_v<T, half> ? v : 0;
}

int signed_by(bool positive, int v) { return positive ? v : -v; }

kernel void k(const device int *x [[buffer(0)]], device float *out [[buffer(1)]],
              const device half *h [[buffer(2)]]) {
  const int a = x[0], b = x[1], c = x[2];
  float y = is_same_v<int, int> ? 1 : 0;
  out[0] = y;
  out[1] = metal::is_same<int, float>::value ? 1 : 2;
  out[2] = is_same_v<vec<float, 2>, float2> ? 3 : 4;             // a comma in nested arguments
  out[3] = is_same_v<vec<int, 2>, vec<int, 2>> ? 5 : 6;          // nested, closed by >>
  out[4] = box<box<int, 1>, 7>::value > 6 ? 7 : 8;                // a comparison after a template-id
  out[5] = a < b ? 9 : 10;
  out[6] = a<b>c ? 11 : 12;                                       // (a < b) > c
  out[7] = a >> 1 ? 13 : 14;                                      // a shift
  out[8] = (a >> 1) >= b ? 15 : 16;
  out[9] = max(a, b < c ? b : c);                                 // a comparison after a comma
  out[10] = signed_by(a < b, c > a ? 17 : 18);                    // two arguments, not a template-id
  out[11] = max(is_same_v<int, uint> ? a : b, c);
  out[12] = a > -1 ? 19 : 20;                                     // greater-than before a unary minus
  out[13] = a < b && is_same_v<int, int> ? 21 : 22;
  out[14] = c ? is_same_v<int, int> : is_same_v<int, float>;      // template-ids as operands
  out[15] = float(zero_unless_half(h[0])) + float(zero_unless_half(a));
  out[16] = is_same_v<int, int> == true ? box<int, 23>::value : 24;
}
"""


def test_conditionals_around_template_ids_and_comparisons():
    lib = compile_library(textwrap.dedent(SOURCE), name="conditionals.metal")
    a, b, c = 4, 3, 0
    out = torch.zeros(17)
    lib.dispatch("k", (1,), (1,), [torch.tensor([a, b, c], dtype=torch.int32), out, torch.tensor([2.5]).half()])
    want = [
        1,
        2,
        3,
        5,
        7,
        9 if a < b else 10,
        11 if (a < b) > c else 12,
        13 if a >> 1 else 14,
        15 if (a >> 1) >= b else 16,
        max(a, min(b, c)),
        (17 if c > a else 18) * (1 if a < b else -1),
        max(b, c),
        19 if a > -1 else 20,
        21 if a < b else 22,
        0,
        2.5,
        23,
    ]
    assert out.tolist() == [float(w) for w in want]
