// The additive mask's block classes: a pre-pass over attn_mask, q and k, run once per call before
// the prefill forward (FA_FC_MASK_BLOCKS), so that a float mask skips work as a bool mask or the
// causal band does.
//
// Every 8 x 8 block of (rows, keys) of each distinct broadcast block of the mask gets a class:
// SKIP when every entry is -inf, ZERO when every entry is +-0, ADD otherwise (a NaN or +inf entry
// makes its block ADD, so it reaches the scores). Edge blocks cover only the rows and keys that
// exist; a broadcast dim (stride 0) has one block along it.
//
// -inf added to a NaN or +inf score gives NaN (SDPA's rule), so a SKIP block may only be skipped
// when its scores are certainly finite. The pre-pass writes max |q| over each 8 rows of each
// (batch, head) and max |k| over each 8 keys of each (batch, kv head), +inf when one is not finite;
// a consumer skips a SKIP slice only when E * max|q| * max|k| * |scale| (plus the ALiBi bias
// bound) stays far below float's range, so no score of it can be NaN or infinite. Otherwise the
// slice is added as before.
//
// Workspace layout (fa_params' mask_block_* fields): one byte per class, in (batch, head, row
// block, key block) order over the distinct blocks, then (at float offsets) the q and k maxima.
#ifndef FA_MASK_BLOCKS_H
#define FA_MASK_BLOCKS_H

#include <metal_stdlib>
#include "fa_params.h"

enum { FA_MASK_BLOCK_SKIP = 0, FA_MASK_BLOCK_ZERO = 1, FA_MASK_BLOCK_ADD = 2 };

constant bool fa_mask_blocks [[function_constant(FA_FC_MASK_BLOCKS)]];

// Scores are bounded by this (in the base-2 domain) when a SKIP slice is skipped: 2^100, far from
// float's 2^128 after the sum's rounding, softcap and ALiBi.
#define FA_MASK_BLOCK_SCORE_BOUND 1.2676506002282294e30f

// The bits of x, so the tests hold under fast math too.
inline bool fa_bits_finite(float x) { return (metal::as_type<uint>(x) & 0x7f800000u) != 0x7f800000u; }

// The mask's entry at `offset` as a float (exact for every additive dtype).
inline float fa_mask_entry(const device uchar *mask, long offset) {
  switch (fa_mask_kind) {
  case FA_MASK_FLOAT: return ((const device float *)mask)[offset];
  case FA_MASK_HALF: return float(((const device half *)mask)[offset]);
#if defined(__HAVE_BFLOAT__)
  case FA_MASK_BFLOAT: return float(((const device bfloat *)mask)[offset]);
#endif
  default: return 0.0f;
  }
}

// max |x| over rows [row0, row0 + rows) and columns [0, cols) of a strided operand; +inf when one
// is not finite.
template <typename T>
inline float fa_block_max_abs(const device T *x, long row_stride, long col_stride, int rows, int cols) {
  float largest = 0.0f;
  bool finite = true;
  for (int r = 0; r < rows; ++r) {
    const device T *row = x + r * row_stride;
    for (int c = 0; c < cols; ++c) {
      const float value = float(row[c * col_stride]);
      finite = finite && fa_bits_finite(value);
      largest = metal::max(largest, metal::abs(value));
    }
  }
  return finite ? largest : INFINITY;
}

