// The backward pass on Metal 4's tensor operations: dK/dV and dQ as fa_backward_dkdv.h and
// fa_backward_dq.h compute them, every matrix product a MetalPerformancePrimitives matmul2d at
// SIMD-group scope (the neural accelerators on Apple10), shaped like the tensor forward
// (fa_forward_tensor.h). The delta pre-pass is the simdgroup one (fa_backward_delta.h): a row
// reduction, no product.
//
// A threadgroup of WM SIMD-groups owns BR = 16 WM rows (keys for dK/dV, query rows for dQ) of one
// (batch, head); each SIMD-group owns 16 of them. Their two resident operands (K and V, or Q and
// dO) go once through a threadgroup staging tile into cooperative left inputs of the score
// product; the other two (Q and dO, or K and V) stream through threadgroup tiles of 32 rows, read
// through the loaders of fa_loader.h (any strides, zeros past the valid rows and columns) and
// viewed as tensors. Scores, probabilities and score gradients live in cooperative tensors and are
// touched only through the API's element-to-coordinate mapping (is_valid_element,
// get_multidimensional_index): which lane holds which element differs between GPU generations.
// The two products that make a score tile and its dP tile run on the same matmul2d operation with
// operands of the same types, so their destinations are one type and hold the same elements in the
// same slots. P^T and dS^T (dS) become the next products' left inputs through
// get_left_input_cooperative_tensor, in float as the simdgroup kernels keep them (MPP takes float
// left operands with half or bfloat right ones). Per tile and SIMD-group:
//   dK/dV (16 keys, 32 queries of each query head of the kv head's group):
//     S^T = K Q^T, dP^T = V dO^T, P^T = exp(S^T ln 2 - lse), dS^T = P^T (dP^T - D),
//     dV += P^T dO, dK += dS^T Q  (dK scaled by the softmax scale at the end)
//   dQ (16 query rows, 32 keys):
//     S = Q K^T, dP = dO V^T, dS = P (dP - D), dQ += dS K  (scaled at the end)
// The accumulators leave through the staging tile, each element rounded once to T. Each SIMD-group
// sums only its own rows, in a fixed order: deterministic, no atomics.
//
// Template parameters (fa_plan_backward.c, "The tensor path"): T half or bfloat; BD the padded
// width of both head dims (E, Ev <= BD), the tensor forward's; WM SIMD-groups per threadgroup.
#ifndef FA_BACKWARD_TENSOR_H
#define FA_BACKWARD_TENSOR_H

#include <metal_stdlib>
#include "fa_loader.h"
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
struct fa_tensor_factor {
  float factor;
  float operator()(float value, int row, int col) const { return value * factor; }
};

// Writes one SIMD-group's accumulator (16 x W, its rows of a gradient) to `rows` valid rows of
// `cols` columns at dst through its 16 rows of the staging tile; the caller brackets it with
// threadgroup barriers when the tile held shared data.
template <typename T, typename C>
inline void fa_tensor_store_rows(thread const C &acc,
                                 threadgroup T *staging,
                                 int pitch,
                                 device T *dst,
                                 long row_stride,
                                 long col_stride,
                                 int rows,
                                 int cols,
                                 ushort lane) {
  acc.store(fa_matrix_tensor(staging, pitch, FA_TENSOR_ROWS, cols));
  simdgroup_barrier(mem_flags::mem_threadgroup);
  for (int i = int(lane); i < rows * cols; i += 32) {
    const int r = i / cols, c = i % cols;
    dst[long(r) * row_stride + long(c) * col_stride] = staging[r * pitch + c];
  }
}

