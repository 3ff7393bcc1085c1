// Head dims wider than a kernel's tiles: blocking along D (fa_plan_forward.c has the table and the
// register budget of each configuration).
//
// The tiled kernels (forward, dQ, dK/dV) are specialised for widths BD (E side) and BDV (Ev side)
// of at most 256. A head dim up to the width is resident: its operand fragments (Q, dO, or K, V)
// load into registers once and its tiles hold every column. A wider one is handled in blocks of the
// width, decided at run time from the dims (uniform over the threadgroup):
//   - products over the head dim (S = Q K^T, dP = dO V^T and their transposes) accumulate block by
//     block: fa_frags_multiply_streamed loads one block of the tile and of the lane's operand row
//     (into the kernel's operand fragments, so blocking costs no registers) per pass;
//   - accumulators (O, dQ, dK, dV) hold one block of their columns: the grid's head axis carries a
//     column block per threadgroup (fa_column_block), which recomputes the scores of its rows
//     (and reloads its own block of the streamed tile for the product, fa_keep_head_block).
//     metal-flash-attention instead round-trips uncached accumulators through memory at these
//     dims; recomputing keeps every threadgroup's writes its own and no accumulator goes through
//     memory, for 2x (forward, Ev = 512) to 6x (backward, 576 in fp32) the score products and the
//     reads of their operands.
#ifndef FA_HEAD_BLOCKS_H
#define FA_HEAD_BLOCKS_H

#include <metal_stdlib>
#include "fa_fragments.h"
#include "fa_loader.h"

// A head dim as a tiled kernel of width W (BD or BDV) reads it: W itself when the planner says the
// head dims equal the widths (FA_FC_EXACT_HEAD_DIMS, the common D = 64 and 128), so every guard
// against it (empty slices, ragged columns, the streamed path, column blocks) is a compile-time
// constant and folds away; the run-time value otherwise.
template <int W>
inline int fa_head_dim(int dim) {
  return fa_exact_head_dims ? W : dim;
}

// Blocks of `width` columns that cover `dim` (at least one, so an empty head dim makes one pass).
inline int fa_head_blocks(int dim, int width) { return metal::max(1, (dim + width - 1) / width); }

// The head a threadgroup of a grid with `blocks` column blocks per head serves, and its block.
struct fa_column_block {
  long head;
  int block;
};

inline fa_column_block fa_column_block_of(long grid_head, int blocks) {
  fa_column_block at = {grid_head / blocks, int(grid_head % blocks)};
  return at;
}

// acc[j] += A B_j^T over a head dim of `dim` columns in blocks of BW: A is the lane's row
// (`a_row`, read into a_frag block by block, zeros for rows outside the matrix), B the (NB * 8 x
// dim) rows of `b_rows` (fa_loader.h's rows, or a K/V source: fa_quant.h) streamed block by block through `tile` (pitch BW +
// FA_TILE_PAD). Blocks and their slices run in column order, so every score sums its 8-wide slices in the order of the
// resident path whatever the block width: the backward's recomputed scores are the forward's to
// the bit, which the probabilities exp2(S - lse) rely on. Every thread of the threadgroup must call
// it (it synchronises); `compute` false (a blocked tile) only loads. The caller has synchronised
// since the tile was last read; the tile holds the last block afterwards.
template <typename T, int BW, int NB, int THREADS, typename E, typename Rows>
inline void fa_frags_multiply_streamed(thread fa_frag *acc,
                                       thread metal::simdgroup_matrix<E, 8, 8> *a_frag,
                                       const device T *a_row,
                                       long a_col_stride,
                                       bool a_valid,
                                       threadgroup T *tile,
                                       Rows b_rows,
                                       int valid_b_rows,
                                       int dim,
                                       bool compute,
                                       uint tid,
                                       ushort2 at) {
  constexpr int PITCH = BW + FA_TILE_PAD;
  const int blocks = fa_head_blocks(dim, BW);
  for (int block = 0; block < blocks; ++block) {
    const int col0 = block * BW;
    const int cols = metal::min(BW, dim - col0);
    if (block > 0) {
      metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup); // the last block is read
    }
    fa_load_tile<T, 8 * NB, BW, THREADS>(tile, PITCH, fa_tile_columns(b_rows, col0), valid_b_rows, cols, tid);
    metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
    if (compute) {
      fa_frags_load_row<T, BW / 8>(a_frag, a_row + long(col0) * a_col_stride, a_col_stride, a_valid, cols, at);
      fa_frags_multiply_transposed<T, BW / 8, NB>(acc, a_frag, tile, PITCH, fa_slices(cols), at);
    }
  }
}

// The kernels' product over a head dim of any width: resident (dim <= BW), the operand fragments
// loaded once (fa_load_resident_row) times the tile loaded with the others (fa_load_resident_tile);
// wider, streamed as above. Every thread calls it (streaming synchronises).
template <typename T, int BW, int NB, int THREADS, typename E, typename Rows>
inline void fa_frags_multiply_head(thread fa_frag *acc,
                                   thread metal::simdgroup_matrix<E, 8, 8> *a_frag,
                                   const device T *a_row,
                                   long a_col_stride,
                                   bool a_valid,
                                   threadgroup T *tile,
                                   Rows b_rows,
                                   int valid_b_rows,
                                   int dim,
                                   bool compute,
                                   uint tid,
                                   ushort2 at) {
  if (dim > BW) {
    fa_frags_multiply_streamed<T, BW, NB, THREADS>(acc, a_frag, a_row, a_col_stride, a_valid, tile, b_rows,
                                                   valid_b_rows, dim, compute, tid, at);
  } else if (compute) {
    fa_frags_multiply_transposed<T, BW / 8, NB>(acc, a_frag, tile, BW + FA_TILE_PAD, fa_slices(dim), at);
  }
}

// A resident operand's fragments (dim <= 8 N), once per kernel; a streamed one's load per block.
template <typename T, int N, typename E>
inline void fa_load_resident_row(thread metal::simdgroup_matrix<E, 8, 8> *f,
                                 const device T *row,
                                 long col_stride,
                                 bool row_valid,
                                 int dim,
                                 ushort2 at) {
  if (dim <= 8 * N) {
    fa_frags_load_row<T, N>(f, row, col_stride, row_valid, dim, at);
  }
}

// A resident operand's whole tile (dim <= BW), per key or query tile before its barrier; a
// streamed one's tile loads per block.
template <typename T, int ROWS, int BW, int THREADS, typename Rows>
inline void fa_load_resident_tile(threadgroup T *tile, Rows src, int valid_rows, int dim, uint tid) {
  if (dim <= BW) {
    fa_load_tile<T, ROWS, BW, THREADS>(tile, BW + FA_TILE_PAD, src, valid_rows, dim, tid);
  }
}

// After fa_frags_multiply_streamed over `dim`: makes `tile` hold column block `block` (the
// caller's own accumulator block) for the product that follows, loading it unless it is the last
// block, which the tile holds already. Uniform over the threadgroup; every thread calls it.
template <typename T, int ROWS, int BW, int THREADS, typename Rows>
inline void fa_keep_head_block(threadgroup T *tile, Rows src, int valid_rows, int dim, int block, uint tid) {
  if (block == fa_head_blocks(dim, BW) - 1) {
    return;
  }
  const int col0 = block * BW;
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup); // the last block is read
  fa_load_tile<T, ROWS, BW, THREADS>(tile, BW + FA_TILE_PAD, fa_tile_columns(src, col0), valid_rows,
                                     metal::min(BW, dim - col0), tid);
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
}

#endif
