// Cooperative tile loads: every thread of the threadgroup moves a share of a (ROWS x COLS) block
// from device memory into a row-major threadgroup tile. Rows and columns past the valid extent are
// written as zeros, so partial tiles need no special case in the MMA loops (their scores are masked
// separately).
//
// Two paths, fixed per pipeline by the function constant fa_contiguous_tiles:
//   - contiguous: unit column stride, rows starting on FA_TILE_VEC-element boundaries, valid_cols a
//     multiple of FA_TILE_VEC and every in-tile offset within 32 bits (the planner checks all of
//     it, fa_plan_forward.c). Each access moves FA_TILE_VEC elements with one vector load and one vector
//     store; a thread's 32-bit offsets advance by constants (no division, no multiply per access)
//     and bounds are tested only in the ragged last tile or a padded head dim;
//   - strided: any other view (a strided head dim, unaligned offsets, odd head dims), element by
//     element through 64-bit strides.
// A tile's rows come from a fa_tile_rows source: rows a fixed stride apart, or, for the keys and
// values of a paged cache (FA_FC_PAGED), each row through the sequence's block table. The K/V
// tile cursor (fa_kv_tiles) is how the forward, dQ and decode kernels walk the keys.
#ifndef FA_LOADER_H
#define FA_LOADER_H

#include <metal_stdlib>
#include "fa_params.h"
#include "fa_sequence.h"

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
inline void fa_load_tile_strided(threadgroup T *tile,
                                 int pitch,
                                 const device T *src,
                                 long row_stride,
                                 long col_stride,
                                 int valid_rows,
                                 int valid_cols,
                                 uint tid) {
  for (int i = int(tid); i < ROWS * COLS; i += THREADS) {
    const int r = i / COLS;
    const int c = i % COLS;
    tile[r * pitch + c] = (r < valid_rows && c < valid_cols) ? T(src[r * row_stride + c * col_stride]) : T(0);
  }
}