// One thread per item: the mask's distinct blocks, then q's blocks of 8 rows, then k's of 8 keys.
template <typename T>
[[kernel]] void fa_mask_blocks_pass(const device T *q [[buffer(FA_FORWARD_BUFFER_Q)]],
                                    const device T *k [[buffer(FA_FORWARD_BUFFER_K)]],
                                    device float *workspace [[buffer(FA_FORWARD_BUFFER_WORKSPACE)]],
                                    constant fa_params &p [[buffer(FA_FORWARD_BUFFER_PARAMS)]],
                                    const device uchar *mask [[buffer(FA_FORWARD_BUFFER_MASK)]],
                                    uint3 group [[threadgroup_position_in_grid]],
                                    uint tid [[thread_index_in_threadgroup]],
                                    uint3 group_size [[threads_per_threadgroup]]) {
  long item = long(group.x) * group_size.x + tid;
  const long classes =
      long(p.mask_block_counts[0]) * p.mask_block_counts[1] * p.mask_block_counts[2] * p.mask_block_counts[3];
  if (item < classes) {
    const int kb = int(item % p.mask_block_counts[3]);
    const int rb = int(item / p.mask_block_counts[3] % p.mask_block_counts[2]);
    const long h = item / (long(p.mask_block_counts[3]) * p.mask_block_counts[2]) % p.mask_block_counts[1];
    const long b = item / (long(p.mask_block_counts[3]) * p.mask_block_counts[2] * p.mask_block_counts[1]);
    const int rows = metal::min(8, p.q_len - 8 * rb), keys = metal::min(8, p.kv_len - 8 * kb);
    const int row_count = p.mask_strides[2] == 0 ? 1 : rows, key_count = p.mask_strides[3] == 0 ? 1 : keys;
    bool all_blocked = true, all_zero = true;
    const long base = b * p.mask_strides[0] + h * p.mask_strides[1] + long(8 * rb) * p.mask_strides[2] +
                      long(8 * kb) * p.mask_strides[3];
    for (int r = 0; r < row_count; ++r) {
      for (int c = 0; c < key_count; ++c) {
        const uint bits =
            metal::as_type<uint>(fa_mask_entry(mask, base + r * p.mask_strides[2] + c * p.mask_strides[3]));
        all_blocked = all_blocked && bits == 0xff800000u; // -inf
        all_zero = all_zero && (bits & 0x7fffffffu) == 0; // +0 or -0
      }
    }
    ((device uchar *)workspace)[item] =
        all_blocked ? FA_MASK_BLOCK_SKIP : (all_zero ? FA_MASK_BLOCK_ZERO : FA_MASK_BLOCK_ADD);
    return;
  }
  item -= classes;
  const int q_blocks = (p.q_len + 7) / 8, k_blocks = (p.kv_len + 7) / 8;
  const long q_items = long(p.batch) * p.q_heads * q_blocks;
  if (item < q_items) {
    const int rb = int(item % q_blocks);
    const long h = item / q_blocks % p.q_heads, b = item / (long(q_blocks) * p.q_heads);
    workspace[p.q_block_max_offset + item] =
        fa_block_max_abs(q + b * p.q_strides[0] + h * p.q_strides[1] + long(8 * rb) * p.q_strides[2], p.q_strides[2],
                         p.q_strides[3], metal::min(8, p.q_len - 8 * rb), p.head_dim);
    return;
  }
  item -= q_items;
  if (item < long(p.batch) * p.kv_heads * k_blocks) {
    const int kb = int(item % k_blocks);
    const long h = item / k_blocks % p.kv_heads, b = item / (long(k_blocks) * p.kv_heads);
    workspace[p.k_block_max_offset + item] =
        fa_block_max_abs(k + b * p.k_strides[0] + h * p.k_strides[1] + long(8 * kb) * p.k_strides[2], p.k_strides[2],
                         p.k_strides[3], metal::min(8, p.kv_len - 8 * kb), p.head_dim);
  }
}

// The class of the 8-row slice row0 .. row0 + 7 (row0 a multiple of 8, below L) against keys
// k0 .. k0 + bk - 1 of (b, h): SKIP when every block it touches is SKIP and its scores are
// certainly finite (above), ZERO when every block is ZERO, ADD otherwise. slope_log2 is the
// (batch, head)'s ALiBi slope (0 without ALiBi).
inline int fa_mask_slice_class(constant fa_params &p,
                               const device float *workspace,
                               long b,
                               long h,
                               long kv_h,
                               int row0,
                               int k0,
                               int bk,
                               float slope_log2) {
  const device uchar *classes = (const device uchar *)workspace;
  const long row_at =
      b * p.mask_block_strides[0] + h * p.mask_block_strides[1] + long(row0 / 8) * p.mask_block_strides[2];
  const int k_blocks = (p.kv_len + 7) / 8;
  const int first = k0 / 8, last = metal::min((k0 + bk - 1) / 8, k_blocks - 1);
  bool all_skip = true, all_zero = true;
  float k_max = 0.0f;
  const device float *k_maxima = workspace + p.k_block_max_offset + (b * p.kv_heads + kv_h) * k_blocks;
  for (int kb = first; kb <= last; ++kb) {
    const uchar c = classes[row_at + long(kb) * p.mask_block_strides[3]];
    all_skip = all_skip && c == FA_MASK_BLOCK_SKIP;
    all_zero = all_zero && c == FA_MASK_BLOCK_ZERO;
    k_max = metal::max(k_max, k_maxima[kb]);
  }
  if (all_zero) {
    return FA_MASK_BLOCK_ZERO;
  }
  if (!all_skip) {
    return FA_MASK_BLOCK_ADD;
  }
  const float q_max = workspace[p.q_block_max_offset + (b * p.q_heads + h) * ((p.q_len + 7) / 8) + row0 / 8];
  // A non-finite maximum, or 0 times one, fails the comparisons (NaN compares false).
  const bool scores_finite =
      float(p.head_dim) * metal::abs(p.scale_log2) * q_max * k_max < FA_MASK_BLOCK_SCORE_BOUND &&
      metal::abs(slope_log2) * (float(p.q_len) + float(p.kv_len) + metal::abs(float(p.diagonal))) <
          FA_MASK_BLOCK_SCORE_BOUND;
  return scores_finite ? FA_MASK_BLOCK_SKIP : FA_MASK_BLOCK_ADD;
}

#endif
