// The decode kernel: a few query rows against many keys (token-by-token generation with a KV
// cache), where an 8-row simdgroup_matrix fragment would be mostly padding.
//
// One threadgroup serves the rows of one kv head: the Hq/Hkv query heads that share it times the L
// query rows, ROWS at a time (more rows take several threadgroups), so each K/V element is read
// once per kv head rather than once per query head. Its FA_DECODE_SIMD_GROUPS SIMD-groups take
// turns over the keys two at a time (SIMD-group g takes keys 2g and 2g + 1 of every 2 * SG), so
// two key rows and two value rows are in flight per SIMD-group, and steps along them by pointer
// (one add per key instead of a 64-bit multiply). Lanes hold COLS columns each, in chunks of
// W = min(COLS, 4) contiguous ones (fa_decode_column): lane l's chunk c is columns
// W * (l + 32 c) ... + W - 1, so each key row is read as one vector load per chunk and lane,
// coalesced across lanes, when the planner found K and V unit-strided and aligned
// (fa_decode_vector_loads); otherwise the same layout is read element by element through the
// strides. A score is one simd_sum; softmax is online in base 2 with float32 statistics
// (fa_softmax.h); at the end the SIMD-groups' results are merged through threadgroup memory.
//
// Split-K: when the planner shares each row's keys among p.split_count threadgroups (grid x), each
// writes its unnormalised output and (max, sum) to the workspace and fa_decode_merge
// (fa_decode_merge.h) combines them; with one split the threadgroup writes out and lse itself.
//
// Template parameters (the planner picks them, see fa_plan_forward.c):
//   T     element type of q, k, v, out
//   COLS  columns per lane: 2, 4, 8, then multiples of 4 up to 20, at least max(E, Ev) / 32; above
//         FA_DECODE_LATE_VALUES_ABOVE the value rows load after the scores (registers, fa_plan_forward.c)
//   ROWS  query rows per threadgroup
// Grid: (p.split_count, Hkv * ceil(Hq / Hkv * L / ROWS), B) threadgroups of
// 32 * FA_DECODE_SIMD_GROUPS threads.
#ifndef FA_DECODE_H
#define FA_DECODE_H

#include <metal_stdlib>
#include "fa_dropout.h"
#include "fa_loader.h"
#include "fa_mask.h"
#include "fa_params.h"
#include "fa_quant.h"
#include "fa_sequence.h"
#include "fa_softmax.h"
#include "fa_variants.h"

using namespace metal;

// The workspace of a split plan, in floats: partial outputs [split][b][h][i][Ev] (unnormalised),
// then from p.split_stats_offset the partial (max, sum) pairs in the same order. This is the
// index of row (b, h, i) of one split in either array (rows per head: the grid's, with sequences).
inline long fa_split_row(constant fa_params &p, int split, long b, long h, int i) {
  return ((long(split) * p.batch + b) * p.q_heads + h) * (fa_sequences ? p.seq_grid_q_len : p.q_len) + i;
}

template <typename T>
inline void fa_store_output(device T *out, constant fa_params &p, long b, long h, int i, int col, float value) {
  out[b * p.o_strides[0] + h * p.o_strides[1] + long(i) * p.o_strides[2] + long(col) * p.o_strides[3]] =
      static_cast<T>(value);
}

inline void fa_store_lse(device float *lse, constant fa_params &p, long b, long h, int i, fa_online_softmax row) {
  lse[b * p.lse_strides[0] + h * p.lse_strides[1] + long(i) * p.lse_strides[2]] = fa_softmax_lse(row);
}

// Function constant: K and V have unit column stride and every row starts W-aligned, so chunks are
// read as vectors (the planner checks strides and byte offsets; see fa_plan_forward.c).
constant bool fa_decode_vector_loads [[function_constant(FA_FC_DECODE_VECTOR_LOADS)]];

// Column of element e of a lane's COLS, with W-wide chunks (see the top of this file).
template <int W>
inline int fa_decode_column(ushort lane, int e) {
  return W * (int(lane) + 32 * (e / W)) + e % W;
}

// This lane's COLS elements of a row of `dim` columns (0 past it), as float. `as_vectors` reads each
// whole chunk at once, which needs unit column stride and a W-aligned chunk address.
template <typename T, int COLS>
inline void
fa_decode_load(thread float (&dst)[COLS], const device T *row, long col_stride, int dim, ushort lane, bool as_vectors) {
  constexpr int W = COLS < 4 ? COLS : 4;
  for (int c = 0; c < COLS / W; ++c) {
    const int col = fa_decode_column<W>(lane, c * W);
    if (as_vectors && col + W <= dim) {
      const vec<T, W> chunk = *(const device vec<T, W> *)(row + col);
      for (int w = 0; w < W; ++w) {
        dst[c * W + w] = float(chunk[w]);
      }
    } else {
      for (int w = 0; w < W; ++w) {
        dst[c * W + w] = col + w < dim ? float(row[long(col + w) * col_stride]) : 0.0f;
      }
    }
  }
}

