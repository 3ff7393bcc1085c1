// Cooperative tile loads: every thread of the threadgroup moves a share of a (ROWS x COLS) block
// from device memory into a row-major threadgroup tile. Rows and columns past the valid extent are
// written as zeros, so partial tiles need no special case in the MMA loops (their scores are masked
// separately).
//
// Two paths, fixed per pipeline by the function constant fa_contiguous_tiles:
//   - contiguous: unit column stride, rows starting on FA_TILE_VEC-element boundaries, valid_cols a
//     multiple of FA_TILE_VEC and every in-tile offset within 32 bits (the planner checks all of
//     it, fa_plan.c). Each access moves FA_TILE_VEC elements with one vector load and one vector
//     store; a thread's 32-bit offsets advance by constants (no division, no multiply per access)
//     and bounds are tested only in the ragged last tile or a padded head dim;
//   - strided: any other view (a strided head dim, unaligned offsets, odd head dims), element by
//     element through 64-bit strides.
#ifndef FA_LOADER_H
#define FA_LOADER_H

#include <metal_stdlib>
#include "fa_params.h"

// Threadgroup tiles get 8 spare elements per row, which keeps rows 16-byte aligned and staggers them
// across memory banks.
#define FA_TILE_PAD 8

// Threadgroup storage for a tile of N elements of T, aligned for the contiguous path's vector
// stores (declare `threadgroup fa_tile_storage<T> name[fa_tile_vectors(N)]`).
template <typename T>
using fa_tile_storage = metal::vec<T, FA_TILE_VEC>;

constexpr int fa_tile_vectors(int elements) { return (elements + FA_TILE_VEC - 1) / FA_TILE_VEC; }

// tile[r * pitch + c] = src[r * row_stride + c * col_stride] for r < valid_rows, c < valid_cols;
// 0 elsewhere in the ROWS x COLS block. 64-bit offsets: strides of large views overflow 32 bits.
template <typename T, int ROWS, int COLS, int THREADS>
inline void fa_load_tile_strided(threadgroup T *tile, int pitch, const device T *src, long row_stride,
                                 long col_stride, int valid_rows, int valid_cols, uint tid) {
  for (int i = int(tid); i < ROWS * COLS; i += THREADS) {
    const int r = i / COLS;
    const int c = i % COLS;
    tile[r * pitch + c] = (r < valid_rows && c < valid_cols) ? T(src[r * row_stride + c * col_stride]) : T(0);
  }
}

// The same for a contiguous view (see above): thread tid moves vectors tid, tid + THREADS, ... of
// the block, each FA_TILE_VEC elements of one row.
template <typename T, int ROWS, int COLS, int THREADS>
inline void fa_load_tile_contiguous(threadgroup T *tile, int pitch, const device T *src, int row_stride,
                                    int valid_rows, int valid_cols, uint tid) {
  typedef metal::vec<T, FA_TILE_VEC> tile_vec;
  constexpr int ROW_VECTORS = COLS / FA_TILE_VEC;
  constexpr int VECTORS = ROWS * ROW_VECTORS;
  constexpr int ROW_STEP = THREADS / ROW_VECTORS; // what a thread advances by between its accesses
  constexpr int COL_STEP = THREADS % ROW_VECTORS * FA_TILE_VEC;
  static_assert(COLS % FA_TILE_VEC == 0, "tile widths are multiples of 8");
  const bool partial = valid_rows < ROWS || valid_cols < COLS;
  int r = int(tid) / ROW_VECTORS;
  int c = int(tid) % ROW_VECTORS * FA_TILE_VEC;
  int src_offset = r * row_stride + c;
  int tile_offset = r * pitch + c;
  const int src_step = ROW_STEP * row_stride + COL_STEP;
  const int tile_step = ROW_STEP * pitch + COL_STEP;
  for (int i = int(tid); i < VECTORS; i += THREADS) {
    tile_vec x = tile_vec(T(0));
    if (!partial || (r < valid_rows && c < valid_cols)) {
      x = *(const device tile_vec *)(src + src_offset);
    }
    *(threadgroup tile_vec *)(tile + tile_offset) = x;
    r += ROW_STEP;
    c += COL_STEP;
    src_offset += src_step;
    tile_offset += tile_step;
    if (COL_STEP != 0 && c >= COLS) { // wrapped into the next row
      c -= COLS;
      r += 1;
      src_offset += row_stride - COLS;
      tile_offset += pitch - COLS;
    }
  }
}

// The tile load every kernel calls: the path the planner chose for this pipeline.
template <typename T, int ROWS, int COLS, int THREADS>
inline void fa_load_tile(threadgroup T *tile, int pitch, const device T *src, long row_stride, long col_stride,
                         int valid_rows, int valid_cols, uint tid) {
  if (fa_contiguous_tiles) {
    fa_load_tile_contiguous<T, ROWS, COLS, THREADS>(tile, pitch, src, int(row_stride), valid_rows, valid_cols, tid);
  } else {
    fa_load_tile_strided<T, ROWS, COLS, THREADS>(tile, pitch, src, row_stride, col_stride, valid_rows, valid_cols,
                                                 tid);
  }
}

#endif
