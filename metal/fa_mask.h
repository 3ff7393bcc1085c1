// Masking inside the kernels: the classification of score tiles, and attn_mask read through its
// strides (a broadcast mask is never expanded in memory). The mask's dtype is a function constant
// rather than a template parameter, so one library serves every mask type and the unmasked case
// pays nothing once Metal folds the branches.
//
// Tile classes. Each SIMD-group classifies its 8-row slice of every score tile before the matrix
// work: BLOCKED tiles (every score masked: outside the band (causal, window), padding rows or keys, or a
// bool mask that excludes the whole slice) are skipped, and when every SIMD-group of the
// threadgroup is blocked the K/V (or Q/dO) tile is not even loaded; VISIBLE tiles (inside the
// bounds, inside the band and, under a bool mask, wholly kept) skip the per-score tests; MIXED
// ones test each score. Additive masks are read for every score they touch, and a tile is never
// skipped on their account alone (-inf added to a NaN or +inf score gives NaN, as SDPA's does),
// except in the prefill forward under the pre-pass's block classes (fa_mask_blocks.h): there a
// slice of -inf entries whose scores are certainly finite is BLOCKED, and one of zeros adds nothing.
//
// Mask entries: each lane reads the entries of its own row (one per column of the tile) from one
// 64-bit offset per tile, stepping by adds of the column stride; no multiply per entry. (32-bit
// in-tile offsets would need the column stride times the tile width to fit 32 bits, which a
// transposed mask view need not.)
#ifndef FA_MASK_H
#define FA_MASK_H

#include <metal_stdlib>
#include "fa_mask_blocks.h"
#include "fa_params.h"

enum { FA_TILE_BLOCKED = 0, FA_TILE_MIXED = 1, FA_TILE_VISIBLE = 2 };

// Element offset of mask[b, h, i, j].
inline long fa_mask_offset(constant fa_params &p, long b, long h, long i, long j) {
  return b * p.mask_strides[0] + h * p.mask_strides[1] + i * p.mask_strides[2] + j * p.mask_strides[3];
}

// The band (fa_params.h): whether it hides key `key` from row `row`.
inline bool fa_band_hides(constant fa_params &p, int row, int key) {
  return fa_banded && (key < row + p.band_lo || key > row + p.band_hi);
}

// The class, from bounds and the band alone, of the tile of rows row0 .. row0 + 7 and keys
// k0 .. k0 + BK - 1 (query-side kernels: forward, dQ).
inline int fa_query_tile_class(constant fa_params &p, int row0, int k0, int bk) {
  if (row0 >= p.q_len || (fa_banded && (k0 > row0 + 7 + p.band_hi || k0 + bk - 1 < row0 + p.band_lo))) {
    return FA_TILE_BLOCKED;
  }
  const bool inside =
      k0 + bk <= p.kv_len && (!fa_banded || (k0 + bk - 1 <= row0 + p.band_hi && k0 >= row0 + 7 + p.band_lo));
  return inside ? FA_TILE_VISIBLE : FA_TILE_MIXED;
}

// The same for the key side (dK/dV): keys key0 .. key0 + 7 against queries q0 .. q0 + BQ - 1
// (query i sees key j when j - band_hi <= i <= j - band_lo). Queries past L need no test here
// (their probability is 0 through lse = +inf).
inline int fa_key_tile_class(constant fa_params &p, int key0, int q0, int bq) {
  if (key0 >= p.kv_len || (fa_banded && (q0 + bq - 1 < key0 - p.band_hi || q0 > key0 + 7 - p.band_lo))) {
    return FA_TILE_BLOCKED;
  }
  return !fa_banded || (q0 >= key0 + 7 - p.band_hi && q0 + bq - 1 <= key0 - p.band_lo) ? FA_TILE_VISIBLE
                                                                                       : FA_TILE_MIXED;
}

// A lane's bool-mask entries over NB fragments of a tile: bit 2 j + e set when the entry of column
// 8 j + at.x + e is nonzero (takes part). `offset` is the entry of column at.x, `stride` the
// elements between columns; columns from valid_cols on are not read (bit clear).
template <int NB>
inline uint fa_mask_bool_bits(const device uchar *mask, long offset, long stride, int valid_cols, ushort2 at) {
  uint bits = 0;
  const long fragment_stride = 8 * stride;
  for (int j = 0; j < NB; ++j) {
    for (int e = 0; e < 2; ++e) {
      if (8 * j + at.x + e < valid_cols && mask[offset + (e == 0 ? 0 : stride)] != 0) {
        bits |= 1u << (2 * j + e);
      }
    }
    offset += fragment_stride;
  }
  return bits;
}

// The additive mask's entry at `offset`, scaled by log2(e) as the scores are.
inline float fa_mask_addend(const device uchar *mask, long offset) {
  const float log2e = 1.4426950408889634f;
  switch (fa_mask_kind) {
  case FA_MASK_FLOAT: return ((const device float *)mask)[offset] * log2e;
  case FA_MASK_HALF: return float(((const device half *)mask)[offset]) * log2e;
#if defined(__HAVE_BFLOAT__)
  case FA_MASK_BFLOAT: return float(((const device bfloat *)mask)[offset]) * log2e;
#endif
  default: return 0.0f;
  }
}

