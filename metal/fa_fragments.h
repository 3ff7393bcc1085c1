// 8x8 simdgroup_matrix fragments for attention: loads with dtype conversion, and reductions over
// the rows a lane holds.
//
// Apple's layout of simdgroup_matrix<T, 8, 8>: lane l holds row fa_frag_row(l) at columns
// fa_frag_col(l) and fa_frag_col(l) + 1, as thread_elements()[0] and [1]. Lanes {l, l^1, l^8, l^9}
// hold the same row, so a row reduction is two shuffle-xor steps (by 1 and by 8).
//
// Accumulators (scores, probabilities, outputs, gradients) are float fragments whatever the input
// dtype (SDPA accumulates half types in float32 too). Operand fragments, the inputs a kernel keeps in
// registers for its whole run (Q, dO; K, V in dK/dV) and the tile fragments they multiply, are
// fa_operand_frag<T>: half for half inputs, which halves their registers at no cost in accuracy
// (a half holds the input exactly, the product of two halves is exact in float32, and
// simdgroup_multiply_accumulate takes half operands with a float accumulator: Dawn exposes that
// f16-input, f32-result configuration on Metal). Bfloat for bfloat inputs where the GPU computes
// in bfloat (FA_BFLOAT_FRAGMENTS below; a bfloat product is exact in float32 too), float for float
// inputs and for bfloat on Apple7/8, which emulate bfloat through float. Products with a float fragment on the left
// (P V, dS K, ...) load their tile fragments as operand fragments too: a float A times a half B
// into a float accumulator (llama.cpp's matrix kernels multiply half by float the same way), so the
// tile's elements are not converted on every load and the product is the same (a half is exact in
// float).
#ifndef FA_FRAGMENTS_H
#define FA_FRAGMENTS_H

#include <metal_stdlib>

typedef metal::simdgroup_matrix<float, 8, 8> fa_frag;

template <typename T>
struct fa_operand {
  typedef float type;
};
template <>
struct fa_operand<half> {
  typedef half type;
};
#if FA_BFLOAT_FRAGMENTS
// bfloat inputs on GPUs with bfloat arithmetic (Apple9+: the planner sets the macro by GPU family,
// fa_plan_forward.c): exact as half is for half, with half the registers of float fragments.
template <>
struct fa_operand<bfloat> {
  typedef bfloat type;
};
#endif
template <typename T>
using fa_operand_frag = metal::simdgroup_matrix<typename fa_operand<T>::type, 8, 8>;

// Where a lane's two elements sit inside any 8x8 fragment: x = first column, y = row.
inline ushort2 fa_frag_coord(ushort lane) {
  return ushort2(((lane / 8) % 2) * 4 + (lane % 2) * 2, (lane / 16) * 4 + (lane / 2) % 4);
}

inline void fa_frag_fill(thread fa_frag &f, float value) {
  f = metal::make_filled_simdgroup_matrix<float, 8, 8>(value);
}

// Fragment (r, c) = tile[(row0 + r) * pitch + col0 + c], converted to the fragment's element type E.
template <typename E, typename T>
inline void fa_frag_load(
    thread metal::simdgroup_matrix<E, 8, 8> &f, const threadgroup T *tile, int pitch, int row0, int col0, ushort2 at) {
  const threadgroup T *p = tile + (row0 + at.y) * pitch + col0 + at.x;
  f.thread_elements()[0] = static_cast<E>(p[0]);
  f.thread_elements()[1] = static_cast<E>(p[1]);
}

// Fragment (r, c) = tile[(col0 + c) * pitch + row0 + r]: the transpose of a row-major tile.
template <typename E, typename T>
inline void fa_frag_load_transposed(
    thread metal::simdgroup_matrix<E, 8, 8> &f, const threadgroup T *tile, int pitch, int row0, int col0, ushort2 at) {
  const threadgroup T *p = tile + (col0 + at.x) * pitch + row0 + at.y;
  f.thread_elements()[0] = static_cast<E>(p[0]);
  f.thread_elements()[1] = static_cast<E>(p[pitch]);
}

