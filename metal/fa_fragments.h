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

// The N fragments of an 8-row block along one row of device memory: the lane's row (its
// columns 8 d + at.x and + 1 of fragment d) times factor, zeros past valid_cols or for a row
// outside the matrix (row_valid false: nothing is read).
template <typename T, int N>
inline void fa_frags_load_row(thread fa_frag *f, const device T *row, long col_stride, bool row_valid, int valid_cols,
                              float factor, ushort2 at) {
  for (int d = 0; d < N; ++d) {
    for (int e = 0; e < 2; ++e) {
      const int col = 8 * d + at.x + e;
      f[d].thread_elements()[e] = row_valid && col < valid_cols ? float(row[col * col_stride]) * factor : 0.0f;
    }
  }
}

// The reverse: the lane's row of N fragments times factor into device memory, columns below
// valid_cols only (the caller skips rows outside the matrix).
template <typename T, int N>
inline void fa_frags_store_row(const thread fa_frag *f, device T *row, long col_stride, int valid_cols, float factor,
                               ushort2 at) {
  for (int d = 0; d < N; ++d) {
    for (int e = 0; e < 2; ++e) {
      const int col = 8 * d + at.x + e;
      if (col < valid_cols) {
        row[col * col_stride] = static_cast<T>(f[d].thread_elements()[e] * factor);
      }
    }
  }
}

// acc[j] += A B_j^T for j < NB: A is one 8-row block as ND fragments (8 x 8 ND), B_j rows
// 8 j .. 8 j + 7 of a row-major tile (8 ND columns). Scores Q K^T, and dO V^T in the backward.
template <typename T, int ND, int NB>
inline void fa_frags_multiply_transposed(thread fa_frag *acc, const thread fa_frag *a, const threadgroup T *tile,
                                         int pitch, ushort2 at) {
  for (int j = 0; j < NB; ++j) {
    for (int d = 0; d < ND; ++d) {
      fa_frag b;
      fa_frag_load_transposed(b, tile, pitch, 8 * d, 8 * j, at);
      metal::simdgroup_multiply_accumulate(acc[j], a[d], b, acc[j]);
    }
  }
}

// acc[d] += A B[:, 8 d .. 8 d + 7] for d < ND: A is one 8-row block as NA fragments (8 x 8 NA),
// B the first 8 NA rows of a row-major tile. P V in the forward, dS K, P^T dO, dS^T Q backward.
template <typename T, int NA, int ND>
inline void fa_frags_multiply(thread fa_frag *acc, const thread fa_frag *a, const threadgroup T *tile, int pitch,
                              ushort2 at) {
  for (int d = 0; d < ND; ++d) {
    for (int j = 0; j < NA; ++j) {
      fa_frag b;
      fa_frag_load(b, tile, pitch, 8 * j, 8 * d, at);
      metal::simdgroup_multiply_accumulate(acc[d], a[j], b, acc[d]);
    }
  }
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
