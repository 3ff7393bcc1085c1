// The backward pass, query side: dQ = scale * dS K, parallel over query blocks.
//
// Shaped like the forward (fa_forward.h): a threadgroup of WM SIMD-groups owns BQ = 8 * WM query
// rows of one (batch, head), each SIMD-group 8 of them; K and V stream through threadgroup memory
// BK keys at a time (the forward's tiles). Per tile, in registers:
//   S  = Q K^T            (times scale * log2(e), as in the forward)
//   P  = exp(S ln(2) - lse)  recomputed from the forward's log-sum-exp, never stored (fa_softmax.h)
//   dP = dO V^T
//   dS = P (dP - D)       D = rowsum(dO * O) from the pre-pass (fa_backward_delta.h); under
//                         dropout dP is dO V^T times each element's factor (fa_dropout.h)
//   dQ += dS K
// Each threadgroup writes only its own rows of dQ: no atomics. Head dims above the tiles' widths
// (fa_head_blocks.h): E above BD streams Q and K in blocks for S and gives each threadgroup one
// BD-wide column block of dQ; Ev above BDV streams dO and V in blocks for dP.
#ifndef FA_BACKWARD_DQ_H
#define FA_BACKWARD_DQ_H

#include <metal_stdlib>
#include "fa_dropout.h"
#include "fa_fragments.h"
#include "fa_head_blocks.h"
#include "fa_loader.h"
#include "fa_mask.h"
#include "fa_params.h"
#include "fa_schedule.h"
#include "fa_sequence.h"
#include "fa_softmax.h"
#include "fa_variants.h"

using namespace metal;

