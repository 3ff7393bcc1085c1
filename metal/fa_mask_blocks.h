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
// slice is added as before. The backward's pass (FA_BACKWARD_* slots) also needs dS = P (dP - D)
// to be exactly 0 where P is: it poisons q's maximum where a row's D is not finite, and writes
// max |dO| per 8 rows and max |V| per 8 keys to bound dP = dO V^T the same way.
//
// Workspace layout (fa_params' mask_block_* fields): one byte per class, in (batch, head, row
// block, key block) order over the distinct blocks, then (at float offsets) the q and k maxima,
// and in the backward those of dO and V (fa_backward_params).
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

// The class of the distinct mask block `item` (in the workspace's order).
inline uchar fa_classify_mask_block(constant fa_params &p, const device uchar *mask, long item) {
  const int kb = int(item % p.mask_block_counts[3]);
  const int rb = int(item / p.mask_block_counts[3] % p.mask_block_counts[2]);
  const long h = item / (long(p.mask_block_counts[3]) * p.mask_block_counts[2]) % p.mask_block_counts[1];
  const long b = item / (long(p.mask_block_counts[3]) * p.mask_block_counts[2] * p.mask_block_counts[1]);
  const int row_count = p.mask_strides[2] == 0 ? 1 : metal::min(8, p.q_len - 8 * rb);
  const int key_count = p.mask_strides[3] == 0 ? 1 : metal::min(8, p.kv_len - 8 * kb);
  bool all_blocked = true, all_zero = true;
  const long base = b * p.mask_strides[0] + h * p.mask_strides[1] + long(8 * rb) * p.mask_strides[2] +
                    long(8 * kb) * p.mask_strides[3];
  for (int r = 0; r < row_count; ++r) {
    for (int c = 0; c < key_count; ++c) {
      const uint bits = metal::as_type<uint>(fa_mask_entry(mask, base + r * p.mask_strides[2] + c * p.mask_strides[3]));
      all_blocked = all_blocked && bits == 0xff800000u; // -inf
      all_zero = all_zero && (bits & 0x7fffffffu) == 0; // +0 or -0
    }
  }
  return all_blocked ? FA_MASK_BLOCK_SKIP : (all_zero ? FA_MASK_BLOCK_ZERO : FA_MASK_BLOCK_ADD);
}

// max |x| over the 8-row block `item` of a (B, heads, n, cols) operand ((batch, head, block) order).
template <typename T>
inline float fa_operand_block_max(const device T *x, constant fa_i64 *strides, int heads, int n, int cols, long item) {
  const int blocks = (n + 7) / 8;
  const int rb = int(item % blocks);
  const long h = item / blocks % heads, b = item / (long(blocks) * heads);
  return fa_block_max_abs(x + b * strides[0] + h * strides[1] + long(8 * rb) * strides[2], strides[2], strides[3],
                          metal::min(8, n - 8 * rb), cols);
}

inline long fa_mask_block_classes(constant fa_params &p) {
  return long(p.mask_block_counts[0]) * p.mask_block_counts[1] * p.mask_block_counts[2] * p.mask_block_counts[3];
}

