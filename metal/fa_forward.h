// The FlashAttention-2 forward body on simdgroup_matrix fragments.
//
// A threadgroup of WM SIMD-groups owns BQ = 8 * WM query rows of one (batch, head); each SIMD-group
// owns 8 of them and keeps their Q fragments (operand fragments, half for half inputs:
// fa_fragments.h) and their float output accumulator in registers. K and V stream through
// threadgroup memory BK keys at a time; the score tile S = Q K^T * scale * log2(e) (8 x BK per
// SIMD-group, float) lives and dies in registers; softmax is online in base 2 with float32
// statistics; O is normalised and written once.
//
// Template parameters (the planner picks them per head dim and dtype, see fa_plan_forward.c):
//   T    element type of q, k, v, out       BD, BDV  widths of the head dims' tiles (multiples of 8)
//   BK   keys per tile                      WM       SIMD-groups per threadgroup
// E above BD streams Q and K through the tiles in BD-wide blocks per key tile; Ev above BDV splits
// the output into BDV-wide column blocks, one per threadgroup (fa_head_blocks.h).
#ifndef FA_FORWARD_H
#define FA_FORWARD_H

#include <metal_stdlib>
#include "fa_dropout.h"
#include "fa_fragments.h"
#include "fa_head_blocks.h"
#include "fa_loader.h"
#include "fa_mask.h"
#include "fa_params.h"
#include "fa_quant.h"
#include "fa_schedule.h"
#include "fa_sequence.h"
#include "fa_softmax.h"
#include "fa_variants.h"

using namespace metal;