// The same from a quantized row (fa_quant.h), in the same layout. `as_vectors` (the planner found
// the bytes unit-strided and every row start chunk-aligned) reads a whole chunk's bytes at once: W
// bytes at 8 bits, W / 2 at 4 bits (W = 4 only; others element by element); a chunk lies in one
// group (W divides the group size), so its scale and bias are read once.
template <typename T, int COLS>
inline void
fa_decode_load_quantized(thread float (&dst)[COLS], fa_quant_row<T> row, int dim, ushort lane, bool as_vectors) {
  constexpr int W = COLS < 4 ? COLS : 4;
  for (int c = 0; c < COLS / W; ++c) {
    const int col = fa_decode_column<W>(lane, c * W);
    if (as_vectors && col + W <= dim && (row.bits == 8 || W == 4)) {
      uint q[W];
      if (row.bits == 8) {
        const vec<uchar, W> bytes = *(const device vec<uchar, W> *)(row.data + col);
        for (int w = 0; w < W; ++w) {
          q[w] = bytes[w];
        }
      } else {
        const uchar2 bytes = *(const device uchar2 *)(row.data + col / 2);
        for (int w = 0; w < W; ++w) {
          q[w] = (bytes[w / 2] >> (4 * (w % 2))) & 0xFu;
        }
      }
      const long group = long(col >> row.group_shift);
      const float scale = float(row.scales[group * row.scale_col_stride]);
      const float bias = float(row.biases[group * row.bias_col_stride]);
      for (int w = 0; w < W; ++w) {
        dst[c * W + w] = float(T(fma(scale, float(q[w]), bias)));
      }
    } else {
      for (int w = 0; w < W; ++w) {
        dst[c * W + w] = col + w < dim ? float(fa_dequantize(row, col + w)) : 0.0f;
      }
    }
  }
}

// Row `key` of a K or V operand: through the planner's pointer (plain rows, or a paged cache's row
// through the block table) or, quantized, through its source (fa_quant.h).
template <typename T, int COLS>
inline void fa_decode_load_key(thread float (&dst)[COLS],
                               const device T *row,
                               long col_stride,
                               fa_kv_source<T> source,
                               int key,
                               int dim,
                               ushort lane,
                               bool as_vectors) {
  if (source.bits != 0) {
    fa_decode_load_quantized<T, COLS>(dst, fa_quant_row_of(source, key), dim, lane, as_vectors);
  } else {
    fa_decode_load<T, COLS>(dst, row, col_stride, dim, lane, as_vectors);
  }
}

// One key of one row: the score (already summed over the SIMD-group) enters the row's softmax and
// the value row, weighted by the probability times its dropout factor (fa_dropout.h), its
// accumulator.
template <int COLS>
inline void fa_decode_accumulate(thread fa_online_softmax &state,
                                 thread float (&acc)[COLS],
                                 float score,
                                 float dropout_factor,
                                 thread const float (&v_reg)[COLS]) {
  const fa_softmax_step step = fa_softmax_push(state, score);
  const float weight = step.weight * dropout_factor;
  for (int c = 0; c < COLS; ++c) {
    acc[c] = fma(weight, v_reg[c], acc[c] * step.rescale);
  }
}