// The same for a contiguous view (see above): thread tid moves vectors tid, tid + THREADS, ... of
// the block, each FA_TILE_VEC elements of one row.
template <typename T, int ROWS, int COLS, int THREADS>
inline void fa_load_tile_contiguous(
    threadgroup T *tile, int pitch, const device T *src, int row_stride, int valid_rows, int valid_cols, uint tid) {
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

// Where the rows of a tile are. Plain: row r at src + r * row_stride. Paged (only with
// FA_FC_PAGED, so every paged branch folds away in other pipelines): row r is cache position
// position + r of the sequence, row position % page_size of page pages[position / page_size],
// src being the pool's origin for the head and first column; entries are clamped into the table's
// columns and the pool, never trusted. `step` is what one fa_tile_advance moves: elements (plain)
// or positions (paged).
template <typename T>
struct fa_tile_rows {
  const device T *src;
  long row_stride;
  long col_stride;
  long step;
  bool paged;
  const device int *pages; // the sequence's row of the block table
  long page_stride;
  int position;
  int page_size;
  int last_column; // the table's columns - 1
  int last_page;   // the pool's pages - 1
};

// A plain source: rows row_stride apart from src.
template <typename T>
inline fa_tile_rows<T> fa_rows(const device T *src, long row_stride, long col_stride) {
  fa_tile_rows<T> rows = {src, row_stride, col_stride, 0, false, nullptr, 0, 0, 1, 0, 0};
  return rows;
}

// The K/V tile cursor: key first_key (of the sequence, with sequences) of kv head kv_h of batch b
// in `view` (k or v, `strides` its own), advancing `tile_rows` keys at a time; through the block
// table under FA_FC_PAGED.
template <typename T>
inline fa_tile_rows<T> fa_kv_tiles(const device T *view,
                                   constant fa_params &p,
                                   constant fa_i64 *strides,
                                   const device int *block_table,
                                   long b,
                                   long kv_h,
                                   int first_key,
                                   int tile_rows) {
  if (fa_paged) {
    fa_tile_rows<T> rows = {view + kv_h * strides[1],
                            strides[2],
                            strides[3],
                            tile_rows,
                            true,
                            block_table + b * p.pages_per_sequence,
                            strides[0],
                            p.seq_k_row0 + first_key,
                            p.page_size,
                            p.pages_per_sequence - 1,
                            p.page_count - 1};
    return rows;
  }
  fa_tile_rows<T> rows =
      fa_rows(fa_sequence_k(view, p, b, strides) + b * strides[0] + kv_h * strides[1] + long(first_key) * strides[2],
              strides[2], strides[3]);
  rows.step = long(tile_rows) * strides[2];
  return rows;
}

// Row r of the source.
template <typename T>
inline const device T *fa_tile_row(fa_tile_rows<T> rows, int r) {
  if (fa_paged && rows.paged) {
    const int position = rows.position + r;
    const int column = fa_sequence_clamp(position / rows.page_size, 0, rows.last_column);
    const int page = fa_sequence_clamp(rows.pages[column], 0, rows.last_page);
    return rows.src + long(page) * rows.page_stride + long(position % rows.page_size) * rows.row_stride;
  }
  return rows.src + long(r) * rows.row_stride;
}

// The same rows from column col0 on.
template <typename T>
inline fa_tile_rows<T> fa_tile_columns(fa_tile_rows<T> rows, int col0) {
  rows.src += long(col0) * rows.col_stride;
  return rows;
}

// The next tile: a pointer step, or (paged) the next positions.
template <typename T>
inline void fa_tile_advance(thread fa_tile_rows<T> &rows) {
  if (fa_paged && rows.paged) {
    rows.position += int(rows.step);
  } else {
    rows.src += rows.step;
  }
}

// A paged tile (FA_FC_PAGED) that straddles pages: each access finds its row's page (a division
// and a read of the table, cached), as vectors where the planner chose the contiguous path (every
// row start of the pool is then aligned), else element by element.
template <typename T, int ROWS, int COLS, int THREADS>
inline void
fa_load_tile_paged(threadgroup T *tile, int pitch, fa_tile_rows<T> src, int valid_rows, int valid_cols, uint tid) {
  if (fa_contiguous_tiles) {
    typedef metal::vec<T, FA_TILE_VEC> tile_vec;
    constexpr int ROW_VECTORS = COLS / FA_TILE_VEC;
    for (int i = int(tid); i < ROWS * ROW_VECTORS; i += THREADS) {
      const int r = i / ROW_VECTORS;
      const int c = i % ROW_VECTORS * FA_TILE_VEC;
      tile_vec x = tile_vec(T(0));
      if (r < valid_rows && c < valid_cols) {
        x = *(const device tile_vec *)(fa_tile_row(src, r) + c);
      }
      *(threadgroup tile_vec *)(tile + r * pitch + c) = x;
    }
  } else {
    for (int i = int(tid); i < ROWS * COLS; i += THREADS) {
      const int r = i / COLS;
      const int c = i % COLS;
      tile[r * pitch + c] = (r < valid_rows && c < valid_cols) ? T(fa_tile_row(src, r)[c * src.col_stride]) : T(0);
    }
  }
}

// The tile load every kernel calls: the path the planner chose for this pipeline. A paged tile
// whose valid rows lie in one page (every tile when pages are multiples of the tile's rows and the
// walk starts on a page boundary) is rows a stride apart from its first: the plain paths, after
// one division per tile (uniform over the threadgroup).
template <typename T, int ROWS, int COLS, int THREADS>
inline void
fa_load_tile(threadgroup T *tile, int pitch, fa_tile_rows<T> src, int valid_rows, int valid_cols, uint tid) {
  if (fa_paged && src.paged) {
    if (src.position % src.page_size + valid_rows > src.page_size) {
      fa_load_tile_paged<T, ROWS, COLS, THREADS>(tile, pitch, src, valid_rows, valid_cols, tid);
      return;
    }
    src = fa_rows(fa_tile_row(src, 0), src.row_stride, src.col_stride);
  }
  if (fa_contiguous_tiles) {
    fa_load_tile_contiguous<T, ROWS, COLS, THREADS>(tile, pitch, src.src, int(src.row_stride), valid_rows, valid_cols,
                                                    tid);
  } else {
    fa_load_tile_strided<T, ROWS, COLS, THREADS>(tile, pitch, src.src, src.row_stride, src.col_stride, valid_rows,
                                                 valid_cols, tid);
  }
}

#endif
