// The decode kernel: a few query rows against many keys (token-by-token generation with a KV
// cache), where an 8-row simdgroup_matrix fragment would be mostly padding.
//
// One threadgroup serves the rows of one kv head: the Hq/Hkv query heads that share it times the L
// query rows, ROWS at a time (more rows take several threadgroups), so each K/V element is read
// once per kv head rather than once per query head. Its FA_DECODE_SIMD_GROUPS SIMD-groups take
// turns over the keys in batches of KEYS (SIMD-group g takes keys KEYS g ... KEYS g + KEYS - 1 of
// every KEYS * SG) and step along them by pointer (one add per batch instead of a 64-bit
// multiply). Lanes hold COLS columns each, in chunks of W = min(COLS, 4) contiguous ones
// (fa_decode_column): lane l's chunk c is columns W * (l + 32 c) ... + W - 1, so each key row is
// read as one vector load per chunk and lane, coalesced across lanes, when the planner found K and
// V unit-strided and aligned (fa_decode_vector_loads); otherwise the same layout is read element by
// element through the strides.
//
// A batch is scored as llama.cpp's vector kernel does: the lanes' partial dot products of the
// KEYS keys are summed by one butterfly that leaves each key's score on its own 32 / KEYS lanes
// (fa_decode_reduce_scatter), so masks, band, softcap, ALiBi, dropout and the exp2 run once per
// lane for the batch, in parallel, and the row's maximum, sum and accumulator rescale once per
// batch (fa_decode_push_batch); then each key's value row is added with its weight, broadcast
// from its lanes. Softmax is online in base 2 with float32 statistics (fa_softmax.h); at the end
// the SIMD-groups' results are merged through threadgroup memory.
//
// Split-K: when the planner shares each row's keys among p.split_count threadgroups (grid x), each
// writes its unnormalised output and (max, sum) to the workspace and fa_decode_merge
// (fa_decode_merge.h) combines them; with one split the threadgroup writes out and lse itself.
//
// Template parameters (the planner picks them, see fa_plan_forward.c):
//   T     element type of q, k, v, out
//   COLS  columns per lane: 2, 4, 8, then multiples of 4 up to 20, at least max(E, Ev) / 32
//   ROWS  query rows per threadgroup
// and from them KEYS, the keys per batch: a power of two from 2 to 32, FA_DECODE_KEYS (fa_params.h).
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

// Scores of a batch of KEYS keys from each lane's partial dot products `partial` (lane's columns
// only): a butterfly that halves the batch at every step (lanes with bit `offset` set keep the
// upper half, sending the lower), then sums what is left over the remaining lanes. KEYS - 1 +
// log2(32 / KEYS) shuffles for the batch instead of a 5-shuffle simd_sum per key. Lane l ends with
// the score of key l / (32 / KEYS) of the batch (every lane of that group holds the same value).
template <int KEYS>
inline float fa_decode_reduce_scatter(thread float (&partial)[KEYS], ushort lane) {
  for (int half = KEYS / 2, offset = 16; half >= 1; half /= 2, offset /= 2) {
    const bool upper = (lane & offset) != 0;
    for (int t = 0; t < half; ++t) {
      const float kept = upper ? partial[t + half] : partial[t];
      const float sent = upper ? partial[t] : partial[t + half];
      partial[t] = kept + simd_shuffle_xor(sent, ushort(offset));
    }
  }
  float score = partial[0];
  for (int offset = 16 / KEYS; offset >= 1; offset /= 2) {
    score += simd_shuffle_xor(score, ushort(offset));
  }
  return score;
}