template <typename T, int COLS, int ROWS>
[[kernel, max_total_threads_per_threadgroup(32 * FA_DECODE_SIMD_GROUPS)]] void
fa_decode(const device T *q [[buffer(FA_FORWARD_BUFFER_Q)]],
          const device T *k [[buffer(FA_FORWARD_BUFFER_K)]],
          const device T *v [[buffer(FA_FORWARD_BUFFER_V)]],
          device T *out [[buffer(FA_FORWARD_BUFFER_OUT)]],
          device float *lse [[buffer(FA_FORWARD_BUFFER_LSE)]],
          constant fa_params &params [[buffer(FA_FORWARD_BUFFER_PARAMS)]],
          device float *workspace [[buffer(FA_FORWARD_BUFFER_WORKSPACE)]],
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
          uint3 group [[threadgroup_position_in_grid]],
          uint tid [[thread_index_in_threadgroup]],
          ushort sg [[simdgroup_index_in_threadgroup]],
          ushort lane [[thread_index_in_simdgroup]]) {
  constexpr int SG = FA_DECODE_SIMD_GROUPS;
  constexpr int W = COLS < 4 ? COLS : 4;
  constexpr int WIDTH = 32 * COLS; // columns one SIMD-group holds
  threadgroup float sg_max[SG * ROWS];
  threadgroup float sg_sum[SG * ROWS];
  threadgroup float sg_out[SG * WIDTH];

  // Rows of this kv head are ordered (query head, query row); this threadgroup takes `rows` of them
  // from `first`.
  const long b = group.z;
  constant fa_params &p = fa_sequence_params(params, sequence_table, b);
  const int head_rows = p.gqa_factor * p.q_len;
  const int chunks = (head_rows + ROWS - 1) / ROWS;
  // A sequence with fewer rows than the grid's max_seqlen packs them into fewer chunks: the
  // threadgroups past them leave.
  if (fa_sequences && (chunks == 0 || long(group.y) >= chunks * long(p.kv_heads))) {
    return;
  }
  const device T *k_view = k, *v_view = v; // the sources below find each sequence's keys themselves
  q = fa_sequence_q(q, p, b, p.q_strides);
  out = fa_sequence_q(out, p, b, p.o_strides);
  lse = fa_sequence_q(lse, p, b, p.lse_strides);
  k = fa_sequence_k(k, p, b, p.k_strides);
  v = fa_sequence_k(v, p, b, p.v_strides);
  const long kv_h = group.y / chunks;
  const int first = int(group.y % chunks) * ROWS;
  const int rows = min(ROWS, head_rows - first);

  // Loops over rows keep the constant bound ROWS so they unroll and these arrays stay in
  // registers.
  long head[ROWS];     // query head of row r
  int position[ROWS];  // query row index i of row r: under the band it sees keys i + band_lo .. i + band_hi
  long mask_row[ROWS]; // offset of mask[b, head, i, 0]
  float slope[ROWS];   // ALiBi slope of row r's head (fa_variants.h)
  float q_reg[ROWS][COLS];
  float acc[ROWS][COLS];
  fa_online_softmax state[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    const int row = first + min(r, rows - 1); // rows past `rows` are never used
    head[r] = kv_h * p.gqa_factor + row / p.q_len;
    position[r] = row % p.q_len;
    mask_row[r] = fa_mask_offset(p, b, head[r], position[r], 0);
    slope[r] = fa_alibi_slope(p, alibi_slopes, b, head[r]);
    // Scaled into the base-2 domain once instead of scaling every score.
    const device T *q_row = q + b * p.q_strides[0] + head[r] * p.q_strides[1] + long(position[r]) * p.q_strides[2];
    fa_decode_load<T, COLS>(q_reg[r], q_row, p.q_strides[3], p.head_dim, lane, false);
    for (int c = 0; c < COLS; ++c) {
      q_reg[r][c] *= p.scale_log2;
      acc[r][c] = 0.0f;
    }
    state[r] = fa_softmax_init();
  }
  // The keys some row of this threadgroup sees under the band: rows are consecutive positions,
  // except that a chunk crossing into the next query head starts again at 0.
  const int first_position = first % p.q_len;
  const bool wraps = first_position + rows > p.q_len;
  const fa_range keys = fa_visible_keys(p, wraps ? 0 : first_position, wraps ? p.q_len : rows);
  const fa_dropout_rng dropout = fa_dropout_state(rng);

  // This split's share of the keys, within those the rows see, is [begin, end); this SIMD-group
  // takes keys j and j + 1 for j = begin + 2 sg, then every 2 SG.
  const int split_begin = p.split_begin + int(group.x) * p.split_keys;
  const int begin = max(split_begin, keys.begin);
  // No int overflow near S = 2^31; a plain comparison, since MSL's min() is not documented for long.
  const long split_end = long(split_begin) + p.split_keys;
  const int end = split_end < long(keys.end) ? int(split_end) : keys.end;
  const int j0 = begin + 2 * int(sg);
  const device T *k_row = k + b * p.k_strides[0] + kv_h * p.k_strides[1] + long(j0) * p.k_strides[2];
  const device T *v_row = v + b * p.v_strides[0] + kv_h * p.v_strides[1] + long(j0) * p.v_strides[2];
  long mask_key = long(j0) * p.mask_strides[3];
  const long k_step = 2 * SG * p.k_strides[2];
  const long v_step = 2 * SG * p.v_strides[2];
  const long mask_step = 2 * SG * p.mask_strides[3];
  const bool as_vectors = fa_decode_vector_loads;
  // Paged or quantized K/V: each key's row through its source (fa_loader.h, fa_quant.h).
  const fa_kv_source<T> k_keys = fa_kv_source_of(k_view, k_scales, k_biases, fa_k_bits, p.k_group_shift, p, p.k_strides,
                                                 p.k_scale_strides, p.k_bias_strides, block_table, b, kv_h, 0, 0);
  const fa_kv_source<T> v_keys = fa_kv_source_of(v_view, v_scales, v_biases, fa_v_bits, p.v_group_shift, p, p.v_strides,
                                                 p.v_scale_strides, p.v_bias_strides, block_table, b, kv_h, 0, 0);
  for (int j = j0; j < end; j += 2 * SG, k_row += k_step, v_row += v_step, mask_key += mask_step) {
    // Both keys' rows (and, up to FA_DECODE_LATE_VALUES_ABOVE columns per lane, their value rows)
    // are loaded before any arithmetic so their latencies overlap; a second key past the end reads
    // nothing.
    const bool second = j + 1 < end;
    constexpr bool late_values = COLS > FA_DECODE_LATE_VALUES_ABOVE;
    static_assert(!late_values || ROWS == 1, "late value loads serve one row");
    float k_reg[2][COLS];
    float v_reg[2][COLS];
    // A paged cache: each key's row through the block table (the K/V cursor, fa_loader.h).
    const device T *k_rows[2] = {k_row, k_row + p.k_strides[2]};
    const device T *v_rows[2] = {v_row, v_row + p.v_strides[2]};
    for (int t = 0; fa_paged && t < 2; ++t) {
      k_rows[t] = fa_tile_row(k_keys.rows, j + t);
      v_rows[t] = fa_tile_row(v_keys.rows, j + t);
    }
    fa_decode_load_key<T, COLS>(k_reg[0], k_rows[0], p.k_strides[3], k_keys, j, p.head_dim, lane, as_vectors);
    fa_decode_load_key<T, COLS>(k_reg[1], k_rows[1], p.k_strides[3], k_keys, j + 1, second ? p.head_dim : 0, lane,
                                as_vectors);
    if (!late_values) {
      fa_decode_load_key<T, COLS>(v_reg[0], v_rows[0], p.v_strides[3], v_keys, j, p.v_head_dim, lane, as_vectors);
      fa_decode_load_key<T, COLS>(v_reg[1], v_rows[1], p.v_strides[3], v_keys, j + 1, second ? p.v_head_dim : 0, lane,
                                  as_vectors);
    }
    for (int r = 0; r < ROWS && r < rows; ++r) {
      float partial[2] = {0.0f, 0.0f};
      for (int c = 0; c < COLS; ++c) {
        partial[0] = fma(q_reg[r][c], k_reg[0][c], partial[0]);
        partial[1] = fma(q_reg[r][c], k_reg[1][c], partial[1]);
      }
      const float score[2] = {simd_sum(partial[0]), simd_sum(partial[1])};
      if (late_values) { // one row (the planner's cap): the key rows are dead, their registers take the values
        fa_decode_load_key<T, COLS>(v_reg[0], v_rows[0], p.v_strides[3], v_keys, j, p.v_head_dim, lane, as_vectors);
        fa_decode_load_key<T, COLS>(v_reg[1], v_rows[1], p.v_strides[3], v_keys, j + 1, second ? p.v_head_dim : 0, lane,
                                    as_vectors);
      }
      for (int t = 0; t < 2; ++t) {
        // Row and key are the same on every lane, so skipping keeps the SIMD-group together; a
        // masked key is skipped rather than weighted 0, so NaN in its value stays out of the row.
        const int key = j + t;
        const long mask_at = mask_row[r] + mask_key + t * p.mask_strides[3];
        if ((t == 1 && !second) || fa_band_hides(p, position[r], key) || fa_mask_excludes(mask, mask_at)) {
          continue;
        }
        const float varied = fa_softcap_score(p, score[t]) + fa_alibi_bias(p, slope[r], position[r], key);
        fa_decode_accumulate<COLS>(state[r], acc[r], fa_mask_score(varied, mask, mask_at),
                                   fa_dropout_factor(p, dropout, b, head[r], position[r], key), v_reg[t]);
      }
    }
  }

  // Merge the SIMD-groups' results one row at a time: every thread folds the SG states into the
  // row's total, each SIMD-group moves its accumulator onto the total's max, and thread t sums
  // columns t, t + 256, ... over the SIMD-groups.
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
    const float sink_rescale = split ? 1.0f : fa_sink_fold(p, sinks, head[r], total); // a split's merge folds it
    for (int c = 0; c < COLS; ++c) {
      sg_out[int(sg) * WIDTH + fa_decode_column<W>(lane, c)] = acc[r][c] * onto_total;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int col = int(tid); col < p.v_head_dim; col += 32 * SG) { // Ev may pass the threads
      float value = 0.0f;
      for (int s = 0; s < SG; ++s) {
        value += sg_out[s * WIDTH + col];
      }
      if (split) {
        workspace[fa_split_row(p, int(group.x), b, head[r], position[r]) * p.v_head_dim + col] = value;
      } else {
        fa_store_output(out, p, b, head[r], position[r], col, value * fa_softmax_inverse_sum(total) * sink_rescale);
      }
    }
    if (tid == 0) {
      if (split) {
        device float *stats =
            workspace + p.split_stats_offset + 2 * fa_split_row(p, int(group.x), b, head[r], position[r]);
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
