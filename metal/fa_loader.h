// Cooperative tile loads: every thread of the threadgroup moves a share of a (rows x cols) block
// from strided device memory into a row-major threadgroup tile. Rows and columns past the valid
// extent are written as zeros, so partial tiles need no special case in the MMA loops (their
// scores are masked separately).
#ifndef FA_LOADER_H
#define FA_LOADER_H

#include <metal_stdlib>

// Threadgroup tiles get 8 spare elements per row, which keeps rows 16-byte aligned and staggers them
// across memory banks.
#define FA_TILE_PAD 8

// tile[r * pitch + c] = src[r * row_stride + c * col_stride] for r < valid_rows, c < valid_cols;
// 0 elsewhere in the ROWS x COLS block. 64-bit offsets: strides of large views overflow 32 bits.
template <typename T, int ROWS, int COLS, int THREADS>
inline void fa_load_tile(threadgroup T *tile, int pitch, const device T *src, long row_stride,
                         long col_stride, int valid_rows, int valid_cols, uint tid) {
  for (int i = int(tid); i < ROWS * COLS; i += THREADS) {
    const int r = i / COLS;
    const int c = i % COLS;
    tile[r * pitch + c] = (r < valid_rows && c < valid_cols) ? src[r * row_stride + c * col_stride] : T(0);
  }
}

#endif