// One thread per item: the mask's distinct blocks, then q's blocks of 8 rows, then k's of 8 keys.
template <typename T>
[[kernel, max_total_threads_per_threadgroup(FA_MASK_BLOCK_THREADS)]] void
fa_forward_mask_blocks(const device T *q [[buffer(FA_FORWARD_BUFFER_Q)]],
                       const device T *k [[buffer(FA_FORWARD_BUFFER_K)]],
                       device float *workspace [[buffer(FA_FORWARD_BUFFER_WORKSPACE)]],
                       constant fa_params &p [[buffer(FA_FORWARD_BUFFER_PARAMS)]],
                       const device uchar *mask [[buffer(FA_FORWARD_BUFFER_MASK)]],
                       uint3 group [[threadgroup_position_in_grid]],
                       uint tid [[thread_index_in_threadgroup]],
                       uint3 group_size [[threads_per_threadgroup]]) {
  long item = long(group.x) * group_size.x + tid;
  const long classes = fa_mask_block_classes(p);
  const long q_items = long(p.batch) * p.q_heads * ((p.q_len + 7) / 8);
  if (item < classes) {
    ((device uchar *)workspace)[item] = fa_classify_mask_block(p, mask, item);
  } else if ((item -= classes) < q_items) {
    workspace[p.q_block_max_offset + item] = fa_operand_block_max(q, p.q_strides, p.q_heads, p.q_len, p.head_dim, item);
  } else if ((item -= q_items) < long(p.batch) * p.kv_heads * ((p.kv_len + 7) / 8)) {
    workspace[p.k_block_max_offset + item] =
        fa_operand_block_max(k, p.k_strides, p.kv_heads, p.kv_len, p.head_dim, item);
  }
}

// The backward's: the same items, q's maximum +inf where a row's D is not finite, then dO's blocks
// of 8 rows and V's of 8 keys. Runs after the D pre-pass.
template <typename T>
[[kernel, max_total_threads_per_threadgroup(FA_MASK_BLOCK_THREADS)]] void
fa_backward_mask_blocks(const device T *q [[buffer(FA_BACKWARD_BUFFER_Q)]],
                        const device T *k [[buffer(FA_BACKWARD_BUFFER_K)]],
                        const device T *v [[buffer(FA_BACKWARD_BUFFER_V)]],
                        const device T *dout [[buffer(FA_BACKWARD_BUFFER_DOUT)]],
                        const device float *delta [[buffer(FA_BACKWARD_BUFFER_DELTA)]],
                        device float *workspace [[buffer(FA_BACKWARD_BUFFER_WORKSPACE)]],
                        constant fa_backward_params &bp [[buffer(FA_BACKWARD_BUFFER_PARAMS)]],
                        const device uchar *mask [[buffer(FA_BACKWARD_BUFFER_MASK)]],
                        uint3 group [[threadgroup_position_in_grid]],
                        uint tid [[thread_index_in_threadgroup]],
                        uint3 group_size [[threads_per_threadgroup]]) {
  constant fa_params &p = bp.forward;
  long item = long(group.x) * group_size.x + tid;
  const long classes = fa_mask_block_classes(p);
  const int q_blocks = (p.q_len + 7) / 8;
  const long q_items = long(p.batch) * p.q_heads * q_blocks;
  const long k_items = long(p.batch) * p.kv_heads * ((p.kv_len + 7) / 8);
  if (item < classes) {
    ((device uchar *)workspace)[item] = fa_classify_mask_block(p, mask, item);
  } else if ((item -= classes) < q_items) {
    const int rb = int(item % q_blocks);
    const long h = item / q_blocks % p.q_heads, b = item / (long(q_blocks) * p.q_heads);
    bool finite = true;
    for (int r = 8 * rb; r < metal::min(8 * rb + 8, p.q_len); ++r) {
      finite =
          finite && fa_bits_finite(delta[b * bp.delta_strides[0] + h * bp.delta_strides[1] + r * bp.delta_strides[2]]);
    }
    const float largest = fa_operand_block_max(q, p.q_strides, p.q_heads, p.q_len, p.head_dim, item);
    workspace[p.q_block_max_offset + item] = finite ? largest : INFINITY;
  } else if ((item -= q_items) < k_items) {
    workspace[p.k_block_max_offset + item] =
        fa_operand_block_max(k, p.k_strides, p.kv_heads, p.kv_len, p.head_dim, item);
  } else if ((item -= k_items) < q_items) {
    workspace[bp.do_block_max_offset + item] =
        fa_operand_block_max(dout, bp.do_strides, p.q_heads, p.q_len, p.v_head_dim, item);
  } else if ((item -= q_items) < k_items) {
    workspace[bp.v_block_max_offset + item] =
        fa_operand_block_max(v, p.v_strides, p.kv_heads, p.kv_len, p.v_head_dim, item);
  }
}