inline bool fa_mask_is_additive() {
  return fa_mask_kind == FA_MASK_FLOAT || fa_mask_kind == FA_MASK_HALF || fa_mask_kind == FA_MASK_BFLOAT;
}

// A bool mask that excludes the key: the kernels skip it, as SDPA gives it weight 0.
inline bool fa_mask_excludes(const device uchar *mask, long offset) {
  return fa_mask_kind == FA_MASK_BOOL && mask[offset] == 0;
}

// The base-2 score after the mask at `offset`: -inf where a bool mask excludes the key, plus the
// additive mask otherwise (one score at a time: the decode and simple kernels).
inline float fa_mask_score(float score, const device uchar *mask, long offset) {
  if (fa_mask_kind == FA_MASK_BOOL) {
    return mask[offset] != 0 ? score : -INFINITY;
  }
  return fa_mask_is_additive() ? score + fa_mask_addend(mask, offset) : score;
}

// What the start of a tile decided for a SIMD-group: its class, the lane's bool-mask bits (all set
// without a bool mask), and whether any SIMD-group of the threadgroup needs the tile loaded.
struct fa_tile_start {
  int tile_class;
  uint keep;
  bool load;
};

// The start of every tile of the tiled kernels, with the threadgroup barrier after which the
// previous tiles are consumed. `tile_class` comes from bounds and the diagonal; under a bool mask
// each lane reads its bits (as fa_mask_bool_bits; nothing when lane_valid is false), the SIMD-group
// refines its class by them (VISIBLE only when every lane keeps every column) and the SIMD-groups
// vote: no load when every one is blocked. Under an additive mask's block classes
// (fa_mask_blocks.h) the SIMD-groups vote on the class the caller refined by them. `votes` holds 2 WM entries, used by halves on
// alternate tiles, so a SIMD-group that skips ahead never overwrites votes still being read.
template <int NB, int WM>
inline fa_tile_start fa_start_tile(int tile_class,
                                   const device uchar *mask,
                                   long offset,
                                   long stride,
                                   int valid_cols,
                                   bool lane_valid,
                                   threadgroup bool *votes,
                                   int tile,
                                   ushort sg,
                                   ushort lane,
                                   ushort2 at) {
  fa_tile_start start = {tile_class, ~0u, true};
  if (fa_mask_kind != FA_MASK_BOOL && !fa_mask_blocks) {
    metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
    return start;
  }
  if (fa_mask_kind == FA_MASK_BOOL && tile_class != FA_TILE_BLOCKED) {
    start.keep = lane_valid ? fa_mask_bool_bits<NB>(mask, offset, stride, valid_cols, at) : 0;
    const uint every_column = (1u << (2 * NB)) - 1;
    if (!metal::simd_any(start.keep != 0)) {
      start.tile_class = FA_TILE_BLOCKED;
    } else if (!(tile_class == FA_TILE_VISIBLE && metal::simd_all(start.keep == every_column))) {
      start.tile_class = FA_TILE_MIXED;
    }
  }
  threadgroup bool *mine = votes + (tile % 2) * WM;
  if (lane == 0) {
    mine[sg] = start.tile_class != FA_TILE_BLOCKED;
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  start.load = false;
  for (int i = 0; i < WM; ++i) {
    start.load |= mine[i];
  }
  return start;
}

// Whether a MIXED tile hides the score of (row, key), bit `bit` of the lane's bool-mask bits: a key
// past S, one outside the band, or a bool mask's bit off. Other classes hide no single score
// (BLOCKED slices are skipped before the scores, VISIBLE ones keep them all).
inline bool fa_mixed_tile_hides(constant fa_params &p, fa_tile_start start, int row, int key, int bit) {
  return start.tile_class == FA_TILE_MIXED && (key >= p.kv_len || fa_band_hides(p, row, key) ||
                                               (fa_mask_kind == FA_MASK_BOOL && ((start.keep >> bit) & 1u) == 0));
}

// A range [begin, end) of keys or query rows; empty when end <= begin.
struct fa_range {
  int begin;
  int end;
};

// The keys some valid row of rows row0 .. row0 + rows - 1 can see under the band, or all of them:
// tiles outside are never visited (csrc/fa_plan_forward.c counts them the same way).
inline fa_range fa_visible_keys(constant fa_params &p, int row0, int rows) {
  fa_range r = {0, p.kv_len};
  if (fa_banded) {
    const int last = metal::min(row0 + rows, p.q_len) - 1;
    r.begin = metal::max(0, row0 + p.band_lo);
    r.end = metal::min(p.kv_len, last + p.band_hi + 1);
  }
  return r;
}

// The query rows that see some key of keys key0 .. key0 + keys - 1 under the band, or all of them.
inline fa_range fa_visible_queries(constant fa_params &p, int key0, int keys) {
  fa_range r = {0, p.q_len};
  if (fa_banded) {
    const int last = metal::min(key0 + keys, p.kv_len) - 1;
    r.begin = metal::max(0, key0 - p.band_hi);
    r.end = metal::min(p.q_len, last - p.band_lo + 1);
  }
  return r;
}

#endif
