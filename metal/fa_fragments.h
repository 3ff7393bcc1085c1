// 8x8 simdgroup_matrix fragments for attention: loads with dtype conversion, and reductions over
// the rows a lane holds.
//
// Apple's layout of simdgroup_matrix<T, 8, 8>: lane l holds row fa_frag_row(l) at columns
// fa_frag_col(l) and fa_frag_col(l) + 1, as thread_elements()[0] and [1]. Lanes {l, l^1, l^8, l^9}
// hold the same row, so a row reduction is two shuffle-xor steps (by 1 and by 8).
//
// Fragments are float whatever the input dtype: elements are converted as they are loaded, so
// products and sums run in float32 (SDPA accumulates half types in float32 too).
#ifndef FA_FRAGMENTS_H
#define FA_FRAGMENTS_H

#include <metal_stdlib>

typedef metal::simdgroup_matrix<float, 8, 8> fa_frag;

// Where a lane's two elements sit inside any 8x8 fragment: x = first column, y = row.
inline ushort2 fa_frag_coord(ushort lane) {
  return ushort2(((lane / 8) % 2) * 4 + (lane % 2) * 2, (lane / 16) * 4 + (lane / 2) % 4);
}

inline void fa_frag_fill(thread fa_frag &f, float value) {
  f = metal::make_filled_simdgroup_matrix<float, 8, 8>(value);
}

// Fragment (r, c) = tile[(row0 + r) * pitch + col0 + c].
template <typename T>
inline void fa_frag_load(thread fa_frag &f, const threadgroup T *tile, int pitch, int row0, int col0,
                         ushort2 at) {
  const threadgroup T *p = tile + (row0 + at.y) * pitch + col0 + at.x;
  f.thread_elements()[0] = float(p[0]);
  f.thread_elements()[1] = float(p[1]);
}

// Fragment (r, c) = tile[(col0 + c) * pitch + row0 + r]: the transpose of a row-major tile.
template <typename T>
inline void fa_frag_load_transposed(thread fa_frag &f, const threadgroup T *tile, int pitch, int row0,
                                    int col0, ushort2 at) {
  const threadgroup T *p = tile + (col0 + at.x) * pitch + row0 + at.y;
  f.thread_elements()[0] = float(p[0]);
  f.thread_elements()[1] = float(p[pitch]);
}

// Max and sum over the 8 columns of a fragment row, across the four lanes that hold it.
inline float fa_row_max(float v) {
  v = metal::max(v, metal::simd_shuffle_xor(v, ushort(1)));
  return metal::max(v, metal::simd_shuffle_xor(v, ushort(8)));
}

inline float fa_row_sum(float v) {
  v += metal::simd_shuffle_xor(v, ushort(1));
  return v + metal::simd_shuffle_xor(v, ushort(8));
}

#endif
