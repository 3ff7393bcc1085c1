// The decode kernel: a few query rows against many keys (token-by-token generation with a KV
// cache), where an 8-row simdgroup_matrix fragment would be mostly padding.
//
// One threadgroup serves the rows of one kv head: the Hq/Hkv query heads that share it times the L
// query rows, ROWS at a time (more rows take several threadgroups), so each K/V element is read
// once per kv head rather than once per query head. Its FA_DECODE_SIMD_GROUPS SIMD-groups take
// turns over the keys (key j goes to SIMD-group j % FA_DECODE_SIMD_GROUPS). Lane l holds columns
// l, l + 32, ... of the query rows, of each key and value row and of the output accumulators, so a
// score is one simd_sum and loads of a row are coalesced across lanes. Softmax is online in base 2
// with float32 statistics (fa_softmax.h); at the end the SIMD-groups' results are merged through
// threadgroup memory.
//
// Split-K: when the planner shares each row's keys among p.split_count threadgroups (grid x), each
// writes its unnormalised output and (max, sum) to the workspace and fa_decode_merge
// (fa_decode_merge.h) combines them; with one split the threadgroup writes out and lse itself.
//
// Template parameters (the planner picks them, see fa_plan.c):
//   T     element type of q, k, v, out
//   COLS  columns per lane, ceil(max(E, Ev) / 32)
//   ROWS  query rows per threadgroup
// Grid: (p.split_count, Hkv * ceil(Hq / Hkv * L / ROWS), B) threadgroups of
// 32 * FA_DECODE_SIMD_GROUPS threads.
#ifndef FA_DECODE_H
#define FA_DECODE_H

#include <metal_stdlib>
#include "fa_mask.h"
#include "fa_params.h"
#include "fa_softmax.h"

using namespace metal;

// The workspace of a split plan, in floats: partial outputs [split][b][h][i][Ev] (unnormalised),
// then from p.split_stats_offset the partial (max, sum) pairs in the same order. This is the
// index of row (b, h, i) of one split in either array.
inline long fa_split_row(constant fa_params &p, int split, long b, long h, int i) {
  return ((long(split) * p.batch + b) * p.q_heads + h) * p.q_len + i;
}

template <typename T>
inline void fa_store_output(device T *out, constant fa_params &p, long b, long h, int i, int col, float value) {
  out[b * p.o_strides[0] + h * p.o_strides[1] + long(i) * p.o_strides[2] + long(col) * p.o_strides[3]] =
      static_cast<T>(value);
}

inline void fa_store_lse(device float *lse, constant fa_params &p, long b, long h, int i, fa_online_softmax row) {
  lse[b * p.lse_strides[0] + h * p.lse_strides[1] + long(i) * p.lse_strides[2]] = fa_softmax_lse(row);
}

