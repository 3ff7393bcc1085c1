// Quantized K and V read in place: MLX's affine quantization per group of 2^group_shift
// consecutive columns of a row (csrc/fa_core.h, fa_options.k_bits). Element c of a row is
// scale[c >> group_shift] * q_c + bias[c >> group_shift], q_c the byte c (8 bits) or the low (c
// even) or high (c odd) nibble of byte c / 2 (4 bits), read through the data's strides in bytes;
// scales and biases are of the kernel's element type T, read through their own strides. The value
// is computed in float32 with one fma and rounded to T, as the Python layer's dequantize() does, so
// a kernel sees exactly the dequantized tensor and never a copy of it.
//
// A K or V operand is a fa_kv_source: its plain rows (fa_loader.h's cursor) when the function
// constant FA_FC_K_BITS (FA_FC_V_BITS) is 0, else three cursors over the same keys, one each for the
// bytes, the scales and the biases (paged and packed sequences address all three as they address
// plain rows). The tile loads (fa_load_tile below, for the prefill kernel and the head-dim blocks)
// and the decode kernel's row loads (fa_decode.h) read through it.
#ifndef FA_QUANT_H
#define FA_QUANT_H

#include <metal_stdlib>
#include "fa_loader.h"
#include "fa_params.h"

constant int fa_k_bits [[function_constant(FA_FC_K_BITS)]];
constant int fa_v_bits [[function_constant(FA_FC_V_BITS)]];

template <typename T>
struct fa_kv_source {
  fa_tile_rows<T> rows;     // not quantized: the operand's rows
  fa_tile_rows<uchar> data; // quantized: its bytes
  fa_tile_rows<T> scales;   // and each group's scale and bias
  fa_tile_rows<T> biases;
  int bits;        // 0, 8 or 4
  int group_shift; // log2 of the group size
  int col0;        // the first logical column (fa_tile_columns)
};

// The K/V cursor of fa_kv_tiles (fa_loader.h) for an operand quantized to `bits` (0: not), its
// scales' and biases' cursors walking the same keys.
template <typename T>
inline fa_kv_source<T> fa_kv_source_of(const device T *view,
                                       const device T *scales,
                                       const device T *biases,
                                       int bits,
                                       int group_shift,
                                       constant fa_params &p,
                                       constant fa_i64 *strides,
                                       constant fa_i64 *scale_strides,
                                       constant fa_i64 *bias_strides,
                                       const device int *block_table,
                                       long b,
                                       long kv_h,
                                       int first_key,
                                       int tile_rows) {
  fa_kv_source<T> s;
  s.bits = bits;
  s.group_shift = group_shift;
  s.col0 = 0;
  s.rows = fa_kv_tiles(view, p, strides, block_table, b, kv_h, first_key, tile_rows);
  s.data = fa_kv_tiles((const device uchar *)view, p, strides, block_table, b, kv_h, first_key, tile_rows);
  s.scales = fa_kv_tiles(scales, p, scale_strides, block_table, b, kv_h, first_key, tile_rows);
  s.biases = fa_kv_tiles(biases, p, bias_strides, block_table, b, kv_h, first_key, tile_rows);
  return s;
}

// One quantized row: where its bytes, scales and biases are.
template <typename T>
struct fa_quant_row {
  const device uchar *data;
  const device T *scales;
  const device T *biases;
  long data_col_stride, scale_col_stride, bias_col_stride;
  int bits;
  int group_shift;
};

// Row r of a quantized source.
template <typename T>
inline fa_quant_row<T> fa_quant_row_of(fa_kv_source<T> s, int r) {
  fa_quant_row<T> row = {fa_tile_row(s.data, r),
                         fa_tile_row(s.scales, r),
                         fa_tile_row(s.biases, r),
                         s.data.col_stride,
                         s.scales.col_stride,
                         s.biases.col_stride,
                         s.bits,
                         s.group_shift};
  return row;
}

// Logical column `col` of a quantized row, dequantized (see the top of this file).
template <typename T>
inline T fa_dequantize(fa_quant_row<T> row, int col) {
  uint q;
  if (row.bits == 8) {
    q = row.data[long(col) * row.data_col_stride];
  } else {
    const uint byte = row.data[long(col >> 1) * row.data_col_stride];
    q = (col & 1) != 0 ? byte >> 4 : byte & 0xFu;
  }
  const long group = long(col >> row.group_shift);
  return T(metal::fma(float(row.scales[group * row.scale_col_stride]), float(q),
                      float(row.biases[group * row.bias_col_stride])));
}

// The same source from column col0 on.
template <typename T>
inline fa_kv_source<T> fa_tile_columns(fa_kv_source<T> s, int col0) {
  s.rows = fa_tile_columns(s.rows, col0);
  s.col0 += col0;
  return s;
}

// The next tile of keys.
template <typename T>
inline void fa_tile_advance(thread fa_kv_source<T> &s) {
  if (s.bits == 0) {
    fa_tile_advance(s.rows);
  } else {
    fa_tile_advance(s.data);
    fa_tile_advance(s.scales);
    fa_tile_advance(s.biases);
  }
}

// fa_load_tile (fa_loader.h) of a K/V source: plain rows take the planner's path; quantized ones
// are dequantized into the tile, each thread taking FA_TILE_VEC consecutive columns of one row at a
// time (one row lookup per chunk, through the block table of a paged cache).
template <typename T, int ROWS, int COLS, int THREADS>
inline void
fa_load_tile(threadgroup T *tile, int pitch, fa_kv_source<T> src, int valid_rows, int valid_cols, uint tid) {
  if (src.bits == 0) {
    fa_load_tile<T, ROWS, COLS, THREADS>(tile, pitch, src.rows, valid_rows, valid_cols, tid);
    return;
  }
  constexpr int ROW_CHUNKS = COLS / FA_TILE_VEC;
  for (int i = int(tid); i < ROWS * ROW_CHUNKS; i += THREADS) {
    const int r = i / ROW_CHUNKS;
    const int c = i % ROW_CHUNKS * FA_TILE_VEC;
    threadgroup T *dst = tile + r * pitch + c;
    if (r < valid_rows && c < valid_cols) {
      const fa_quant_row<T> row = fa_quant_row_of(src, r);
      for (int w = 0; w < FA_TILE_VEC; ++w) {
        dst[w] = c + w < valid_cols ? fa_dequantize(row, src.col0 + c + w) : T(0);
      }
    } else {
      for (int w = 0; w < FA_TILE_VEC; ++w) {
        dst[w] = T(0);
      }
    }
  }
}

#endif
