// The second pass of a split decode: combines the split_count partial results of each row (written
// by fa_decode into the workspace, layout in fa_decode.h) exactly, rescaling each by exp2 of its
// max minus the running max (fa_softmax_merge), then folds in the attention sink (fa_variants.h), normalises and writes out and lse.
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
  fa_online_softmax total = fa_softmax_init();
  float value[COLS];
  for (int c = 0; c < COLS; ++c) {
    value[c] = 0.0f;
  }
  for (int s = 0; s < p.split_count; ++s) {
    const long row = fa_split_row(p, s, b, h, i);
    fa_online_softmax part;
    part.max = workspace[p.split_stats_offset + 2 * row];
    part.sum = workspace[p.split_stats_offset + 2 * row + 1];
    const fa_softmax_step step = fa_softmax_merge(total, part);
    for (int c = 0; c < COLS; ++c) {
      const int col = int(lane) + 32 * c;
      const float partial = col < p.v_head_dim ? workspace[row * p.v_head_dim + col] : 0.0f;
      value[c] = fma(step.weight, partial, value[c] * step.rescale);
    }
  }
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
