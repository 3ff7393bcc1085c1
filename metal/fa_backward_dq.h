// The backward pass, query side: dQ = scale * dS K, parallel over query blocks.
//
// Shaped like the forward (fa_forward.h): a threadgroup of WM SIMD-groups owns BQ = 8 * WM query
// rows of one (batch, head), each SIMD-group 8 of them; K and V stream through threadgroup memory
// BK keys at a time (the forward's tiles). Per tile, in registers:
//   S  = Q K^T            (Q pre-scaled by scale * log2(e), as in the forward)
//   P  = exp2(S - lse_log2)   recomputed from the forward's log-sum-exp, never stored
//   dP = dO V^T
//   dS = P (dP - D)       D = rowsum(dO * O) from the pre-pass (fa_backward_delta.h)
//   dQ += dS K
// Each threadgroup writes only its own rows of dQ: no atomics.
#ifndef FA_BACKWARD_DQ_H
#define FA_BACKWARD_DQ_H

#include <metal_stdlib>
#include "fa_fragments.h"
#include "fa_loader.h"
#include "fa_mask.h"
#include "fa_params.h"
#include "fa_softmax.h"

using namespace metal;

template <typename T, int BD, int BDV, int BK, int WM>
[[kernel, max_total_threads_per_threadgroup(32 * WM)]] void fa_backward_dq(
    const device T *q [[buffer(0)]],
    const device T *k [[buffer(1)]],
    const device T *v [[buffer(2)]],
    const device T *dout [[buffer(4)]],
    const device float *lse [[buffer(5)]],
    const device float *delta [[buffer(6)]],
    device T *dq [[buffer(7)]],
    constant fa_backward_params &p [[buffer(10)]],
    const device uchar *mask [[buffer(11)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    ushort sg [[simdgroup_index_in_threadgroup]],
    ushort lane [[thread_index_in_simdgroup]]) {
  constexpr int BQ = 8 * WM;
  constexpr int K_PITCH = BD + FA_TILE_PAD;
  constexpr int V_PITCH = BDV + FA_TILE_PAD;
  threadgroup T k_tile[BK * K_PITCH];
  threadgroup T v_tile[BK * V_PITCH];

  constant fa_params &f = p.forward;
  const long b = group.z;
  const long h = group.y;
  const long kv_h = h / f.gqa_factor;
  const int q_block = int(group.x) * BQ;
  const int row0 = q_block + 8 * int(sg);
  const ushort2 at = fa_frag_coord(lane);
  const int my_row = row0 + at.y;
  const bool row_valid = my_row < f.q_len;

  fa_frag q_frag[BD / 8];
  fa_frags_load_row<T, BD / 8>(q_frag, q + b * f.q_strides[0] + h * f.q_strides[1] + long(my_row) * f.q_strides[2],
                               f.q_strides[3], row_valid, f.head_dim, f.scale_log2, at);
  fa_frag do_frag[BDV / 8];
  fa_frags_load_row<T, BDV / 8>(do_frag,
                                dout + b * p.do_strides[0] + h * p.do_strides[1] + long(my_row) * p.do_strides[2],
                                p.do_strides[3], row_valid, f.v_head_dim, 1.0f, at);
  fa_frag dq_frag[BD / 8];
  for (int d = 0; d < BD / 8; ++d) {
    fa_frag_fill(dq_frag[d], 0.0f);
  }
  // Padding rows (past L) get probability 0 through lse = +inf.
  const float row_lse_log2 =
      row_valid ? lse[b * f.lse_strides[0] + h * f.lse_strides[1] + long(my_row) * f.lse_strides[2]] * M_LOG2E_F
                : INFINITY;
  const float row_delta =
      row_valid ? delta[b * p.delta_strides[0] + h * p.delta_strides[1] + long(my_row) * p.delta_strides[2]] : 0.0f;

  const device T *k_head = k + b * f.k_strides[0] + kv_h * f.k_strides[1];
  const device T *v_head = v + b * f.v_strides[0] + kv_h * f.v_strides[1];
  // Top-left causal: tiles wholly past the block's last row are never loaded, as in the forward.
  const int kv_end = fa_causal ? min(f.kv_len, q_block + BQ) : f.kv_len;

  for (int k0 = 0; k0 < kv_end; k0 += BK) {
    const int valid_keys = min(BK, f.kv_len - k0);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    fa_load_tile<T, BK, BD, 32 * WM>(k_tile, K_PITCH, k_head + long(k0) * f.k_strides[2], f.k_strides[2],
                                     f.k_strides[3], valid_keys, f.head_dim, tid);
    fa_load_tile<T, BK, BDV, 32 * WM>(v_tile, V_PITCH, v_head + long(k0) * f.v_strides[2], f.v_strides[2],
                                      f.v_strides[3], valid_keys, f.v_head_dim, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);

    fa_frag s_frag[BK / 8];
    fa_frag dp_frag[BK / 8];
    for (int j = 0; j < BK / 8; ++j) {
      fa_frag_fill(s_frag[j], 0.0f);
      fa_frag_fill(dp_frag[j], 0.0f);
    }
    fa_frags_multiply_transposed<T, BD / 8, BK / 8>(s_frag, q_frag, k_tile, K_PITCH, at);
    fa_frags_multiply_transposed<T, BDV / 8, BK / 8>(dp_frag, do_frag, v_tile, V_PITCH, at);

    // s_frag becomes dS in place. Only the ragged last tile, tiles crossing the diagonal and tiles
    // under an attn_mask mask.
    const bool needs_mask = valid_keys < BK || (fa_causal && k0 + BK - 1 > row0) || fa_mask_kind != FA_MASK_NONE;
    for (int j = 0; j < BK / 8; ++j) {
      for (int e = 0; e < 2; ++e) {
        const int key = k0 + 8 * j + at.x + e;
        const bool visible = !needs_mask || (key < f.kv_len && !(fa_causal && key > my_row));
        float score = s_frag[j].thread_elements()[e];
        if (visible && fa_mask_kind != FA_MASK_NONE && row_valid) {
          score = fa_mask_score(score, mask, fa_mask_offset(f, b, h, my_row, key));
        }
        const float prob = visible ? fa_softmax_probability(score, row_lse_log2) : 0.0f;
        s_frag[j].thread_elements()[e] = prob * (dp_frag[j].thread_elements()[e] - row_delta);
      }
    }
    fa_frags_multiply<T, BK / 8, BD / 8>(dq_frag, s_frag, k_tile, K_PITCH, at);
  }

  if (row_valid) {
    fa_frags_store_row<T, BD / 8>(dq_frag, dq + b * p.dq_strides[0] + h * p.dq_strides[1] + long(my_row) * p.dq_strides[2],
                                  p.dq_strides[3], f.head_dim, p.scale, at);
  }
}

#endif