// The class of the region of rows [row0, row0 + rows) and keys [key0, key0 + keys) of (b, h)
// (row0 and key0 below L and S; rows past L and keys past S are not looked at): SKIP when every
// block it touches is SKIP and its scores are certainly finite (above), ZERO when every block is
// ZERO, ADD otherwise. slope_log2 is the (batch, head)'s ALiBi slope (0 without ALiBi). With
// dp_maxima (the backward), dO's and V's maxima at those float offsets must bound dP too.
inline int fa_mask_region_class(constant fa_params &p,
                                const device float *workspace,
                                long b,
                                long h,
                                long kv_h,
                                int row0,
                                int rows,
                                int key0,
                                int keys,
                                float slope_log2,
                                bool dp_maxima = false,
                                long do_offset = 0,
                                long v_offset = 0) {
  if (p.mask_block_counts[0] == 0) {
    return FA_MASK_BLOCK_ADD; // run without the classes (fa_forward.c, fa_backward.c)
  }
  const device uchar *classes = (const device uchar *)workspace;
  const int q_blocks = (p.q_len + 7) / 8, k_blocks = (p.kv_len + 7) / 8;
  const int rb0 = row0 / 8, rb1 = metal::min(row0 + rows - 1, p.q_len - 1) / 8;
  const int kb0 = key0 / 8, kb1 = metal::min(key0 + keys - 1, p.kv_len - 1) / 8;
  bool all_skip = true, all_zero = true;
  for (int rb = rb0; rb <= rb1; ++rb) {
    const long row_at = b * p.mask_block_strides[0] + h * p.mask_block_strides[1] + long(rb) * p.mask_block_strides[2];
    for (int kb = kb0; kb <= kb1; ++kb) {
      const uchar c = classes[row_at + long(kb) * p.mask_block_strides[3]];
      all_skip = all_skip && c == FA_MASK_BLOCK_SKIP;
      all_zero = all_zero && c == FA_MASK_BLOCK_ZERO;
    }
  }
  if (all_zero) {
    return FA_MASK_BLOCK_ZERO;
  }
  if (!all_skip) {
    return FA_MASK_BLOCK_ADD;
  }
  const long q_at = (b * p.q_heads + h) * q_blocks, k_at = (b * p.kv_heads + kv_h) * k_blocks;
  float q_max = 0.0f, k_max = 0.0f, do_max = 0.0f, v_max = 0.0f;
  for (int rb = rb0; rb <= rb1; ++rb) {
    q_max = metal::max(q_max, workspace[p.q_block_max_offset + q_at + rb]);
    do_max = dp_maxima ? metal::max(do_max, workspace[do_offset + q_at + rb]) : 0.0f;
  }
  for (int kb = kb0; kb <= kb1; ++kb) {
    k_max = metal::max(k_max, workspace[p.k_block_max_offset + k_at + kb]);
    v_max = dp_maxima ? metal::max(v_max, workspace[v_offset + k_at + kb]) : 0.0f;
  }
  // A non-finite maximum, or 0 times one, fails the comparisons (NaN compares false).
  const bool finite = float(p.head_dim) * metal::abs(p.scale_log2) * q_max * k_max < FA_MASK_BLOCK_SCORE_BOUND &&
                      metal::abs(slope_log2) * (float(p.q_len) + float(p.kv_len) + metal::abs(float(p.diagonal))) <
                          FA_MASK_BLOCK_SCORE_BOUND &&
                      (!dp_maxima || float(p.v_head_dim) * do_max * v_max < FA_MASK_BLOCK_SCORE_BOUND);
  return finite ? FA_MASK_BLOCK_SKIP : FA_MASK_BLOCK_ADD;
}

#endif