template <typename T, int COLS, int ROWS>
[[kernel, max_total_threads_per_threadgroup(32 * FA_DECODE_SIMD_GROUPS)]] void fa_decode(
    const device T *q [[buffer(0)]],
    const device T *k [[buffer(1)]],
    const device T *v [[buffer(2)]],
    device T *out [[buffer(3)]],
    device float *lse [[buffer(4)]],
    constant fa_params &p [[buffer(5)]],
    device float *workspace [[buffer(6)]],
    const device uchar *mask [[buffer(7)]],
    uint3 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    ushort sg [[simdgroup_index_in_threadgroup]],
    ushort lane [[thread_index_in_simdgroup]]) {
  constexpr int SG = FA_DECODE_SIMD_GROUPS;
  constexpr int WIDTH = 32 * COLS; // columns one SIMD-group holds
  threadgroup float sg_max[SG * ROWS];
  threadgroup float sg_sum[SG * ROWS];
  threadgroup float sg_out[SG * WIDTH];

  // Rows of this kv head are ordered (query head, query row); this threadgroup takes `rows` of them
  // from `first`.
  const long b = group.z;
  const int head_rows = p.gqa_factor * p.q_len;
  const int chunks = (head_rows + ROWS - 1) / ROWS;
  const long kv_h = group.y / chunks;
  const int first = int(group.y % chunks) * ROWS;
  const int rows = min(ROWS, head_rows - first);

  // Loops over rows keep the constant bound ROWS so they unroll and these arrays stay in
  // registers.
  long head[ROWS];    // query head of row r
  int position[ROWS]; // query row index i of row r: under the causal mask it sees keys 0..i
  float q_reg[ROWS][COLS];
  float acc[ROWS][COLS];
  fa_online_softmax state[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    const int row = first + min(r, rows - 1); // rows past `rows` are never used
    head[r] = kv_h * p.gqa_factor + row / p.q_len;
    position[r] = row % p.q_len;
    // Scaled into the base-2 domain once instead of scaling every score.
    const device T *q_row = q + b * p.q_strides[0] + head[r] * p.q_strides[1] + long(position[r]) * p.q_strides[2];
    for (int c = 0; c < COLS; ++c) {
      const int col = int(lane) + 32 * c;
      q_reg[r][c] = col < p.head_dim ? float(q_row[col * p.q_strides[3]]) * p.scale_log2 : 0.0f;
      acc[r][c] = 0.0f;
    }
    state[r] = fa_softmax_init();
  }

  // Top-left causal: no row sees a key at or past L. This split's share of the keys is
  // [begin, end); this SIMD-group takes every SG-th of them.
  const int kv_end = fa_causal ? min(p.kv_len, p.q_len) : p.kv_len;
  const int begin = int(group.x) * p.split_keys;
  // No int overflow near S = 2^31; a plain comparison, since MSL's min() is not documented for long.
  const long split_end = long(begin) + p.split_keys;
  const int end = split_end < long(kv_end) ? int(split_end) : kv_end;
  const device T *k_head = k + b * p.k_strides[0] + kv_h * p.k_strides[1];
  const device T *v_head = v + b * p.v_strides[0] + kv_h * p.v_strides[1];
  for (int j = begin + int(sg); j < end; j += SG) {
    // Both rows are loaded before any arithmetic so their latencies overlap.
    const device T *k_row = k_head + long(j) * p.k_strides[2];
    const device T *v_row = v_head + long(j) * p.v_strides[2];
    float k_reg[COLS];
    float v_reg[COLS];
    for (int c = 0; c < COLS; ++c) {
      const int col = int(lane) + 32 * c;
      k_reg[c] = col < p.head_dim ? float(k_row[col * p.k_strides[3]]) : 0.0f;
      v_reg[c] = col < p.v_head_dim ? float(v_row[col * p.v_strides[3]]) : 0.0f;
    }
    for (int r = 0; r < ROWS && r < rows; ++r) {
      // Row and key are the same on every lane, so skipping keeps the SIMD-group together; a
      // masked key is skipped rather than weighted 0, so NaN in its value stays out of the row.
      const long mask_at = fa_mask_offset(p, b, head[r], position[r], j);
      if ((fa_causal && j > position[r]) || fa_mask_excludes(mask, mask_at)) {
        continue;
      }
      float partial = 0.0f;
      for (int c = 0; c < COLS; ++c) {
        partial = fma(q_reg[r][c], k_reg[c], partial);
      }
      const fa_softmax_step step = fa_softmax_push(state[r], fa_mask_score(simd_sum(partial), mask, mask_at));
      for (int c = 0; c < COLS; ++c) {
        acc[r][c] = fma(step.weight, v_reg[c], acc[r][c] * step.rescale);
      }
    }
  }

  // Merge the SIMD-groups' results one row at a time: every thread folds the SG states into the
  // row's total, each SIMD-group moves its accumulator onto the total's max, and thread t sums
  // column t over the SIMD-groups.
  if (lane == 0) {
    for (int r = 0; r < ROWS && r < rows; ++r) {
      sg_max[int(sg) * ROWS + r] = state[r].max;
      sg_sum[int(sg) * ROWS + r] = state[r].sum;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const bool split = p.split_count > 1;
  for (int r = 0; r < ROWS && r < rows; ++r) {
    fa_online_softmax total = fa_softmax_init();
    for (int s = 0; s < SG; ++s) {
      fa_online_softmax part;
      part.max = sg_max[s * ROWS + r];
      part.sum = sg_sum[s * ROWS + r];
      fa_softmax_merge(total, part);
    }
    const float onto_total = fa_softmax_rescale(state[r].max, total.max);
    for (int c = 0; c < COLS; ++c) {
      sg_out[int(sg) * WIDTH + int(lane) + 32 * c] = acc[r][c] * onto_total;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (int(tid) < p.v_head_dim) {
      float value = 0.0f;
      for (int s = 0; s < SG; ++s) {
        value += sg_out[s * WIDTH + int(tid)];
      }
      if (split) {
        workspace[fa_split_row(p, int(group.x), b, head[r], position[r]) * p.v_head_dim + tid] = value;
      } else {
        fa_store_output(out, p, b, head[r], position[r], int(tid), value * fa_softmax_inverse_sum(total));
      }
    }
    if (tid == 0) {
      if (split) {
        device float *stats = workspace + p.split_stats_offset + 2 * fa_split_row(p, int(group.x), b, head[r], position[r]);
        stats[0] = total.max;
        stats[1] = total.sum;
      } else if (fa_write_lse) {
        fa_store_lse(lse, p, b, head[r], position[r], total);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup); // sg_out is reused by the next row
  }
}

#endif