template <typename T, int BD, int WM>
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
                        uint tid [[thread_index_in_threadgroup]],
                        ushort sg [[simdgroup_index_in_threadgroup]],
                        ushort lane [[thread_index_in_simdgroup]]) {
  constexpr int M = FA_TENSOR_ROWS, N = FA_TENSOR_BACKWARD_TILE, BR = M * WM, THREADS = 32 * WM;
  constexpr int PITCH = BD + FA_TILE_PAD;
  // One region: K's and V's staging tiles before the loop, the Q and dO tiles in it, the
  // accumulators' staging tiles after.
  constexpr int ELEMENTS = (BR > 2 * N ? BR : 2 * N) * PITCH;
  threadgroup fa_tile_storage<T> storage[fa_tile_vectors(ELEMENTS)];
  threadgroup float lse_tile[N];
  threadgroup float delta_tile[N];
  threadgroup T *tiles = (threadgroup T *)storage;
  threadgroup T *q_tile = tiles;
  threadgroup T *do_tile = tiles + N * PITCH;
  threadgroup T *mine = tiles + M * int(sg) * PITCH; // this SIMD-group's rows of a staging tile

  const fa_block_position block = fa_block_of(group, groups, false);
  const long b = block.batch;
  const long kv_h = block.head;
  constant fa_params &f = fa_sequence_params(p.forward, sequence_table, b);
  const int key_block = block.block * BR;
  if (fa_sequences && key_block >= f.kv_len) {
    return; // past this sequence's keys (the grid is sized for the longest)
  }
  k = fa_sequence_k(k, f, b, f.k_strides);
  v = fa_sequence_k(v, f, b, f.v_strides);
  dk = fa_sequence_k(dk, f, b, p.dk_strides);
  dv = fa_sequence_k(dv, f, b, p.dv_strides);
  q = fa_sequence_q(q, f, b, f.q_strides);
  dout = fa_sequence_q(dout, f, b, p.do_strides);
  lse = fa_sequence_q(lse, f, b, f.lse_strides);
  delta = fa_sequence_q(delta, f, b, p.delta_strides);
  const int key0 = key_block + M * int(sg); // the first of this SIMD-group's keys
  const int block_keys = min(BR, f.kv_len - key_block);

  fa_scores_matmul<M, N, BD> score_op; // S^T and dP^T: 16 keys x 32 queries over the head dim
  fa_simdgroup_matmul<M, BD, N, false, false, true> dv_op;
  fa_simdgroup_matmul<M, BD, N, false, false, true> dk_op;
  typedef decltype(fa_matrix_tensor(q_tile, PITCH, N, BD)) tile_tensor;

  // K and V through the staging tile into the score product's left inputs (zeros past E, Ev, S).
  const device T *k_rows = k + b * f.k_strides[0] + kv_h * f.k_strides[1] + long(key_block) * f.k_strides[2];
  const device T *v_rows = v + b * f.v_strides[0] + kv_h * f.v_strides[1] + long(key_block) * f.v_strides[2];
  fa_load_tile_strided<T, BR, BD, THREADS>(tiles, PITCH, k_rows, f.k_strides[2], f.k_strides[3], block_keys, f.head_dim,
                                           tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  auto k_in = score_op.template get_left_input_cooperative_tensor<T, T, float>();
  k_in.load(fa_matrix_tensor(mine, PITCH, M, BD));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  fa_load_tile_strided<T, BR, BD, THREADS>(tiles, PITCH, v_rows, f.v_strides[2], f.v_strides[3], block_keys,
                                           f.v_head_dim, tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  auto v_in = score_op.template get_left_input_cooperative_tensor<T, T, float>();
  v_in.load(fa_matrix_tensor(mine, PITCH, M, BD));
  typedef decltype(k_in) left_input;
  typedef decltype(dv_op.template get_left_input_cooperative_tensor<float, T, float>()) dv_left;
  typedef decltype(dk_op.template get_left_input_cooperative_tensor<float, T, float>()) dk_left;
  auto dv_acc = dv_op.template get_destination_cooperative_tensor<dv_left, tile_tensor, float>();
  auto dk_acc = dk_op.template get_destination_cooperative_tensor<dk_left, tile_tensor, float>();
  fa_tensor_zero(dv_acc);
  fa_tensor_zero(dk_acc);

  // Under the band only queries [begin, end) see a key of the block (of the SIMD-group: mine).
  const fa_range queries = fa_visible_queries(f, key_block, BR);
  const fa_range my_queries = fa_visible_queries(f, key0, M);
  const bool keys_valid = key0 < f.kv_len;
  for (long h = kv_h * f.gqa_factor; h < (kv_h + 1) * f.gqa_factor; ++h) {
    const device T *q_src = q + b * f.q_strides[0] + h * f.q_strides[1] + long(queries.begin) * f.q_strides[2];
    const device T *do_src = dout + b * p.do_strides[0] + h * p.do_strides[1] + long(queries.begin) * p.do_strides[2];
    const device float *lse_head = lse + b * f.lse_strides[0] + h * f.lse_strides[1];
    const device float *delta_head = delta + b * p.delta_strides[0] + h * p.delta_strides[1];
    const float slope_log2 = fa_alibi_slope(f, alibi_slopes, b, h);
    for (int q0 = queries.begin; q0 < queries.end;
         q0 += N, q_src += long(N) * f.q_strides[2], do_src += long(N) * p.do_strides[2]) {
      const int valid_rows = min(N, f.q_len - q0);
      threadgroup_barrier(mem_flags::mem_threadgroup); // the previous tiles (or the staging) are consumed
      fa_load_tile<T, N, BD, THREADS>(q_tile, PITCH, fa_rows(q_src, f.q_strides[2], f.q_strides[3]), valid_rows,
                                      f.head_dim, tid);
      fa_load_tile<T, N, BD, THREADS>(do_tile, PITCH, fa_rows(do_src, p.do_strides[2], p.do_strides[3]), valid_rows,
                                      f.v_head_dim, tid);
      if (tid < uint(N)) {
        const bool inside = int(tid) < valid_rows; // rows past L: probability 0 through lse = +inf
        lse_tile[tid] = inside ? lse_head[long(q0 + int(tid)) * f.lse_strides[2]] : INFINITY;
        delta_tile[tid] = inside ? delta_head[long(q0 + int(tid)) * p.delta_strides[2]] : 0.0f;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (!keys_valid || q0 >= my_queries.end || q0 + N <= my_queries.begin) {
        continue; // no key of this SIMD-group is seen by a query of the tile
      }
      tile_tensor q_view = fa_matrix_tensor(q_tile, PITCH, N, BD);
      tile_tensor do_view = fa_matrix_tensor(do_tile, PITCH, N, BD);
      auto st = score_op.template get_destination_cooperative_tensor<left_input, tile_tensor, float>();
      auto dpt = score_op.template get_destination_cooperative_tensor<left_input, tile_tensor, float>();
      score_op.run(k_in, q_view, st);
      score_op.run(v_in, do_view, dpt);
      // st becomes P^T and dpt dS^T, element by element (row: key, column: query).
      for (ushort i = 0; i < st.get_capacity(); ++i) {
        if (!st.is_valid_element(i)) {
          continue;
        }
        const auto at = st.get_multidimensional_index(i);
        const int col = int(at[0]);
        const fa_tensor_gradient g = fa_tensor_score_gradient(f, mask, b, h, slope_log2, q0 + col, key0 + int(at[1]),
                                                              st[i], dpt[i], lse_tile[col], delta_tile[col]);
        st[i] = g.prob;
        dpt[i] = g.ds;
      }
      tile_tensor dv_right = fa_matrix_tensor(do_tile, PITCH, N, BD);
      tile_tensor dk_right = fa_matrix_tensor(q_tile, PITCH, N, BD);
      auto pt = dv_op.template get_left_input_cooperative_tensor<float, T, float>(st);
      dv_op.run(pt, dv_right, dv_acc);
      auto dst = dk_op.template get_left_input_cooperative_tensor<float, T, float>(dpt);
      dk_op.run(dst, dk_right, dk_acc);
    }
  }

  threadgroup_barrier(mem_flags::mem_threadgroup); // every SIMD-group is done with the tiles
  if (keys_valid) {
    const int keys = min(M, f.kv_len - key0);
    fa_tensor_map(dk_acc, fa_tensor_factor{p.scale});
    fa_tensor_store_rows(dk_acc, mine, PITCH,
                         dk + b * p.dk_strides[0] + kv_h * p.dk_strides[1] + long(key0) * p.dk_strides[2],
                         p.dk_strides[2], p.dk_strides[3], keys, f.head_dim, lane);
    simdgroup_barrier(mem_flags::mem_threadgroup); // its rows of the staging tile are read
    fa_tensor_store_rows(dv_acc, mine, PITCH,
                         dv + b * p.dv_strides[0] + kv_h * p.dv_strides[1] + long(key0) * p.dv_strides[2],
                         p.dv_strides[2], p.dv_strides[3], keys, f.v_head_dim, lane);
  }
}

template <typename T, int BD, int WM>
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
                      uint tid [[thread_index_in_threadgroup]],
                      ushort sg [[simdgroup_index_in_threadgroup]],
                      ushort lane [[thread_index_in_simdgroup]]) {
  constexpr int M = FA_TENSOR_ROWS, N = FA_TENSOR_BACKWARD_TILE, BR = M * WM, THREADS = 32 * WM;
  constexpr int PITCH = BD + FA_TILE_PAD;
  // One region: Q's and dO's staging tiles before the loop, the K and V tiles in it, dQ's staging
  // tile after.
  constexpr int ELEMENTS = (BR > 2 * N ? BR : 2 * N) * PITCH;
  threadgroup fa_tile_storage<T> storage[fa_tile_vectors(ELEMENTS)];
  threadgroup float row_lse[BR];
  threadgroup float row_delta[BR];
  threadgroup T *tiles = (threadgroup T *)storage;
  threadgroup T *k_tile = tiles;
  threadgroup T *v_tile = tiles + N * PITCH;
  threadgroup T *mine = tiles + M * int(sg) * PITCH; // this SIMD-group's rows of a staging tile

  const fa_block_position block = fa_block_of(group, groups, true);
  const long b = block.batch;
  const long h = block.head;
  constant fa_params &f = fa_sequence_params(p.forward, sequence_table, b);
  const long kv_h = h / f.gqa_factor;
  const int q_block = block.block * BR;
  if (fa_sequences && q_block >= f.q_len) {
    return; // past this sequence's rows (the grid is sized for the longest)
  }
  q = fa_sequence_q(q, f, b, f.q_strides);
  dout = fa_sequence_q(dout, f, b, p.do_strides);
  lse = fa_sequence_q(lse, f, b, f.lse_strides);
  delta = fa_sequence_q(delta, f, b, p.delta_strides);
  dq = fa_sequence_q(dq, f, b, p.dq_strides); // K and V: through the forward's cursors (fa_kv_tiles)
  const int row0 = q_block + M * int(sg);     // the first of this SIMD-group's rows
  const int block_rows = min(BR, f.q_len - q_block);

  fa_scores_matmul<M, N, BD> score_op; // S and dP: 16 rows x 32 keys over the head dim
  fa_simdgroup_matmul<M, BD, N, false, false, true> dq_op;
  typedef decltype(fa_matrix_tensor(k_tile, PITCH, N, BD)) tile_tensor;

  // Q and dO through the staging tile into the score product's left inputs; lse and D per row
  // (rows past L: probability 0 through lse = +inf).
  const device T *q_rows = q + b * f.q_strides[0] + h * f.q_strides[1] + long(q_block) * f.q_strides[2];
  const device T *do_rows = dout + b * p.do_strides[0] + h * p.do_strides[1] + long(q_block) * p.do_strides[2];
  fa_load_tile_strided<T, BR, BD, THREADS>(tiles, PITCH, q_rows, f.q_strides[2], f.q_strides[3], block_rows, f.head_dim,
                                           tid);
  if (tid < uint(BR)) {
    const bool inside = int(tid) < block_rows;
    const long row = long(q_block + int(tid));
    row_lse[tid] = inside ? lse[b * f.lse_strides[0] + h * f.lse_strides[1] + row * f.lse_strides[2]] : INFINITY;
    row_delta[tid] = inside ? delta[b * p.delta_strides[0] + h * p.delta_strides[1] + row * p.delta_strides[2]] : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  auto q_in = score_op.template get_left_input_cooperative_tensor<T, T, float>();
  q_in.load(fa_matrix_tensor(mine, PITCH, M, BD));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  fa_load_tile_strided<T, BR, BD, THREADS>(tiles, PITCH, do_rows, p.do_strides[2], p.do_strides[3], block_rows,
                                           f.v_head_dim, tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  auto do_in = score_op.template get_left_input_cooperative_tensor<T, T, float>();
  do_in.load(fa_matrix_tensor(mine, PITCH, M, BD));
  typedef decltype(q_in) left_input;
  typedef decltype(dq_op.template get_left_input_cooperative_tensor<float, T, float>()) dq_left;
  auto dq_acc = dq_op.template get_destination_cooperative_tensor<dq_left, tile_tensor, float>();
  fa_tensor_zero(dq_acc);

  const threadgroup float *my_lse = row_lse + M * int(sg);
  const threadgroup float *my_delta = row_delta + M * int(sg);
  const float slope_log2 = fa_alibi_slope(f, alibi_slopes, b, h);
  const fa_range keys = fa_visible_keys(f, q_block, BR); // under the band; all S without one
  const fa_range my_keys = fa_visible_keys(f, row0, M);
  const bool rows_valid = row0 < f.q_len;
  fa_tile_rows<T> k_tiles = fa_kv_tiles(k, f, f.k_strides, (const device int *)nullptr, b, kv_h, keys.begin, N);
  fa_tile_rows<T> v_tiles = fa_kv_tiles(v, f, f.v_strides, (const device int *)nullptr, b, kv_h, keys.begin, N);
  for (int k0 = keys.begin; k0 < keys.end; k0 += N, fa_tile_advance(k_tiles), fa_tile_advance(v_tiles)) {
    const int valid_keys = min(N, f.kv_len - k0);
    threadgroup_barrier(mem_flags::mem_threadgroup); // the previous tiles (or the staging) are consumed
    fa_load_tile<T, N, BD, THREADS>(k_tile, PITCH, k_tiles, valid_keys, f.head_dim, tid);
    fa_load_tile<T, N, BD, THREADS>(v_tile, PITCH, v_tiles, valid_keys, f.v_head_dim, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (!rows_valid || k0 >= my_keys.end || k0 + N <= my_keys.begin) {
      continue; // no row of this SIMD-group sees a key of the tile
    }
    tile_tensor k_view = fa_matrix_tensor(k_tile, PITCH, N, BD);
    tile_tensor v_view = fa_matrix_tensor(v_tile, PITCH, N, BD);
    auto s = score_op.template get_destination_cooperative_tensor<left_input, tile_tensor, float>();
    auto dp = score_op.template get_destination_cooperative_tensor<left_input, tile_tensor, float>();
    score_op.run(q_in, k_view, s);
    score_op.run(do_in, v_view, dp);
    // s becomes dS, element by element (row: query row, column: key).
    for (ushort i = 0; i < s.get_capacity(); ++i) {
      if (!s.is_valid_element(i)) {
        continue;
      }
      const auto at = s.get_multidimensional_index(i);
      const int row = int(at[1]);
      s[i] = fa_tensor_score_gradient(f, mask, b, h, slope_log2, row0 + row, k0 + int(at[0]), s[i], dp[i], my_lse[row],
                                      my_delta[row])
                 .ds;
    }
    tile_tensor dq_right = fa_matrix_tensor(k_tile, PITCH, N, BD);
    auto ds = dq_op.template get_left_input_cooperative_tensor<float, T, float>(s);
    dq_op.run(ds, dq_right, dq_acc);
  }

  threadgroup_barrier(mem_flags::mem_threadgroup); // every SIMD-group is done with the tiles
  if (rows_valid) {
    fa_tensor_map(dq_acc, fa_tensor_factor{p.scale});
    fa_tensor_store_rows(dq_acc, mine, PITCH,
                         dq + b * p.dq_strides[0] + h * p.dq_strides[1] + long(row0) * p.dq_strides[2], p.dq_strides[2],
                         p.dq_strides[3], min(M, f.q_len - row0), f.head_dim, lane);
  }
}

#endif