template <typename T, int BD, int BDV, int BK, int WM>
[[kernel, max_total_threads_per_threadgroup(32 * WM)]] void
fa_backward_dq(const device T *q [[buffer(FA_BACKWARD_BUFFER_Q)]],
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
               const device uint *rng [[buffer(FA_BACKWARD_BUFFER_RNG)]],
               const device float *mask_blocks [[buffer(FA_BACKWARD_BUFFER_WORKSPACE)]],
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
  const int head_dim = fa_head_dim<BD>(p.forward.head_dim); // every sequence's too
  const int v_head_dim = fa_head_dim<BDV>(p.forward.v_head_dim);
  const int e_blocks = fa_head_blocks(head_dim, BD);
  const fa_column_block columns = fa_column_block_of(block.head, e_blocks);
  const long h = columns.head;
  const int col0 = columns.block * BD; // the first of this threadgroup's dQ columns
  constant fa_params &f = fa_sequence_params(p.forward, sequence_table, b);
  const long kv_h = h / f.gqa_factor;
  const int q_block = block.block * BQ;
  if (fa_sequences && q_block >= f.q_len) {
    return; // past this sequence's rows (the grid is sized for the longest)
  }
  q = fa_sequence_q(q, f, b, f.q_strides);
  dout = fa_sequence_q(dout, f, b, p.do_strides);
  lse = fa_sequence_q(lse, f, b, f.lse_strides);
  delta = fa_sequence_q(delta, f, b, p.delta_strides);
  dq = fa_sequence_q(dq, f, b, p.dq_strides);
  const int row0 = q_block + 8 * int(sg);
  const ushort2 at = fa_frag_coord(lane);
  const int my_row = row0 + at.y;
  const bool row_valid = my_row < f.q_len;

  // Resident operands load once; streamed ones block by block in the tile loop.
  fa_operand_frag<T> q_frag[BD / 8];
  const device T *q_row = q + b * f.q_strides[0] + h * f.q_strides[1] + long(my_row) * f.q_strides[2];
  fa_operand_frag<T> do_frag[BDV / 8];
  const device T *do_row = dout + b * p.do_strides[0] + h * p.do_strides[1] + long(my_row) * p.do_strides[2];
  fa_load_resident_row<T, BD / 8>(q_frag, q_row, f.q_strides[3], row_valid, head_dim, at);
  fa_load_resident_row<T, BDV / 8>(do_frag, do_row, p.do_strides[3], row_valid, v_head_dim, at);
  fa_frag dq_frag[BD / 8];
  for (int d = 0; d < BD / 8; ++d) {
    fa_frag_fill(dq_frag[d], 0.0f);
  }
  // Padding rows (past L) get probability 0 through lse = +inf.
  const float row_lse =
      row_valid ? lse[b * f.lse_strides[0] + h * f.lse_strides[1] + long(my_row) * f.lse_strides[2]] : INFINITY;
  const float slope_log2 = fa_alibi_slope(f, alibi_slopes, b, h);
  const fa_dropout_rng dropout = fa_dropout_state(rng);
  const float row_delta =
      row_valid ? delta[b * p.delta_strides[0] + h * p.delta_strides[1] + long(my_row) * p.delta_strides[2]] : 0.0f;

  // Tiles outside the band of the block's rows are never loaded; K/V tiles walk through the
  // forward's cursors (fa_loader.h). No block table: the backward never reads a paged cache
  // (fa_plan_backward.c refuses one), so FA_FC_PAGED is off here.
  const fa_range keys = fa_visible_keys(f, q_block, BQ);
  fa_tile_rows<T> k_tiles = fa_kv_tiles(k, f, f.k_strides, (const device int *)nullptr, b, kv_h, keys.begin, BK);
  fa_tile_rows<T> v_tiles = fa_kv_tiles(v, f, f.v_strides, (const device int *)nullptr, b, kv_h, keys.begin, BK);
  const long mask_key_stride = f.mask_strides[3];
  long mask_at = fa_mask_kind == FA_MASK_NONE ? 0 : fa_mask_offset(f, b, h, my_row, keys.begin + at.x);

  for (int k0 = keys.begin, tile = 0; k0 < keys.end;
       k0 += BK, ++tile, fa_tile_advance(k_tiles), fa_tile_advance(v_tiles), mask_at += BK * mask_key_stride) {
    const int valid_keys = min(BK, f.kv_len - k0);
    int bounds_class = fa_query_tile_class(f, row0, k0, BK);
    // The additive mask's class for the slice (fa_mask_blocks.h): SKIP blocks it, ZERO adds nothing.
    int mask_class = FA_MASK_BLOCK_ADD;
    if (fa_mask_blocks && bounds_class != FA_TILE_BLOCKED) {
      mask_class = fa_mask_region_class(f, mask_blocks, b, h, kv_h, row0, 8, k0, BK, slope_log2, true,
                                        p.do_block_max_offset, p.v_block_max_offset);
      bounds_class = mask_class == FA_MASK_BLOCK_SKIP ? int(FA_TILE_BLOCKED) : bounds_class;
    }
    const bool slice_adds = fa_mask_is_additive() && mask_class == FA_MASK_BLOCK_ADD;
    const fa_tile_start start = fa_start_tile<BK / 8, WM>(bounds_class, mask, mask_at, mask_key_stride, valid_keys,
                                                          row_valid, tile_votes, tile, sg, lane, at);
    if (!start.load) {
      continue; // no SIMD-group needs this tile: not even loaded
    }
    fa_load_resident_tile<T, BK, BD, 32 * WM>(k_tile, k_tiles, valid_keys, head_dim, tid);
    fa_load_resident_tile<T, BK, BDV, 32 * WM>(v_tile, v_tiles, valid_keys, v_head_dim, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);

    const bool blocked = start.tile_class == FA_TILE_BLOCKED; // every probability of the slice is 0
    fa_frag s_frag[BK / 8];
    fa_frag dp_frag[BK / 8];
    for (int j = 0; j < BK / 8; ++j) {
      fa_frag_fill(s_frag[j], 0.0f);
      fa_frag_fill(dp_frag[j], 0.0f);
    }
    fa_frags_multiply_head<T, BD, BK / 8, 32 * WM>(s_frag, q_frag, q_row, f.q_strides[3], row_valid, k_tile, k_tiles,
                                                   valid_keys, head_dim, !blocked, tid, at);
    // dQ below multiplies this threadgroup's own block of K.
    fa_keep_head_block<T, BK, BD, 32 * WM>(k_tile, k_tiles, valid_keys, head_dim, columns.block, tid);
    fa_frags_multiply_head<T, BDV, BK / 8, 32 * WM>(dp_frag, do_frag, do_row, p.do_strides[3], row_valid, v_tile,
                                                    v_tiles, valid_keys, v_head_dim, !blocked, tid, at);
    if (blocked) {
      continue; // it adds nothing to dQ
    }
    fa_frags_scale<BK / 8>(s_frag, f.scale_log2);

    // s_frag becomes dS in place, with the forward's per-score masking.
    const bool add_mask = slice_adds && row_valid;
    long entry = mask_at;
    for (int j = 0; j < BK / 8; ++j) {
      const float2 kept = fa_dropout_factor_pair(f, dropout, b, h, my_row, k0 + 8 * j + at.x, true);
      for (int e = 0; e < 2; ++e) {
        const int key = k0 + 8 * j + at.x + e;
        const bool visible = !fa_mixed_tile_hides(f, start, my_row, key, 2 * j + e);
        const float capped = fa_softcap_score(f, s_frag[j].thread_elements()[e]);
        float score = capped + fa_alibi_bias(f, slope_log2, my_row, key);
        if (visible && add_mask) {
          score += fa_mask_addend(mask, entry + (e == 0 ? 0 : mask_key_stride));
        }
        const float prob = visible ? fa_softmax_probability(score, row_lse) : 0.0f;
        // dP of the undropped probability: dO V^T times the dropout factor (fa_dropout.h).
        s_frag[j].thread_elements()[e] =
            prob * (dp_frag[j].thread_elements()[e] * kept[e] - row_delta) * fa_softcap_gradient(f, capped);
      }
      entry += 8 * mask_key_stride;
    }
    fa_frags_multiply<T, BK / 8, BD / 8>(dq_frag, s_frag, k_tile, K_PITCH, fa_slices(head_dim - col0), at);
  }

  if (row_valid) {
    fa_frags_store_row<T, BD / 8>(dq_frag,
                                  dq + b * p.dq_strides[0] + h * p.dq_strides[1] + long(my_row) * p.dq_strides[2] +
                                      long(col0) * p.dq_strides[3],
                                  p.dq_strides[3], head_dim - col0, p.scale, at);
  }
}

#endif
