// Packed sequences (flash_attn_varlen_func) and KV caches (flash_attn_with_kvcache): under the
// function constant FA_FC_SEQUENCES each batch entry b of the grid is a sequence with its own
// query rows and keys, all of them in one launch.
//
// The caller describes sequence b by one row of FA_SEQUENCE_COLUMNS int32 (fa_sequence_entry):
// where its query rows start (q batch, first row) and how many, where its keys start (k batch,
// first row) and how many. Packed sequences have batch 0 and rows from the prefix sums; a cache
// has q batch b, k batch cache_batch_idx[b], keys from cache_leftpad[b]. That table lives in
// device memory and is not trusted: fa_sequence_table (one thread per sequence, launched before
// the attention kernels) clamps every entry into the views the planner validated and writes one
// full fa_params per sequence, with that sequence's q_len, kv_len, band, diagonal and starts. The
// attention kernels then read their params through fa_sequence_params, so every helper (bounds,
// band, tile classes, variants) sees the sequence's own lengths, and move their base pointers onto
// the sequence's first row with fa_sequence_q / fa_sequence_k. Threadgroups of a sequence shorter
// than the grid's max_seqlen leave at once.
//
// The band is shared with the C planner (fa_band_around), which uses it for calls without
// sequences.
#ifndef FA_SEQUENCE_H
#define FA_SEQUENCE_H

#include "fa_params.h"

// Columns of a sequence table row.
enum fa_sequence_entry {
  FA_SEQ_Q_BATCH = 0,
  FA_SEQ_Q_ROW0 = 1,
  FA_SEQ_Q_LEN = 2,
  FA_SEQ_K_BATCH = 3,
  FA_SEQ_K_ROW0 = 4,
  FA_SEQ_K_LEN = 5,
  FA_SEQUENCE_COLUMNS = 6
};

// Threads per threadgroup of fa_sequence_table (one per sequence).
#define FA_SEQUENCE_TABLE_THREADS 32

typedef struct fa_band_bounds {
  fa_i32 lo;
  fa_i32 hi;
} fa_band_bounds;

// Row i of L rows over S keys sees keys [i + lo, i + hi]: a window of `left` keys before and
// `right` after the diagonal key i + diagonal (-1: unbounded). Unbounded sides become -L and S,
// and both bounds are clamped into [-L, S] (a window of up to 2^63 - 1 cannot overflow: one wider
// than L + S + |diagonal| reaches past every key; L + S + |diagonal| must fit 32 bits, which the
// planner checks).
static inline fa_band_bounds fa_band_around(fa_i64 l, fa_i64 s, fa_i64 diagonal, fa_i64 left, fa_i64 right) {
  const fa_i64 reach = l + s + (diagonal < 0 ? -diagonal : diagonal);
  const fa_i64 lo = left < 0 || left > reach ? -l : diagonal - left;
  const fa_i64 hi = right < 0 || right > reach ? s : diagonal + right;
  fa_band_bounds band;
  band.lo = (fa_i32)(lo < -l ? -l : lo > s ? s : lo);
  band.hi = (fa_i32)(hi < -l ? -l : hi > s ? s : hi);
  return band;
}

#ifdef __METAL_VERSION__
#include <metal_stdlib>

constant bool fa_sequences [[function_constant(FA_FC_SEQUENCES)]];
constant bool fa_paged [[function_constant(FA_FC_PAGED)]];

inline int fa_sequence_clamp(int x, int lo, int hi) { return x < lo ? lo : x > hi ? hi : x; }

// One thread per sequence: the table row of sequence b, clamped into q's and k's views (rows past
// the grid's max_seqlen are cut, never read outside a view), becomes that sequence's params. Each
// entry file instantiates it for its element type (T is unused), so it lives in the library the
// attention kernels are in and costs no compile of its own.
template <typename T>
[[kernel, max_total_threads_per_threadgroup(FA_SEQUENCE_TABLE_THREADS)]] void
fa_sequence_table(const device int *entries [[buffer(FA_TABLE_BUFFER_ENTRIES)]],
                  device fa_params *table [[buffer(FA_TABLE_BUFFER_OUT)]],
                  constant fa_params &p [[buffer(FA_TABLE_BUFFER_PARAMS)]],
                  uint b [[thread_position_in_grid]]) {
  if (b >= uint(p.batch)) {
    return;
  }
  const device int *e = entries + long(b) * FA_SEQUENCE_COLUMNS;
  // The call's params word by word (MSL copies no struct across address spaces), then this
  // sequence's fields.
  const constant fa_i32 *from = (const constant fa_i32 *)&p;
  device fa_i32 *to = (device fa_i32 *)(table + b);
  for (uint i = 0; i < sizeof(fa_params) / sizeof(fa_i32); ++i) {
    to[i] = from[i];
  }
  device fa_params &s = table[b];
  s.seq_q_batch = fa_sequence_clamp(e[FA_SEQ_Q_BATCH], 0, metal::max(p.seq_q_batches - 1, 0));
  s.seq_q_row0 = fa_sequence_clamp(e[FA_SEQ_Q_ROW0], 0, p.seq_q_rows);
  s.q_len = fa_sequence_clamp(e[FA_SEQ_Q_LEN], 0, metal::min(p.seq_q_rows - s.seq_q_row0, p.seq_grid_q_len));
  s.seq_k_batch = fa_sequence_clamp(e[FA_SEQ_K_BATCH], 0, metal::max(p.seq_k_batches - 1, 0));
  s.seq_k_row0 = fa_sequence_clamp(e[FA_SEQ_K_ROW0], 0, p.seq_k_rows);
  s.kv_len = fa_sequence_clamp(e[FA_SEQ_K_LEN], 0, metal::min(p.seq_k_rows - s.seq_k_row0, p.kv_len));
  s.diagonal = p.seq_bottom_right ? s.kv_len - s.q_len : 0;
  const fa_band_bounds band = fa_band_around(s.q_len, s.kv_len, s.diagonal, p.seq_window_left, p.seq_window_right);
  s.band_lo = band.lo;
  s.band_hi = band.hi;
  s.split_begin = metal::max(0, band.lo); // the first key row 0 sees; the planner sized the splits for all keys
}

// The params sequence b runs with: its table entry under FA_FC_SEQUENCES, else the call's.
inline constant fa_params &fa_sequence_params(constant fa_params &p, constant fa_params *table, long b) {
  return fa_sequences ? table[b] : p;
}

// A pointer into a q-side view (q, out, lse, dO, dQ, D; `strides` its own, row stride at [2])
// moved so that the kernels' `b * strides[0] + i * strides[2]` addresses row i of sequence b;
// unchanged without sequences. p is the sequence's params (fa_sequence_params).
template <typename P>
inline P fa_sequence_q(P ptr, constant fa_params &p, long b, constant fa_i64 *strides) {
  return fa_sequences ? ptr + ((long(p.seq_q_batch) - b) * strides[0] + long(p.seq_q_row0) * strides[2]) : ptr;
}

// The same for a key-side view (k, v, dK, dV). A paged cache is addressed per key instead
// (fa_kv_tiles, fa_loader.h), from the pointer left as it is.
template <typename P>
inline P fa_sequence_k(P ptr, constant fa_params &p, long b, constant fa_i64 *strides) {
  return fa_sequences && !fa_paged ? ptr + ((long(p.seq_k_batch) - b) * strides[0] + long(p.seq_k_row0) * strides[2])
                                   : ptr;
}

#endif

#endif
