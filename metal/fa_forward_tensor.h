// The prefill forward on Metal 4 tensor operations (MPP's matmul2d: the neural accelerators of
// Apple10, the simdgroup units of Apple9): the FlashAttention-2 loop of fa_forward.h with its
// products on cooperative tensors and the softmax, masks and variants applied through the API's
// coordinate mapping (fa_tensor.h), never through a lane layout.
//
// A threadgroup of WM SIMD-groups owns BQ = 16 * WM query rows of one (batch, head); each
// SIMD-group owns 16 of them: their Q as the score product's cooperative left input (loaded once
// through a threadgroup staging tile) and their float output accumulator O (16 x BD). K and V
// stream through threadgroup tiles BK keys at a time, viewed as tensors. Per tile and SIMD-group:
//   S = Q K^T (16 x BK, float, cooperative), scaled into the base-2 domain, capped, biased (ALiBi)
//   and masked element by element by its (row, key); the rows' maxima and sums come from
//   reduce_rows and go through threadgroup memory (16 floats per statistic and SIMD-group), where
//   one lane per row updates the running state; P = exp2(S - max) becomes the left input of
//   O = O * rescale + P V (P rounded to T, as the simdgroup kernel's operand fragments).
// Statistics are float32 with fa_softmax.h's edge semantics (fully masked rows give zeros and
// lse -inf, NaN propagates); sinks fold in at the end, lse is written per row when asked.
//
// Template parameters (fa_plan_forward.c, "The tensor path"): T half or bfloat; BD the padded
// width of both head dims (E, Ev <= BD); BK keys per tile; WM SIMD-groups per threadgroup.
// What the planner routes elsewhere: fp32, head dims above 128, dropout, the probability pass.
#ifndef FA_FORWARD_TENSOR_H
#define FA_FORWARD_TENSOR_H

#include <metal_stdlib>
#include "fa_loader.h"
#include "fa_mask.h"
#include "fa_params.h"
#include "fa_quant.h"
#include "fa_schedule.h"
#include "fa_sequence.h"
#include "fa_softmax.h"
#include "fa_tensor.h"
#include "fa_variants.h"

using namespace metal;

// A score's way from Q K^T to the softmax: base 2, softcap, ALiBi, then the masks (keys past S, the
// band, a bool mask's excluded entries to -inf; an additive mask added). `check` is false for a
// tile every score of which is inside the bounds and the band with no mask present.
struct fa_tensor_scores {
  constant fa_params *p;
  const device uchar *mask;
  long b;
  long h;
  int row0; // the SIMD-group's first query row
  int k0;   // the tile's first key
  float slope_log2;
  bool check;
  float operator()(float score, int row, int col) const {
    const int query = row0 + row, key = k0 + col;
    float s = fa_softcap_score(*p, score * p->scale_log2) + fa_alibi_bias(*p, slope_log2, query, key);
    if (!check) {
      return s;
    }
    if (key >= p->kv_len || fa_band_hides(*p, query, key)) {
      return -INFINITY;
    }
    if (fa_mask_kind != FA_MASK_NONE && query < p->q_len) { // padding rows read no mask
      s = fa_mask_score(s, mask, fa_mask_offset(*p, b, h, query, key));
    }
    return s;
  }
};

// exp2(score - its row's running maximum): the unnormalised probabilities.
struct fa_tensor_weights {
  const threadgroup float *row_max;
  float operator()(float score, int row, int col) const { return fa_softmax_weight(score, row_max[row]); }
};

