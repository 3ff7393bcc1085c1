// The backward pass on Metal 4's tensor operations: dK/dV and dQ as fa_backward_dkdv.h and
// fa_backward_dq.h compute them, with every matrix product a MetalPerformancePrimitives matmul2d
// at SIMD-group scope (the neural accelerators on Apple10). The delta pre-pass is the simdgroup
// one (fa_backward_delta.h): a row reduction, no product.
//
// Each SIMD-group owns FA_TENSOR_ROWS rows (keys for dK/dV, query rows for dQ) and reads its
// operands from device memory as tensors of unit innermost stride (the planner checks it); tensor
// extents end at the last valid row and column, so the products read zeros past them and stores
// never write there. Scores, probabilities and score gradients live in cooperative tensors and are
// touched only through the API's element-to-coordinate mapping (is_valid_element,
// get_multidimensional_index): which lane holds which element differs between GPU generations.
// The two products that make a score tile and its dP tile run on the same matmul2d operation, so
// their destinations hold the same elements in the same slots; P^T and dS^T (dS) become the next
// products' left inputs through get_left_input_cooperative_tensor, in float as the simdgroup
// kernels keep them.
//   dK/dV, per SIMD-group of 16 keys, per query tile of 32 rows of every query head of its group:
//     S^T = K Q^T, dP^T = V dO^T, P^T = exp(S^T ln 2 - lse), dS^T = P^T (dP^T - D),
//     dV += P^T dO, dK += dS^T Q  (dK scaled by the softmax scale when stored)
//   dQ, per SIMD-group of 16 query rows, per key tile of 32 keys:
//     S = Q K^T, dP = dO V^T, dS = P (dP - D), dQ += dS K
// Each SIMD-group writes only its own rows, summing in a fixed order: deterministic, no atomics.
// No collective crosses SIMD-groups, so a SIMD-group with nothing to do leaves at once.
#ifndef FA_BACKWARD_TENSOR_H
#define FA_BACKWARD_TENSOR_H

#include <metal_stdlib>
#include "fa_mask.h"
#include "fa_params.h"
#include "fa_schedule.h"
#include "fa_sequence.h"
#include "fa_softmax.h"
#include "fa_tensor.h"
#include "fa_variants.h"

using namespace metal;

// Queries (dK/dV) or keys (dQ) per score tile: the products' N.
constant constexpr int FA_TENSOR_BACKWARD_TILE = 32;

// `rows` rows of `cols` elements in device memory, `row_stride` elements apart (the planner checks
// that it fits an int and that the innermost stride is 1).
template <typename T>
inline auto fa_tensor_rows(T *base, long row_stride, int rows, int cols) {
  return fa_matrix_tensor(base, int(row_stride), rows, cols);
}

// One score's probability and score gradient, as the simdgroup kernels compute them per score:
// the raw product `dot` scaled to base 2, soft-capped, ALiBi and the additive mask added; zero
// outside the bounds, the band and a bool mask. `dp` is dO . v of the pair.
struct fa_tensor_gradient {
  float prob;
  float ds;
};

inline fa_tensor_gradient fa_tensor_score_gradient(constant fa_params &f,
                                                   const device uchar *mask,
                                                   long b,
                                                   long h,
                                                   float slope_log2,
                                                   int row,
                                                   int key,
                                                   float dot,
                                                   float dp,
                                                   float row_lse,
                                                   float row_delta) {
  if (row >= f.q_len || key >= f.kv_len || fa_band_hides(f, row, key)) {
    return {0.0f, 0.0f};
  }
  const long entry = fa_mask_kind == FA_MASK_NONE ? 0 : fa_mask_offset(f, b, h, row, key);
  if (fa_mask_excludes(mask, entry)) {
    return {0.0f, 0.0f};
  }
  const float capped = fa_softcap_score(f, dot * f.scale_log2);
  float score = capped + fa_alibi_bias(f, slope_log2, row, key);
  if (fa_mask_is_additive()) {
    score += fa_mask_addend(mask, entry);
  }
  const float prob = fa_softmax_probability(score, row_lse);
  return {prob, prob * (dp - row_delta) * fa_softcap_gradient(f, capped)};
}

// Zeroes every slot of a cooperative accumulator.
template <typename C>
inline void fa_tensor_zero(thread C &c) {
  for (ushort i = 0; i < c.get_capacity(); ++i) {
    c[i] = 0.0f;
  }
}