template <typename T, int BD, int BDV, int BK, int WM>
[[kernel, max_total_threads_per_threadgroup(32 * WM)]] void
fa_forward(const device T *q [[buffer(FA_FORWARD_BUFFER_Q)]],
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
           const device uint *rng [[buffer(FA_FORWARD_BUFFER_RNG)]],
           const device T *k_scales [[buffer(FA_FORWARD_BUFFER_K_SCALES)]],
           const device T *k_biases [[buffer(FA_FORWARD_BUFFER_K_BIASES)]],
           const device T *v_scales [[buffer(FA_FORWARD_BUFFER_V_SCALES)]],
           const device T *v_biases [[buffer(FA_FORWARD_BUFFER_V_BIASES)]],
           const device float *mask_blocks [[buffer(FA_FORWARD_BUFFER_WORKSPACE)]],
           uint3 group [[threadgroup_position_in_grid]],
           uint3 groups [[threadgroups_per_grid]],
           uint tid [[thread_index_in_threadgroup]],
           ushort sg [[simdgroup_index_in_threadgroup]],
           ushort lane [[thread_index_in_simdgroup]]) {
  constexpr int BQ = 8 * WM;
  constexpr int K_PITCH = BD + FA_TILE_PAD;
  constexpr int V_PITCH = BDV + FA_TILE_PAD;
  threadgroup fa_tile_storage<T> k_storage[fa_tile_vectors(BK * K_PITCH)];
  threadgroup fa_tile_storage<T> v_storage[fa_tile_vectors(BK * V_PITCH)];
  threadgroup bool tile_votes[2 * WM];
  threadgroup T *k_tile = (threadgroup T *)k_storage;
  threadgroup T *v_tile = (threadgroup T *)v_storage;

  const fa_block_position block = fa_block_of(group, groups, true);
  const long b = block.batch;
  const fa_column_block columns =
      fa_column_block_of(block.head, fa_head_blocks(fa_head_dim<BDV>(params.v_head_dim), BDV));
  const long h = columns.head;
  const int col0 = columns.block * BDV; // the first of this threadgroup's output columns
  constant fa_params &p = fa_sequence_params(params, sequence_table, b);
  const long kv_h = h / p.gqa_factor;
  const int q_block = block.block * BQ;
  if (fa_sequences && q_block >= p.q_len) {
    return; // past this sequence's rows (the grid is sized for the longest)
  }
  q = fa_sequence_q(q, p, b, p.q_strides);
  out = fa_sequence_q(out, p, b, p.o_strides);
  lse = fa_sequence_q(lse, p, b, p.lse_strides);
  const int row0 = q_block + 8 * int(sg); // first of this SIMD-group's 8 rows
  const ushort2 at = fa_frag_coord(lane);
  const int my_row = row0 + at.y; // the one row whose elements this lane holds
  const bool row_valid = my_row < p.q_len;
  const int head_dim = fa_head_dim<BD>(p.head_dim);
  const int ev_cols = fa_head_dim<BDV>(p.v_head_dim) - col0;
  const int ev_slices = fa_slices(ev_cols);

  // Q fragments straight from device memory (each SIMD-group reads only its own rows), as operand
  // fragments (fa_fragments.h): exact copies of the input, so the scores are scaled into the base-2
  // domain after each product instead. Streamed, they hold one block at a time.
  fa_operand_frag<T> q_frag[BD / 8];
  const device T *q_row = q + b * p.q_strides[0] + h * p.q_strides[1] + long(my_row) * p.q_strides[2];
  fa_load_resident_row<T, BD / 8>(q_frag, q_row, p.q_strides[3], row_valid, head_dim, at);

  fa_frag o_frag[BDV / 8];
  for (int d = 0; d < BDV / 8; ++d) {
    fa_frag_fill(o_frag[d], 0.0f);
  }
  fa_online_softmax row_state = fa_softmax_init();
  const float slope_log2 = fa_alibi_slope(p, alibi_slopes, b, h);
  const fa_dropout_rng dropout = fa_dropout_state(rng);

  // Under the band (causal, window) the rows of this block see only keys [begin, end): tiles
  // outside are never loaded. K/V tiles advance through their cursors (pointer steps, or pages of
  // a paged cache: fa_loader.h; quantized K/V dequantize as they load: fa_quant.h); the lane's mask
  // entries by one offset per tile (fa_mask.h).
  const fa_range keys = fa_visible_keys(p, q_block, BQ);
  fa_kv_source<T> k_tiles = fa_kv_source_of(k, k_scales, k_biases, fa_k_bits, p.k_group_shift, p, p.k_strides,
                                            p.k_scale_strides, p.k_bias_strides, block_table, b, kv_h, keys.begin, BK);
  fa_kv_source<T> v_tiles =
      fa_tile_columns(fa_kv_source_of(v, v_scales, v_biases, fa_v_bits, p.v_group_shift, p, p.v_strides,
                                      p.v_scale_strides, p.v_bias_strides, block_table, b, kv_h, keys.begin, BK),
                      col0);
  const long mask_key_stride = p.mask_strides[3];
  long mask_at = fa_mask_kind == FA_MASK_NONE ? 0 : fa_mask_offset(p, b, h, my_row, keys.begin + at.x);

  for (int k0 = keys.begin, tile = 0; k0 < keys.end;
       k0 += BK, ++tile, fa_tile_advance(k_tiles), fa_tile_advance(v_tiles), mask_at += BK * mask_key_stride) {
    const int valid_keys = min(BK, p.kv_len - k0);
    int bounds_class = fa_query_tile_class(p, row0, k0, BK);
    // The additive mask's class for the slice (fa_mask_blocks.h): SKIP blocks it, ZERO adds nothing.
    int mask_class = FA_MASK_BLOCK_ADD;
    if (fa_mask_blocks && bounds_class != FA_TILE_BLOCKED) {
      mask_class = fa_mask_region_class(p, mask_blocks, b, h, kv_h, row0, 8, k0, BK, slope_log2);
      bounds_class = mask_class == FA_MASK_BLOCK_SKIP ? int(FA_TILE_BLOCKED) : bounds_class;
    }
    const bool slice_adds = fa_mask_is_additive() && mask_class == FA_MASK_BLOCK_ADD;
    const fa_tile_start start = fa_start_tile<BK / 8, WM>(bounds_class, mask, mask_at, mask_key_stride, valid_keys,
                                                          row_valid, tile_votes, tile, sg, lane, at);
    if (!start.load) {
      continue; // no SIMD-group needs this tile: not even loaded
    }
    fa_load_resident_tile<T, BK, BD, 32 * WM>(k_tile, k_tiles, valid_keys, head_dim, tid);
    fa_load_tile<T, BK, BDV, 32 * WM>(v_tile, V_PITCH, v_tiles, valid_keys, min(ev_cols, BDV), tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // S = Q K^T for this SIMD-group's 8 rows and the tile's BK keys.
    const bool blocked = start.tile_class == FA_TILE_BLOCKED; // every score of the slice is masked
    fa_frag s_frag[BK / 8];
    for (int j = 0; j < BK / 8; ++j) {
      fa_frag_fill(s_frag[j], 0.0f);
    }
    fa_frags_multiply_head<T, BD, BK / 8, 32 * WM>(s_frag, q_frag, q_row, p.q_strides[3], row_valid, k_tile, k_tiles,
                                                   valid_keys, head_dim, !blocked, tid, at);
    if (blocked) {
      continue; // it adds nothing
    }
    fa_frags_scale<BK / 8>(s_frag, p.scale_log2);
    fa_variant_frags<BK / 8>(p, s_frag, slope_log2, my_row, k0 + at.x);

    // Per-score masking: bounds and the band in MIXED tiles, a bool mask's bits unless the
    // slice is wholly kept, an additive mask wherever its slice adds (padding rows read nothing).
    const bool add_mask = slice_adds && row_valid;
    if (start.tile_class == FA_TILE_MIXED || slice_adds) { // uniform over the SIMD-group: simd_any below
      long entry = mask_at;
      for (int j = 0; j < BK / 8; ++j) {
        for (int e = 0; e < 2; ++e) {
          const int key = k0 + 8 * j + at.x + e;
          const float score = s_frag[j].thread_elements()[e]; // (no references to vector elements in MSL)
          if (fa_mixed_tile_hides(p, start, my_row, key, 2 * j + e)) {
            s_frag[j].thread_elements()[e] = -INFINITY;
          } else if (add_mask) {
            s_frag[j].thread_elements()[e] = score + fa_mask_addend(mask, entry + (e == 0 ? 0 : mask_key_stride));
          }
        }
        entry += 8 * mask_key_stride;
      }

      // A slice masked out for all 8 rows adds nothing: skip its softmax and P V (NaN is not -inf,
      // so a NaN score keeps its tile).
      bool any_visible = false;
      for (int j = 0; j < BK / 8; ++j) {
        any_visible |= s_frag[j].thread_elements()[0] != -INFINITY || s_frag[j].thread_elements()[1] != -INFINITY;
      }
      if (!simd_any(any_visible)) {
        continue;
      }
    }

    // Online softmax over the tile, one row per lane (shared with three other lanes).
    float tile_max = -INFINITY;
    for (int j = 0; j < BK / 8; ++j) {
      tile_max = max(tile_max, max(s_frag[j].thread_elements()[0], s_frag[j].thread_elements()[1]));
    }
    tile_max = fa_row_max(tile_max);
    const float new_max = max(row_state.max, tile_max);
    const float rescale = fa_softmax_rescale(row_state.max, new_max);
    float tile_sum = 0.0f;
    for (int j = 0; j < BK / 8; ++j) {
      for (int e = 0; e < 2; ++e) {
        const float weight = fa_softmax_weight(s_frag[j].thread_elements()[e], new_max);
        s_frag[j].thread_elements()[e] = weight;
        tile_sum += weight;
      }
    }
    row_state.sum = row_state.sum * rescale + fa_row_sum(tile_sum);
    row_state.max = new_max;
    fa_dropout_frags<BK / 8>(p, dropout, s_frag, b, h, my_row, k0 + at.x); // after the undropped sum

    // O = O * rescale + P V. Once the running maxima settle most tiles raise no row's max: the
    // SIMD-group then skips the multiplies by 1 (uniform branch; a NaN factor is not 1 and is applied).
    if (simd_any(rescale != 1.0f)) {
      for (int d = 0; d < BDV / 8; ++d) {
        o_frag[d].thread_elements()[0] *= rescale;
        o_frag[d].thread_elements()[1] *= rescale;
      }
    }
    fa_frags_multiply<T, BK / 8, BDV / 8>(o_frag, s_frag, v_tile, V_PITCH, ev_slices, at);
  }

  if (!row_valid) {
    return; // padding rows of the last block: computed alongside, never stored
  }
  const float sink_rescale = fa_sink_fold(p, sinks, h, row_state); // every column block folds the same sink
  fa_frags_store_row<T, BDV / 8>(o_frag,
                                 out + b * p.o_strides[0] + h * p.o_strides[1] + long(my_row) * p.o_strides[2] +
                                     long(col0) * p.o_strides[3],
                                 p.o_strides[3], ev_cols, fa_softmax_inverse_sum(row_state) * sink_rescale, at);
  if (fa_write_lse && at.x == 0 && columns.block == 0) { // one lane of the four that share the row
    lse[b * p.lse_strides[0] + h * p.lse_strides[1] + long(my_row) * p.lse_strides[2]] = fa_softmax_lse(row_state);
  }
}

#endif