// The N fragments of an 8-row block along one row of device memory: the lane's row (its
// columns 8 d + at.x and + 1 of fragment d), zeros past valid_cols or for a row outside the
// matrix (row_valid false: nothing is read).
template <typename T, int N, typename E>
inline void fa_frags_load_row(thread metal::simdgroup_matrix<E, 8, 8> *f,
                              const device T *row,
                              long col_stride,
                              bool row_valid,
                              int valid_cols,
                              ushort2 at) {
  for (int d = 0; d < N; ++d) {
    for (int e = 0; e < 2; ++e) {
      const int col = 8 * d + at.x + e;
      f[d].thread_elements()[e] = row_valid && col < valid_cols ? static_cast<E>(row[col * col_stride]) : E(0);
    }
  }
}

// Multiplies the lane's elements of N fragments by factor (the base-2 scale of fresh scores).
template <int N>
inline void fa_frags_scale(thread fa_frag *f, float factor) {
  for (int j = 0; j < N; ++j) {
    f[j].thread_elements()[0] *= factor;
    f[j].thread_elements()[1] *= factor;
  }
}

// The reverse: the lane's row of N fragments times factor into device memory, columns below
// valid_cols only (the caller skips rows outside the matrix).
template <typename T, int N>
inline void
fa_frags_store_row(const thread fa_frag *f, device T *row, long col_stride, int valid_cols, float factor, ushort2 at) {
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
// Only the first `slices` 8-wide slices of the head dim hold data (the rest pad E up to the
// specialisation's width and are zero): the others are skipped, so a padded width costs registers
// but no matrix work. The head dim is walked outside and the accumulators inside, so consecutive
// MMAs go to different accumulators (an MMA's latency is about twice its issue interval) where one
// accumulator per slice would chain ND dependent ones; each acc[j] still sums its slices in
// ascending d, so the results are the same bits.
template <typename T, int ND, int NB, typename E>
inline void fa_frags_multiply_transposed(thread fa_frag *acc,
                                         thread metal::simdgroup_matrix<E, 8, 8> *a,
                                         const threadgroup T *tile,
                                         int pitch,
                                         int slices,
                                         ushort2 at) {
  for (int d = 0; d < ND; ++d) {
    if (d < slices) {
      for (int j = 0; j < NB; ++j) {
        metal::simdgroup_matrix<E, 8, 8> b;
        fa_frag_load_transposed(b, tile, pitch, 8 * d, 8 * j, at);
        metal::simdgroup_multiply_accumulate(acc[j], a[d], b, acc[j]);
      }
    }
  }
}

// acc[d] += A B[:, 8 d .. 8 d + 7] for d < min(ND, slices): A is one 8-row block as NA fragments
// (8 x 8 NA), B the first 8 NA rows of a row-major tile, loaded as operand fragments (see above).
// P V in the forward, dS K, P^T dO, dS^T Q backward. Output slices past `slices` are padding (never
// stored) and are skipped. As above, the inner loop runs over the accumulators (each still sums in
// ascending j).
template <typename T, int NA, int ND>
inline void fa_frags_multiply(
    thread fa_frag *acc, thread fa_frag *a, const threadgroup T *tile, int pitch, int slices, ushort2 at) {
  for (int j = 0; j < NA; ++j) {
    for (int d = 0; d < ND; ++d) {
      if (d < slices) {
        fa_operand_frag<T> b;
        fa_frag_load(b, tile, pitch, 8 * j, 8 * d, at);
        metal::simdgroup_multiply_accumulate(acc[d], a[j], b, acc[d]);
      }
    }
  }
}

// The number of 8-wide slices that hold a head dim of `dim` columns.
inline int fa_slices(int dim) { return (dim + 7) / 8; }

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