// Folds one batch of scores (this lane's: its key's, as fa_decode_reduce_scatter left them) into
// the row's online softmax: one maximum, one rescale of what was accumulated and one exp2 per
// lane for the whole batch. Returns the rescale and this lane's weight (0 for a skipped key). The
// maximum leaves NaN out (as metal::max does in fa_softmax_push), so a NaN score enters through its
// weight and the sum; a skipped key (past the end, outside the band, excluded by a bool mask) adds
// nothing.
template <int KEYS>
inline fa_softmax_step fa_decode_push_batch(thread fa_online_softmax &state, float score, bool skipped) {
  float batch_max = skipped || isnan(score) ? -INFINITY : score;
  for (int offset = 16; offset >= 32 / KEYS; offset /= 2) {
    batch_max = max(batch_max, simd_shuffle_xor(batch_max, ushort(offset)));
  }
  const float new_max = max(state.max, batch_max);
  fa_softmax_step step;
  step.rescale = fa_softmax_rescale(state.max, new_max);
  step.weight = skipped ? 0.0f : fa_softmax_weight(score, new_max);
  float batch_sum = step.weight; // one lane of each key's group
  for (int offset = 16; offset >= 32 / KEYS; offset /= 2) {
    batch_sum += simd_shuffle_xor(batch_sum, ushort(offset));
  }
  state.sum = state.sum * step.rescale + batch_sum;
  state.max = new_max;
  return step;
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
  constexpr int KEYS = FA_DECODE_KEYS(COLS, ROWS);
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
  // takes the batch of KEYS keys from j = begin + KEYS sg, then every KEYS SG.
  const int split_begin = p.split_begin + int(group.x) * p.split_keys;
  const int begin = max(split_begin, keys.begin);
  // No int overflow near S = 2^31; a plain comparison, since MSL's min() is not documented for long.
  const long split_end = long(split_begin) + p.split_keys;
  const int end = split_end < long(keys.end) ? int(split_end) : keys.end;
  const int j0 = begin + KEYS * int(sg);
  const device T *k_row = k + b * p.k_strides[0] + kv_h * p.k_strides[1] + long(j0) * p.k_strides[2];
  const device T *v_row = v + b * p.v_strides[0] + kv_h * p.v_strides[1] + long(j0) * p.v_strides[2];
  long mask_key = long(j0) * p.mask_strides[3];
  const long k_step = KEYS * SG * p.k_strides[2];
  const long v_step = KEYS * SG * p.v_strides[2];
  const long mask_step = KEYS * SG * p.mask_strides[3];
  const bool as_vectors = fa_decode_vector_loads;
  // Paged or quantized K/V: each key's row through its source (fa_loader.h, fa_quant.h).
  const fa_kv_source<T> k_keys = fa_kv_source_of(k_view, k_scales, k_biases, fa_k_bits, p.k_group_shift, p, p.k_strides,
                                                 p.k_scale_strides, p.k_bias_strides, block_table, b, kv_h, 0, 0);
  const fa_kv_source<T> v_keys = fa_kv_source_of(v_view, v_scales, v_biases, fa_v_bits, p.v_group_shift, p, p.v_strides,
                                                 p.v_scale_strides, p.v_bias_strides, block_table, b, kv_h, 0, 0);
  // The key of a batch whose score this lane holds after fa_decode_reduce_scatter.
  const int lane_key = int(lane) / (32 / KEYS);
  for (int j = j0; j < end; j += KEYS * SG, k_row += k_step, v_row += v_step, mask_key += mask_step) {
    const int in_batch = min(KEYS, end - j); // keys of the batch before the end: the rest read nothing
    // Scores: every key's row against every row's query slice, one K row in registers at a time.
    float partial[ROWS][KEYS];
    for (int t = 0; t < KEYS; ++t) {
      const int key = min(j + t, end - 1); // a key past the end is addressed at the last one, not read
      const device T *k_at = fa_paged ? fa_tile_row(k_keys.rows, key) : k_row + t * p.k_strides[2];
      float k_reg[COLS];
      fa_decode_load_key<T, COLS>(k_reg, k_at, p.k_strides[3], k_keys, key, t < in_batch ? p.head_dim : 0, lane,
                                  as_vectors);
      for (int r = 0; r < ROWS && r < rows; ++r) {
        float dot = 0.0f;
        for (int c = 0; c < COLS; ++c) {
          dot = fma(q_reg[r][c], k_reg[c], dot);
        }
        partial[r][t] = dot;
      }
    }
    // Softmax, once per batch and row: each lane treats its own key, the accumulator is rescaled
    // once. weight[r]: this lane's key's probability weight times its dropout factor, or -1 for
    // a skipped key, which must stay out of the accumulator (0 times a NaN value would not).
    float weight[ROWS];
    for (int r = 0; r < ROWS && r < rows; ++r) {
      const float dot = fa_decode_reduce_scatter<KEYS>(partial[r], lane);
      const int key = j + lane_key;
      const long mask_at = mask_row[r] + mask_key + lane_key * p.mask_strides[3];
      const bool skipped =
          lane_key >= in_batch || fa_band_hides(p, position[r], key) || fa_mask_excludes(mask, mask_at);
      const float score =
          skipped
              ? -INFINITY
              : fa_mask_score(fa_softcap_score(p, dot) + fa_alibi_bias(p, slope[r], position[r], key), mask, mask_at);
      const fa_softmax_step step = fa_decode_push_batch<KEYS>(state[r], score, skipped);
      if (step.rescale != 1.0f) { // the same on every lane
        for (int c = 0; c < COLS; ++c) {
          acc[r][c] *= step.rescale;
        }
      }
      weight[r] = skipped ? -1.0f : step.weight * fa_dropout_factor(p, dropout, b, head[r], position[r], key);
    }
    // Values: each key's row into every row's accumulator, one V row in registers at a time.
    for (int t = 0; t < in_batch; ++t) {
      const int key = j + t;
      const device T *v_at = fa_paged ? fa_tile_row(v_keys.rows, key) : v_row + t * p.v_strides[2];
      float v_reg[COLS];
      fa_decode_load_key<T, COLS>(v_reg, v_at, p.v_strides[3], v_keys, key, p.v_head_dim, lane, as_vectors);
      for (int r = 0; r < ROWS && r < rows; ++r) {
        const float w = simd_shuffle(weight[r], ushort(t * (32 / KEYS)));
        if (!(w < 0.0f)) { // NaN weights enter
          for (int c = 0; c < COLS; ++c) {
            acc[r][c] = fma(w, v_reg[c], acc[r][c]);
          }
        }
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