template <typename T, int BD, int BK, int WM>
[[kernel, max_total_threads_per_threadgroup(32 * WM)]] void
fa_forward_tensor(const device T *q [[buffer(FA_FORWARD_BUFFER_Q)]],
                  const device T *k [[buffer(FA_FORWARD_BUFFER_K)]],
                  const device T *v [[buffer(FA_FORWARD_BUFFER_V)]],
                  device T *out [[buffer(FA_FORWARD_BUFFER_OUT)]],
                  device float *lse [[buffer(FA_FORWARD_BUFFER_LSE)]],
                  constant fa_params &params [[buffer(FA_FORWARD_BUFFER_PARAMS)]],
                  const device uchar *mask [[buffer(FA_FORWARD_BUFFER_MASK)]],
                  const device float *alibi_slopes [[buffer(FA_FORWARD_BUFFER_ALIBI)]],
                  const device float *sinks [[buffer(FA_FORWARD_BUFFER_SINKS)]],
                  constant fa_params *sequence_table [[buffer(FA_FORWARD_BUFFER_SEQUENCES)]],
                  const device int *block_table [[buffer(FA_FORWARD_BUFFER_BLOCK_TABLE)]],
                  const device T *k_scales [[buffer(FA_FORWARD_BUFFER_K_SCALES)]],
                  const device T *k_biases [[buffer(FA_FORWARD_BUFFER_K_BIASES)]],
                  const device T *v_scales [[buffer(FA_FORWARD_BUFFER_V_SCALES)]],
                  const device T *v_biases [[buffer(FA_FORWARD_BUFFER_V_BIASES)]],
                  uint3 group [[threadgroup_position_in_grid]],
                  uint3 groups [[threadgroups_per_grid]],
                  uint tid [[thread_index_in_threadgroup]],
                  ushort sg [[simdgroup_index_in_threadgroup]],
                  ushort lane [[thread_index_in_simdgroup]]) {
  constexpr int M = FA_TENSOR_ROWS;
  constexpr int BQ = M * WM;
  constexpr int THREADS = 32 * WM;
  constexpr int PITCH = BD + FA_TILE_PAD;
  // One region: Q's staging tile before the loop, the K and V tiles in it, O's staging tile after.
  constexpr int KV_ELEMENTS = 2 * BK * PITCH;
  constexpr int ELEMENTS = BQ * PITCH > KV_ELEMENTS ? BQ * PITCH : KV_ELEMENTS;
  threadgroup fa_tile_storage<T> storage[fa_tile_vectors(ELEMENTS)];
  threadgroup float statistics[4 * BQ]; // per row: running max, running sum, this tile's value, rescale
  threadgroup T *tiles = (threadgroup T *)storage;
  threadgroup T *k_tile = tiles;
  threadgroup T *v_tile = tiles + BK * PITCH;
  threadgroup float *row_max = statistics + M * sg;
  threadgroup float *row_sum = row_max + BQ;
  threadgroup float *row_tile = row_sum + BQ;
  threadgroup float *row_rescale = row_tile + BQ;

  const fa_block_position block = fa_block_of(group, groups, true);
  const long b = block.batch;
  const long h = block.head;
  constant fa_params &p = fa_sequence_params(params, sequence_table, b);
  const long kv_h = h / p.gqa_factor;
  const int q_block = block.block * BQ;
  if (fa_sequences && q_block >= p.q_len) {
    return; // past this sequence's rows (the grid is sized for the longest)
  }
  q = fa_sequence_q(q, p, b, p.q_strides);
  out = fa_sequence_q(out, p, b, p.o_strides);
  lse = fa_sequence_q(lse, p, b, p.lse_strides);
  const int row0 = q_block + M * int(sg); // the first of this SIMD-group's rows

  fa_scores_matmul<M, BK, BD> qk;
  fa_simdgroup_matmul<M, BD, BK, false, false, true> pv;
  typedef decltype(fa_matrix_tensor(k_tile, PITCH, BK, BD)) tile_tensor;

  // Q through the staging tile into the score product's left input.
  fa_load_tile_strided<T, BQ, BD, THREADS>(tiles, PITCH,
                                           q + b * p.q_strides[0] + h * p.q_strides[1] + long(q_block) * p.q_strides[2],
                                           p.q_strides[2], p.q_strides[3], min(BQ, p.q_len - q_block), p.head_dim, tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  auto q_in = qk.template get_left_input_cooperative_tensor<T, T, float>();
  tile_tensor q_rows = fa_matrix_tensor(tiles + M * int(sg) * PITCH, PITCH, M, BD);
  q_in.load(q_rows);
  auto o_acc = pv.template get_destination_cooperative_tensor<decltype(q_in), tile_tensor, float>();
  for (uint16_t i = 0; i < o_acc.get_capacity(); ++i) {
    o_acc[i] = 0.0f;
  }
  if (lane < M) {
    row_max[lane] = -INFINITY;
    row_sum[lane] = 0.0f;
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);

  const float slope_log2 = fa_alibi_slope(p, alibi_slopes, b, h);
  const fa_range keys = fa_visible_keys(p, q_block, BQ);
  const fa_range my_keys = fa_visible_keys(p, row0, M);
  const bool rows_valid = row0 < p.q_len;
  fa_kv_source<T> k_tiles = fa_kv_source_of(k, k_scales, k_biases, fa_k_bits, p.k_group_shift, p, p.k_strides,
                                            p.k_scale_strides, p.k_bias_strides, block_table, b, kv_h, keys.begin, BK);
  fa_kv_source<T> v_tiles = fa_kv_source_of(v, v_scales, v_biases, fa_v_bits, p.v_group_shift, p, p.v_strides,
                                            p.v_scale_strides, p.v_bias_strides, block_table, b, kv_h, keys.begin, BK);

  for (int k0 = keys.begin; k0 < keys.end; k0 += BK, fa_tile_advance(k_tiles), fa_tile_advance(v_tiles)) {
    const int valid_keys = min(BK, p.kv_len - k0);
    threadgroup_barrier(mem_flags::mem_threadgroup); // the previous tiles (or Q's staging) are consumed
    fa_load_tile<T, BK, BD, THREADS>(k_tile, PITCH, k_tiles, valid_keys, p.head_dim, tid);
    fa_load_tile<T, BK, BD, THREADS>(v_tile, PITCH, v_tiles, valid_keys, p.v_head_dim, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (!rows_valid || k0 >= my_keys.end || k0 + BK <= my_keys.begin) {
      continue; // no row of this SIMD-group sees a key of the tile
    }
    tile_tensor k_view = fa_matrix_tensor(k_tile, PITCH, BK, BD);
    tile_tensor v_view = fa_matrix_tensor(v_tile, PITCH, BK, BD);

    auto scores = qk.template get_destination_cooperative_tensor<decltype(q_in), tile_tensor, float>();
    qk.run(q_in, k_view, scores);
    const bool inside_band = !fa_banded || (k0 + BK - 1 <= row0 + p.band_hi && k0 >= row0 + M - 1 + p.band_lo);
    const bool check = valid_keys < BK || !inside_band || fa_mask_kind != FA_MASK_NONE;
    fa_tensor_map(scores, fa_tensor_scores{&p, mask, b, h, row0, k0, slope_log2, check});

    // Online softmax: one lane per row moves the running state; every lane reads it by row.
    fa_tensor_row_max<decltype(q_in), tile_tensor>(qk, scores, row_tile);
    if (lane < M) {
      const float new_max = max(row_max[lane], row_tile[lane]);
      row_rescale[lane] = fa_softmax_rescale(row_max[lane], new_max);
      row_max[lane] = new_max;
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);
    fa_tensor_map(scores, fa_tensor_weights{row_max});
    fa_tensor_row_sum<decltype(q_in), tile_tensor>(qk, scores, row_tile);
    if (lane < M) {
      row_sum[lane] = row_sum[lane] * row_rescale[lane] + row_tile[lane];
    }

    // O = O * rescale + P V.
    fa_tensor_map(o_acc, fa_tensor_row_factor{row_rescale});
    auto probabilities = pv.template get_left_input_cooperative_tensor<T, T, float>(scores);
    pv.run(probabilities, v_view, o_acc);
  }

  // Each row's sink, 1 / sum and lse (one lane per row), then O normalised through its staging tile.
  simdgroup_barrier(mem_flags::mem_threadgroup);
  if (lane < M) {
    fa_online_softmax state = {row_max[lane], row_sum[lane]};
    const float sink_rescale = fa_sink_fold(p, sinks, h, state);
    row_rescale[lane] = fa_softmax_inverse_sum(state) * sink_rescale;
    if (fa_write_lse && row0 + int(lane) < p.q_len) {
      lse[b * p.lse_strides[0] + h * p.lse_strides[1] + long(row0 + int(lane)) * p.lse_strides[2]] =
          fa_softmax_lse(state);
    }
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  fa_tensor_map(o_acc, fa_tensor_row_factor{row_rescale});
  threadgroup_barrier(mem_flags::mem_threadgroup); // every SIMD-group is done with the K and V tiles
  threadgroup T *o_tile = tiles + M * int(sg) * PITCH;
  tile_tensor o_staged = fa_matrix_tensor(o_tile, PITCH, M, BD);
  o_acc.store(o_staged);
  simdgroup_barrier(mem_flags::mem_threadgroup);
  const int rows = min(M, p.q_len - row0);
  device T *o_rows = out + b * p.o_strides[0] + h * p.o_strides[1] + long(row0) * p.o_strides[2];
  for (int i = int(lane); i < rows * p.v_head_dim; i += 32) {
    const int r = i / p.v_head_dim, c = i % p.v_head_dim;
    o_rows[long(r) * p.o_strides[2] + long(c) * p.o_strides[3]] = o_tile[r * PITCH + c];
  }
}

#endif