// Multiplies every element of a cooperative accumulator by `factor`.
template <typename C>
inline void fa_tensor_scale(thread C &c, float factor) {
  for (ushort i = 0; i < c.get_capacity(); ++i) {
    if (c.is_valid_element(i)) {
      c[i] *= factor;
    }
  }
}

// BD, BDV: the head dims rounded up to 16, at most 128 (the planner's rule).
template <typename T, int BD, int BDV, int WM>
[[kernel, max_total_threads_per_threadgroup(32 * WM)]] void
fa_backward_tensor_dkdv(const device T *q [[buffer(FA_BACKWARD_BUFFER_Q)]],
                        const device T *k [[buffer(FA_BACKWARD_BUFFER_K)]],
                        const device T *v [[buffer(FA_BACKWARD_BUFFER_V)]],
                        const device T *dout [[buffer(FA_BACKWARD_BUFFER_DOUT)]],
                        const device float *lse [[buffer(FA_BACKWARD_BUFFER_LSE)]],
                        const device float *delta [[buffer(FA_BACKWARD_BUFFER_DELTA)]],
                        device T *dk [[buffer(FA_BACKWARD_BUFFER_DK)]],
                        device T *dv [[buffer(FA_BACKWARD_BUFFER_DV)]],
                        constant fa_backward_params &p [[buffer(FA_BACKWARD_BUFFER_PARAMS)]],
                        const device uchar *mask [[buffer(FA_BACKWARD_BUFFER_MASK)]],
                        const device float *alibi_slopes [[buffer(FA_BACKWARD_BUFFER_ALIBI)]],
                        constant fa_params *sequence_table [[buffer(FA_BACKWARD_BUFFER_SEQUENCES)]],
                        uint3 group [[threadgroup_position_in_grid]],
                        uint3 groups [[threadgroups_per_grid]],
                        ushort sg [[simdgroup_index_in_threadgroup]]) {
  constexpr int M = FA_TENSOR_ROWS, N = FA_TENSOR_BACKWARD_TILE, BE = BD > BDV ? BD : BDV;
  const fa_block_position block = fa_block_of(group, groups, false);
  const long b = block.batch;
  const long kv_h = block.head;
  constant fa_params &f = fa_sequence_params(p.forward, sequence_table, b);
  const int key0 = block.block * M * WM + M * int(sg); // the first of this SIMD-group's keys
  if (key0 >= f.kv_len) {
    return;
  }
  const int keys = min(M, f.kv_len - key0);
  k = fa_sequence_k(k, f, b, f.k_strides);
  v = fa_sequence_k(v, f, b, f.v_strides);
  dk = fa_sequence_k(dk, f, b, p.dk_strides);
  dv = fa_sequence_k(dv, f, b, p.dv_strides);
  q = fa_sequence_q(q, f, b, f.q_strides);
  dout = fa_sequence_q(dout, f, b, p.do_strides);
  lse = fa_sequence_q(lse, f, b, f.lse_strides);
  delta = fa_sequence_q(delta, f, b, p.delta_strides);

  const auto k_rows = fa_tensor_rows(k + b * f.k_strides[0] + kv_h * f.k_strides[1] + long(key0) * f.k_strides[2],
                                     f.k_strides[2], keys, f.head_dim);
  const auto v_rows = fa_tensor_rows(v + b * f.v_strides[0] + kv_h * f.v_strides[1] + long(key0) * f.v_strides[2],
                                     f.v_strides[2], keys, f.v_head_dim);
  // S^T and dP^T: (M keys) x (N queries) over the head dim; P^T dO and dS^T Q accumulate.
  fa_scores_matmul<M, N, BE> score_op;
  fa_simdgroup_matmul<M, BDV, N, false, false, true> dv_op;
  fa_simdgroup_matmul<M, BD, N, false, false, true> dk_op;
  using rows_tensor = decltype(fa_tensor_rows(q, 0, 0, 0));
  using dv_left = decltype(dv_op.template get_left_input_cooperative_tensor<float, rows_tensor, float>());
  using dk_left = decltype(dk_op.template get_left_input_cooperative_tensor<float, rows_tensor, float>());
  auto dv_acc = dv_op.template get_destination_cooperative_tensor<dv_left, rows_tensor, float>();
  auto dk_acc = dk_op.template get_destination_cooperative_tensor<dk_left, rows_tensor, float>();
  fa_tensor_zero(dk_acc);
  fa_tensor_zero(dv_acc);

  const fa_range queries = fa_visible_queries(f, key0, keys); // under the band; all L without one
  for (long h = kv_h * f.gqa_factor; h < (kv_h + 1) * f.gqa_factor; ++h) {
    const device T *q_head = q + b * f.q_strides[0] + h * f.q_strides[1];
    const device T *do_head = dout + b * p.do_strides[0] + h * p.do_strides[1];
    const device float *lse_head = lse + b * f.lse_strides[0] + h * f.lse_strides[1];
    const device float *delta_head = delta + b * p.delta_strides[0] + h * p.delta_strides[1];
    const float slope_log2 = fa_alibi_slope(f, alibi_slopes, b, h);
    for (int q0 = queries.begin; q0 < queries.end; q0 += N) {
      const int rows = min(N, f.q_len - q0);
      const auto q_tile = fa_tensor_rows(q_head + long(q0) * f.q_strides[2], f.q_strides[2], rows, f.head_dim);
      const auto do_tile = fa_tensor_rows(do_head + long(q0) * p.do_strides[2], p.do_strides[2], rows, f.v_head_dim);
      auto st = score_op.template get_destination_cooperative_tensor<decltype(k_rows), decltype(q_tile), float>();
      auto dpt = score_op.template get_destination_cooperative_tensor<decltype(v_rows), decltype(do_tile), float>();
      score_op.run(k_rows, q_tile, st);
      score_op.run(v_rows, do_tile, dpt);
      // st becomes P^T and dpt dS^T, element by element (column: query, row: key).
      for (ushort i = 0; i < st.get_capacity(); ++i) {
        if (!st.is_valid_element(i)) {
          continue;
        }
        const auto at = st.get_multidimensional_index(i);
        const int row = q0 + int(at[0]);
        const bool inside = row < f.q_len;
        const fa_tensor_gradient g =
            fa_tensor_score_gradient(f, mask, b, h, slope_log2, row, key0 + int(at[1]), st[i], dpt[i],
                                     inside ? lse_head[long(row) * f.lse_strides[2]] : INFINITY,
                                     inside ? delta_head[long(row) * p.delta_strides[2]] : 0.0f);
        st[i] = g.prob;
        dpt[i] = g.ds;
      }
      auto pt = dv_op.template get_left_input_cooperative_tensor<float, decltype(do_tile), float>(st);
      dv_op.run(pt, do_tile, dv_acc);
      auto dst = dk_op.template get_left_input_cooperative_tensor<float, decltype(q_tile), float>(dpt);
      dk_op.run(dst, q_tile, dk_acc);
    }
  }

  fa_tensor_scale(dk_acc, p.scale);
  dk_acc.store(fa_tensor_rows(dk + b * p.dk_strides[0] + kv_h * p.dk_strides[1] + long(key0) * p.dk_strides[2],
                              p.dk_strides[2], keys, f.head_dim));
  dv_acc.store(fa_tensor_rows(dv + b * p.dv_strides[0] + kv_h * p.dv_strides[1] + long(key0) * p.dv_strides[2],
                              p.dv_strides[2], keys, f.v_head_dim));
}

