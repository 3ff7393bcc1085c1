// The backward pass, key side: dV = P^T dO and dK = scale * dS^T Q, parallel over key blocks.
//
// A threadgroup of WM SIMD-groups owns 8 * WM keys of one (batch, kv head), each SIMD-group 8 of
// them, keeping their K and V fragments (operand fragments, fa_fragments.h) and the dK and dV
// accumulators in registers. Queries stream through threadgroup memory BK rows at a time: Q, dO
// and, per row, lse and D (the forward's tile sizes with queries in place of keys). Per tile, everything transposed relative to the dQ kernel (fa_backward_dq.h):
//   S^T  = K Q^T,  P^T = exp(S^T ln(2) - lse),  dP^T = V dO^T,  dS^T = P^T (dP^T - D)
//   dV += P^T dO,  dK += dS^T Q
// (under dropout dV takes P^T and dS^T takes dP^T times each element's factor: fa_dropout.h)
// GQA: the threadgroup of a kv head loops over every query head that reads it, so dK and dV sum
// their contributions in registers; each threadgroup writes only its own keys: no atomics, and
// K and V are read in place, never expanded. Head dims above the tiles' widths
// (fa_head_blocks.h): E above BD streams K and Q in blocks for S^T, Ev above BDV V and dO for dP^T,
// and each threadgroup accumulates one column block of dK (BD wide) and of dV (BDV wide).
#ifndef FA_BACKWARD_DKDV_H
#define FA_BACKWARD_DKDV_H

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
fa_backward_dkdv(const device T *q [[buffer(FA_BACKWARD_BUFFER_Q)]],
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
                 const device uint *rng [[buffer(FA_BACKWARD_BUFFER_RNG)]],
                 const device float *mask_blocks [[buffer(FA_BACKWARD_BUFFER_WORKSPACE)]],
                 uint3 group [[threadgroup_position_in_grid]],
                 uint3 groups [[threadgroups_per_grid]],
                 uint tid [[thread_index_in_threadgroup]],
                 ushort sg [[simdgroup_index_in_threadgroup]],
                 ushort lane [[thread_index_in_simdgroup]]) {
  constexpr int Q_PITCH = BD + FA_TILE_PAD;
  constexpr int DO_PITCH = BDV + FA_TILE_PAD;
  threadgroup fa_tile_storage<T> q_storage[fa_tile_vectors(BK * Q_PITCH)];
  threadgroup fa_tile_storage<T> do_storage[fa_tile_vectors(BK * DO_PITCH)];
  threadgroup float lse_tile[BK];
  threadgroup float delta_tile[BK];
  threadgroup bool tile_votes[2 * WM];
  threadgroup T *q_tile = (threadgroup T *)q_storage;
  threadgroup T *do_tile = (threadgroup T *)do_storage;

  const fa_block_position block = fa_block_of(group, groups, false);
  const long b = block.batch;
  const int head_dim = fa_head_dim<BD>(p.forward.head_dim); // every sequence's too
  const int v_head_dim = fa_head_dim<BDV>(p.forward.v_head_dim);
  const int e_blocks = fa_head_blocks(head_dim, BD);
  const int v_blocks = fa_head_blocks(v_head_dim, BDV);
  const fa_column_block columns = fa_column_block_of(block.head, max(e_blocks, v_blocks));
  const long kv_h = columns.head;
  const bool owns_dk = columns.block < e_blocks; // a threadgroup past either count skips that gradient
  const bool owns_dv = columns.block < v_blocks;
  const int dk_col0 = columns.block * BD;
  const int dv_col0 = columns.block * BDV;
  constant fa_params &f = fa_sequence_params(p.forward, sequence_table, b);
  const int key_block = block.block * 8 * WM;
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
  const int key0 = key_block + 8 * int(sg); // first of this SIMD-group's 8 keys
  const ushort2 at = fa_frag_coord(lane);
  const int my_key = key0 + at.y; // the one key whose elements this lane holds
  const bool key_valid = my_key < f.kv_len;

  // Resident operands load once; streamed ones block by block in the tile loop.
  fa_operand_frag<T> k_frag[BD / 8];
  const device T *k_row = k + b * f.k_strides[0] + kv_h * f.k_strides[1] + long(my_key) * f.k_strides[2];
  fa_operand_frag<T> v_frag[BDV / 8];
  const device T *v_row = v + b * f.v_strides[0] + kv_h * f.v_strides[1] + long(my_key) * f.v_strides[2];
  fa_load_resident_row<T, BD / 8>(k_frag, k_row, f.k_strides[3], key_valid, head_dim, at);
  fa_load_resident_row<T, BDV / 8>(v_frag, v_row, f.v_strides[3], key_valid, v_head_dim, at);
  fa_frag dk_frag[BD / 8];
  for (int d = 0; d < BD / 8; ++d) {
    fa_frag_fill(dk_frag[d], 0.0f);
  }
  fa_frag dv_frag[BDV / 8];
  for (int d = 0; d < BDV / 8; ++d) {
    fa_frag_fill(dv_frag[d], 0.0f);
  }

  // Under the band only queries [q_begin, q_end) see a key of this block: other tiles are never
  // loaded (and a block no query sees gets zeros).
  const fa_range queries = fa_visible_queries(f, key_block, 8 * WM);
  const int q_begin = queries.begin;
  const long q_step = long(BK) * f.q_strides[2];
  const long do_step = long(BK) * p.do_strides[2];
  const long mask_query_stride = f.mask_strides[2]; // between the columns of this kernel's score tiles
  int tile = 0;
  const fa_dropout_rng dropout = fa_dropout_state(rng);
  for (long h = kv_h * f.gqa_factor; h < (kv_h + 1) * f.gqa_factor; ++h) {
    const device T *q_src = q + b * f.q_strides[0] + h * f.q_strides[1] + long(q_begin) * f.q_strides[2];
    const device T *do_src = dout + b * p.do_strides[0] + h * p.do_strides[1] + long(q_begin) * p.do_strides[2];
    const device float *lse_head = lse + b * f.lse_strides[0] + h * f.lse_strides[1];
    const device float *delta_head = delta + b * p.delta_strides[0] + h * p.delta_strides[1];
    const float slope_log2 = fa_alibi_slope(f, alibi_slopes, b, h);
    long mask_at = fa_mask_kind == FA_MASK_NONE ? 0 : fa_mask_offset(f, b, h, q_begin + at.x, my_key);
    for (int q0 = q_begin; q0 < queries.end;
         q0 += BK, ++tile, q_src += q_step, do_src += do_step, mask_at += BK * mask_query_stride) {
      const int valid_rows = min(BK, f.q_len - q0);
      int bounds_class = fa_key_tile_class(f, key0, q0, BK);
      // The additive mask's class for the slice (fa_mask_blocks.h): SKIP blocks it, ZERO adds nothing.
      int mask_class = FA_MASK_BLOCK_ADD;
      if (fa_mask_blocks && bounds_class != FA_TILE_BLOCKED) {
        mask_class = fa_mask_region_class(f, mask_blocks, b, h, kv_h, q0, BK, key0, 8, slope_log2, true,
                                          p.do_block_max_offset, p.v_block_max_offset);
        bounds_class = mask_class == FA_MASK_BLOCK_SKIP ? int(FA_TILE_BLOCKED) : bounds_class;
      }
      const bool slice_adds = fa_mask_is_additive() && mask_class == FA_MASK_BLOCK_ADD;
      const fa_tile_start start = fa_start_tile<BK / 8, WM>(bounds_class, mask, mask_at, mask_query_stride, valid_rows,
                                                            key_valid, tile_votes, tile, sg, lane, at);
      if (!start.load) {
        continue; // no SIMD-group needs this tile: not even loaded
      }
      const fa_tile_rows<T> q_rows = fa_rows(q_src, f.q_strides[2], f.q_strides[3]);
      const fa_tile_rows<T> do_rows = fa_rows(do_src, p.do_strides[2], p.do_strides[3]);
      fa_load_resident_tile<T, BK, BD, 32 * WM>(q_tile, q_rows, valid_rows, head_dim, tid);
      fa_load_resident_tile<T, BK, BDV, 32 * WM>(do_tile, do_rows, valid_rows, v_head_dim, tid);
      if (tid < uint(BK)) {
        // Rows past L get probability 0 through lse = +inf.
        const long row = q0 + long(tid);
        const bool inside = int(tid) < valid_rows;
        lse_tile[tid] = inside ? lse_head[row * f.lse_strides[2]] : INFINITY;
        delta_tile[tid] = inside ? delta_head[row * p.delta_strides[2]] : 0.0f;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);

      const bool blocked = start.tile_class == FA_TILE_BLOCKED; // every probability of the slice is 0
      fa_frag s_frag[BK / 8];
      fa_frag dp_frag[BK / 8];
      for (int j = 0; j < BK / 8; ++j) {
        fa_frag_fill(s_frag[j], 0.0f);
        fa_frag_fill(dp_frag[j], 0.0f);
      }
      // Streamed, dK and dV below multiply this threadgroup's own blocks of Q and dO.
      fa_frags_multiply_head<T, BD, BK / 8, 32 * WM>(s_frag, k_frag, k_row, f.k_strides[3], key_valid, q_tile, q_rows,
                                                     valid_rows, head_dim, !blocked, tid, at);
      fa_keep_head_block<T, BK, BD, 32 * WM>(q_tile, q_rows, valid_rows, head_dim, min(columns.block, e_blocks - 1),
                                             tid);
      fa_frags_multiply_head<T, BDV, BK / 8, 32 * WM>(dp_frag, v_frag, v_row, f.v_strides[3], key_valid, do_tile,
                                                      do_rows, valid_rows, v_head_dim, !blocked, tid, at);
      fa_keep_head_block<T, BK, BDV, 32 * WM>(do_tile, do_rows, valid_rows, v_head_dim,
                                              min(columns.block, v_blocks - 1), tid);
      if (blocked) {
        continue; // it adds nothing to dK or dV
      }
      fa_frags_scale<BK / 8>(s_frag, f.scale_log2);

      // s_frag becomes P^T and dp_frag dS^T in place. MIXED tiles test the band and the bool mask's
      // bits (ragged rows are handled by lse = +inf; keys past S are never stored); an additive
      // mask is added throughout.
      const bool add_mask = slice_adds && key_valid;
      long entry = mask_at;
      for (int j = 0; j < BK / 8; ++j) {
        const float2 kept = fa_dropout_factor_pair(f, dropout, b, h, q0 + 8 * j + at.x, my_key, false);
        for (int e = 0; e < 2; ++e) {
          const int col = 8 * j + at.x + e; // the query row q0 + col
          const bool visible = !fa_mixed_tile_hides(f, start, q0 + col, my_key, 2 * j + e);
          const float capped = fa_softcap_score(f, s_frag[j].thread_elements()[e]);
          float score = capped + fa_alibi_bias(f, slope_log2, q0 + col, my_key);
          if (visible && add_mask && col < valid_rows) {
            score += fa_mask_addend(mask, entry + (e == 0 ? 0 : mask_query_stride));
          }
          const float prob = visible ? fa_softmax_probability(score, lse_tile[col]) : 0.0f;
          // dV takes the dropped probability, dS^T the undropped one times the dropped dP^T (fa_dropout.h).
          s_frag[j].thread_elements()[e] = prob * kept[e];
          dp_frag[j].thread_elements()[e] =
              prob * (dp_frag[j].thread_elements()[e] * kept[e] - delta_tile[col]) * fa_softcap_gradient(f, capped);
        }
        entry += 8 * mask_query_stride;
      }
      if (owns_dv) {
        fa_frags_multiply<T, BK / 8, BDV / 8>(dv_frag, s_frag, do_tile, DO_PITCH, fa_slices(v_head_dim - dv_col0), at);
      }
      if (owns_dk) {
        fa_frags_multiply<T, BK / 8, BD / 8>(dk_frag, dp_frag, q_tile, Q_PITCH, fa_slices(head_dim - dk_col0), at);
      }
    }
  }

  if (key_valid && owns_dk) {
    fa_frags_store_row<T, BD / 8>(dk_frag,
                                  dk + b * p.dk_strides[0] + kv_h * p.dk_strides[1] + long(my_key) * p.dk_strides[2] +
                                      long(dk_col0) * p.dk_strides[3],
                                  p.dk_strides[3], head_dim - dk_col0, p.scale, at);
  }
  if (key_valid && owns_dv) {
    fa_frags_store_row<T, BDV / 8>(dv_frag,
                                   dv + b * p.dv_strides[0] + kv_h * p.dv_strides[1] + long(my_key) * p.dv_strides[2] +
                                       long(dv_col0) * p.dv_strides[3],
                                   p.dv_strides[3], v_head_dim - dv_col0, 1.0f, at);
  }
}

#endif
