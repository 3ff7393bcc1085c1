// The second pass of a split decode: combines the split_count partial results of each row (written
// by fa_decode into the workspace, layout in fa_decode.h), each weighted by exp2 of its max minus
// the row's maximum over all splits, then folds in the attention sink (fa_variants.h), normalises
// and writes out and lse.
//
// Grid: (L, Hq, B) threadgroups of one SIMD-group; lane l handles columns l, l + 32, ...
#ifndef FA_DECODE_MERGE_H
#define FA_DECODE_MERGE_H

#include <metal_stdlib>
#include "fa_decode.h"
#include "fa_params.h"
#include "fa_softmax.h"
#include "fa_variants.h"

using namespace metal;

template <typename T, int COLS>
[[kernel, max_total_threads_per_threadgroup(32)]] void
fa_decode_merge(device T *out [[buffer(FA_FORWARD_BUFFER_OUT)]],
                device float *lse [[buffer(FA_FORWARD_BUFFER_LSE)]],
                constant fa_params &params [[buffer(FA_FORWARD_BUFFER_PARAMS)]],
                const device float *workspace [[buffer(FA_FORWARD_BUFFER_WORKSPACE)]],
                const device float *sinks [[buffer(FA_FORWARD_BUFFER_SINKS)]],
                constant fa_params *sequence_table [[buffer(FA_FORWARD_BUFFER_SEQUENCES)]],
                uint3 group [[threadgroup_position_in_grid]],
                ushort lane [[thread_index_in_simdgroup]]) {
  const int i = int(group.x);
  const long h = group.y;
  const long b = group.z;
  constant fa_params &p = fa_sequence_params(params, sequence_table, b);
  if (i >= p.q_len) {
    return; // a sequence shorter than the grid's max_seqlen_q
  }
  out = fa_sequence_q(out, p, b, p.o_strides);
  lse = fa_sequence_q(lse, p, b, p.lse_strides);
  // The row's maximum over the splits first (their (max, sum) pairs 32 at a time, a lane each), so
  // each split's weight is one exp2 on its own lane and every column one multiply-add per split,
  // with no rescale chaining split after split. A split's max is never NaN (fa_decode_push_batch).
  const long stats = p.split_stats_offset;
  float lane_max = -INFINITY;
  for (int s = int(lane); s < p.split_count; s += 32) {
    lane_max = max(lane_max, workspace[stats + 2 * fa_split_row(p, s, b, h, i)]);
  }
  fa_online_softmax total;
  total.max = simd_max(lane_max);
  float lane_sum = 0.0f;
  float value[COLS];
  for (int c = 0; c < COLS; ++c) {
    value[c] = 0.0f;
  }
  for (int first = 0; first < p.split_count; first += 32) {
    const int mine = first + int(lane);
    float weight = 0.0f; // of split `mine`: moves its results onto the row's maximum
    if (mine < p.split_count) {
      const long row = stats + 2 * fa_split_row(p, mine, b, h, i);
      weight = fa_softmax_rescale(workspace[row], total.max);
      lane_sum = fma(workspace[row + 1], weight, lane_sum);
    }
    const int n = min(32, p.split_count - first);
    for (int t = 0; t < n; ++t) {
      const float split_weight = simd_shuffle(weight, ushort(t));
      const long row = fa_split_row(p, first + t, b, h, i);
      for (int c = 0; c < COLS; ++c) {
        const int col = int(lane) + 32 * c;
        const float partial = col < p.v_head_dim ? workspace[row * p.v_head_dim + col] : 0.0f;
        value[c] = fma(split_weight, partial, value[c]);
      }
    }
  }
  total.sum = simd_sum(lane_sum);
  const float sink_rescale = fa_sink_fold(p, sinks, h, total); // once, over every split's keys
  const float inv_sum = fa_softmax_inverse_sum(total) * sink_rescale;
  for (int c = 0; c < COLS; ++c) {
    const int col = int(lane) + 32 * c;
    if (col < p.v_head_dim) {
      fa_store_output(out, p, b, h, i, col, value[c] * inv_sum);
    }
  }
  if (fa_write_lse && lane == 0) {
    fa_store_lse(lse, p, b, h, i, total);
  }
}

#endif