template <typename T, int BD, int BDV, int WM>
[[kernel, max_total_threads_per_threadgroup(32 * WM)]] void
fa_backward_tensor_dq(const device T *q [[buffer(FA_BACKWARD_BUFFER_Q)]],
                      const device T *k [[buffer(FA_BACKWARD_BUFFER_K)]],
                      const device T *v [[buffer(FA_BACKWARD_BUFFER_V)]],
                      const device T *dout [[buffer(FA_BACKWARD_BUFFER_DOUT)]],
                      const device float *lse [[buffer(FA_BACKWARD_BUFFER_LSE)]],
                      const device float *delta [[buffer(FA_BACKWARD_BUFFER_DELTA)]],
                      device T *dq [[buffer(FA_BACKWARD_BUFFER_DQ)]],
                      constant fa_backward_params &p [[buffer(FA_BACKWARD_BUFFER_PARAMS)]],
                      const device uchar *mask [[buffer(FA_BACKWARD_BUFFER_MASK)]],
                      const device float *alibi_slopes [[buffer(FA_BACKWARD_BUFFER_ALIBI)]],
                      constant fa_params *sequence_table [[buffer(FA_BACKWARD_BUFFER_SEQUENCES)]],
                      uint3 group [[threadgroup_position_in_grid]],
                      uint3 groups [[threadgroups_per_grid]],
                      ushort sg [[simdgroup_index_in_threadgroup]]) {
  constexpr int M = FA_TENSOR_ROWS, N = FA_TENSOR_BACKWARD_TILE, BE = BD > BDV ? BD : BDV;
  const fa_block_position block = fa_block_of(group, groups, true);
  const long b = block.batch;
  const long h = block.head;
  constant fa_params &f = fa_sequence_params(p.forward, sequence_table, b);
  const long kv_h = h / f.gqa_factor;
  const int row0 = block.block * M * WM + M * int(sg); // the first of this SIMD-group's rows
  if (row0 >= f.q_len) {
    return;
  }
  const int rows = min(M, f.q_len - row0);
  q = fa_sequence_q(q, f, b, f.q_strides);
  dout = fa_sequence_q(dout, f, b, p.do_strides);
  lse = fa_sequence_q(lse, f, b, f.lse_strides);
  delta = fa_sequence_q(delta, f, b, p.delta_strides);
  dq = fa_sequence_q(dq, f, b, p.dq_strides);
  k = fa_sequence_k(k, f, b, f.k_strides);
  v = fa_sequence_k(v, f, b, f.v_strides);

  const auto q_rows = fa_tensor_rows(q + b * f.q_strides[0] + h * f.q_strides[1] + long(row0) * f.q_strides[2],
                                     f.q_strides[2], rows, f.head_dim);
  const auto do_rows = fa_tensor_rows(dout + b * p.do_strides[0] + h * p.do_strides[1] + long(row0) * p.do_strides[2],
                                      p.do_strides[2], rows, f.v_head_dim);
  // S and dP: (M rows) x (N keys) over the head dim; dS K accumulates.
  fa_scores_matmul<M, N, BE> score_op;
  fa_simdgroup_matmul<M, BD, N, false, false, true> dq_op;
  using rows_tensor = decltype(fa_tensor_rows(k, 0, 0, 0));
  using dq_left = decltype(dq_op.template get_left_input_cooperative_tensor<float, rows_tensor, float>());
  auto dq_acc = dq_op.template get_destination_cooperative_tensor<dq_left, rows_tensor, float>();
  fa_tensor_zero(dq_acc);

  const device float *lse_head = lse + b * f.lse_strides[0] + h * f.lse_strides[1];
  const device float *delta_head = delta + b * p.delta_strides[0] + h * p.delta_strides[1];
  const device T *k_head = k + b * f.k_strides[0] + kv_h * f.k_strides[1];
  const device T *v_head = v + b * f.v_strides[0] + kv_h * f.v_strides[1];
  const float slope_log2 = fa_alibi_slope(f, alibi_slopes, b, h);
  const fa_range keys = fa_visible_keys(f, row0, rows); // under the band; all S without one
  for (int k0 = keys.begin; k0 < keys.end; k0 += N) {
    const int valid = min(N, f.kv_len - k0);
    const auto k_tile = fa_tensor_rows(k_head + long(k0) * f.k_strides[2], f.k_strides[2], valid, f.head_dim);
    const auto v_tile = fa_tensor_rows(v_head + long(k0) * f.v_strides[2], f.v_strides[2], valid, f.v_head_dim);
    auto s = score_op.template get_destination_cooperative_tensor<decltype(q_rows), decltype(k_tile), float>();
    auto dp = score_op.template get_destination_cooperative_tensor<decltype(do_rows), decltype(v_tile), float>();
    score_op.run(q_rows, k_tile, s);
    score_op.run(do_rows, v_tile, dp);
    // s becomes dS, element by element (column: key, row: query row).
    for (ushort i = 0; i < s.get_capacity(); ++i) {
      if (!s.is_valid_element(i)) {
        continue;
      }
      const auto at = s.get_multidimensional_index(i);
      const int row = row0 + int(at[1]);
      const bool inside = row < f.q_len;
      s[i] = fa_tensor_score_gradient(f, mask, b, h, slope_log2, row, k0 + int(at[0]), s[i], dp[i],
                                      inside ? lse_head[long(row) * f.lse_strides[2]] : INFINITY,
                                      inside ? delta_head[long(row) * p.delta_strides[2]] : 0.0f)
                 .ds;
    }
    auto ds = dq_op.template get_left_input_cooperative_tensor<float, decltype(k_tile), float>(s);
    dq_op.run(ds, k_tile, dq_acc);
  }

  fa_tensor_scale(dq_acc, p.scale);
  dq_acc.store(fa_tensor_rows(dq + b * p.dq_strides[0] + h * p.dq_strides[1] + long(row0) * p.dq_strides[2],
                              p.dq_strides[2], rows, f.head_dim));
}

#endif
