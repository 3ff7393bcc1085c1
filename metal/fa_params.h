// Kernel arguments shared by the C core (which fills them) and the Metal kernels (which read them
// as `constant fa_params&`). Plain fixed-size fields only, so C and MSL agree on the layout.
#ifndef FA_PARAMS_H
#define FA_PARAMS_H

#ifdef __METAL_VERSION__
typedef long fa_i64;
typedef int fa_i32;
typedef uint fa_u32;
#else
#include <stdint.h>
typedef int64_t fa_i64;
typedef int32_t fa_i32;
typedef uint32_t fa_u32;
#endif

// The simple kernel's geometry (fa_simple.metal).
#define FA_SIMPLE_ROWS_PER_GROUP 4 // query rows (SIMD-groups) per threadgroup
#define FA_SIMPLE_MAX_PER_LANE 18  // columns per lane: head dims up to 576 (DeepSeek's MLA E)

// The head dims every kernel takes, E and Ev alike (csrc/fa_plan_forward.c checks them).
#define FA_MAX_HEAD_DIM 576

// The decode kernel's geometry (fa_decode.metal).
#define FA_DECODE_SIMD_GROUPS 8 // SIMD-groups per threadgroup, taking turns over the keys
// A decode lane's registers (32-bit) for `rows` query rows of `cols` columns and batches of `keys`:
// per row its query slice, its accumulator and the batch's partial scores, beside a K or V row
// in flight each (csrc/fa_plan_forward.c); the budget the planner keeps them in.
#define FA_DECODE_LANE_FLOATS(cols, rows, keys) ((rows) * (2 * (cols) + (keys)) + 2 * (cols))
#define FA_DECODE_LANE_BUDGET 104
// Keys per batch: the largest power of two from 2 to 32 that the budget holds beside the rows.
#define FA_DECODE_FITS(cols, rows, keys) (FA_DECODE_LANE_FLOATS(cols, rows, keys) <= FA_DECODE_LANE_BUDGET)
#define FA_DECODE_KEYS(cols, rows)       \
  (FA_DECODE_FITS(cols, rows, 32)   ? 32 \
   : FA_DECODE_FITS(cols, rows, 16) ? 16 \
   : FA_DECODE_FITS(cols, rows, 8)  ? 8  \
   : FA_DECODE_FITS(cols, rows, 4)  ? 4  \
                                    : 2)

// Buffer slots, [[buffer(n)]] of the kernels and the host's bindings alike (csrc/fa_core.c's slot
// table, csrc/fa_forward.c, csrc/fa_backward.c). The forward kernels (prefill, decode and its
// merge, simple) share one numbering, the backward's three kernels another; a kernel declares only
// the slots it reads, the host binds every one (an absent tensor binds a stand-in).
#define FA_FORWARD_BUFFER_Q 0
#define FA_FORWARD_BUFFER_K 1
#define FA_FORWARD_BUFFER_V 2
#define FA_FORWARD_BUFFER_OUT 3
#define FA_FORWARD_BUFFER_LSE 4
#define FA_FORWARD_BUFFER_PARAMS 5    // fa_params, inline bytes
#define FA_FORWARD_BUFFER_WORKSPACE 6 // split-K partial results, or the probability pass's output
#define FA_FORWARD_BUFFER_MASK 7
#define FA_FORWARD_BUFFER_ALIBI 8
#define FA_FORWARD_BUFFER_SINKS 9
#define FA_FORWARD_BUFFER_SEQUENCES 10 // the per-sequence fa_params the table kernel wrote
#define FA_FORWARD_BUFFER_BLOCK_TABLE 11
#define FA_FORWARD_BUFFER_RNG 12
#define FA_FORWARD_BUFFER_K_SCALES 13 // quantized K/V's groups (FA_FC_K_BITS, FA_FC_V_BITS; fa_quant.h)
#define FA_FORWARD_BUFFER_K_BIASES 14
#define FA_FORWARD_BUFFER_V_SCALES 15
#define FA_FORWARD_BUFFER_V_BIASES 16
#define FA_FORWARD_BUFFERS 17

#define FA_BACKWARD_BUFFER_Q 0
#define FA_BACKWARD_BUFFER_K 1
#define FA_BACKWARD_BUFFER_V 2
#define FA_BACKWARD_BUFFER_OUT 3
#define FA_BACKWARD_BUFFER_DOUT 4
#define FA_BACKWARD_BUFFER_LSE 5
#define FA_BACKWARD_BUFFER_DELTA 6
#define FA_BACKWARD_BUFFER_DQ 7
#define FA_BACKWARD_BUFFER_DK 8
#define FA_BACKWARD_BUFFER_DV 9
#define FA_BACKWARD_BUFFER_PARAMS 10 // fa_backward_params, inline bytes
#define FA_BACKWARD_BUFFER_MASK 11
#define FA_BACKWARD_BUFFER_ALIBI 12
#define FA_BACKWARD_BUFFER_SINKS 13
#define FA_BACKWARD_BUFFER_SINK_GRAD 14
#define FA_BACKWARD_BUFFER_SEQUENCES 15
#define FA_BACKWARD_BUFFER_RNG 16
#define FA_BACKWARD_BUFFER_WORKSPACE 17 // the additive mask's block classes (fa_mask_blocks.h)
#define FA_BACKWARD_BUFFERS 18

// The sequence-table kernel's (fa_sequence.h): the (B, 6) table in, one fa_params per sequence
// out, the call's fa_params at the params slot of the forward's numbering.
#define FA_TABLE_BUFFER_ENTRIES 0
#define FA_TABLE_BUFFER_OUT 1
#define FA_TABLE_BUFFER_PARAMS 5
#define FA_TABLE_BUFFERS 6

// Function-constant indices (specialisation at pipeline creation).
#define FA_FC_BAND 0                // bool: each row sees only a band of keys (band_lo, band_hi below): causal, windows
#define FA_FC_WRITE_LSE 1           // bool: write the per-row log-sum-exp
#define FA_FC_MASK_KIND 2           // int, one of FA_MASK_*: how FA_FORWARD_BUFFER_MASK masks the scores
#define FA_FC_CONTIGUOUS_TILES 3    // bool: the tiled operands take the vector load path (fa_loader.h)
#define FA_FC_DECODE_VECTOR_LOADS 7 // bool: the decode kernel reads K and V rows as vectors (fa_decode.h)
#define FA_FC_SOFTCAP 8             // bool: scores are soft-capped (fa_variants.h)
#define FA_FC_ALIBI 9               // bool: ALiBi biases from per-(batch, head) slopes (fa_variants.h)
#define FA_FC_SINKS 10       // bool: attention sinks, one logit per query head in every row's softmax (fa_variants.h)
#define FA_FC_DROPOUT 11     // int, one of FA_DROPOUT_*: dropout of the probabilities (fa_dropout.h)
#define FA_FC_SEQUENCES 12   // bool: each batch entry is a sequence of its own lengths and start (fa_sequence.h)
#define FA_FC_PAGED 13       // bool: with sequences, keys are read through a block table (paged KV; fa_sequence.h)
#define FA_FC_K_BITS 14      // int: 0, or K is quantized to 8 or 4 bits and dequantized as it is read (fa_quant.h)
#define FA_FC_V_BITS 15      // int: the same for V
#define FA_FC_MASK_BLOCKS 20 // bool: the prefill forward reads the additive mask's block classes (fa_mask_blocks.h)
#define FA_FC_EXACT_HEAD_DIMS 21 // bool: E and Ev equal the tiled kernels' widths BD and BDV (fa_head_blocks.h)

// Elements per access of the contiguous tile loads (fa_loader.h): the planner takes that path only
// for views whose rows start on multiples of it (8 bytes of half, 16 of float).
#define FA_TILE_VEC 4

#define FA_MASK_NONE 0
#define FA_MASK_BOOL 1   // bytes, nonzero = takes part; others get score -inf
#define FA_MASK_FLOAT 2  // float32, added to the scaled scores
#define FA_MASK_HALF 3   // float16, added
#define FA_MASK_BFLOAT 4 // bfloat16, added

#define FA_DROPOUT_NONE 0  // no dropout
#define FA_DROPOUT_APPLY 1 // probabilities dropped (and kept ones scaled) in what the kernel accumulates
// The simple kernel writes each probability (negated where dropped) instead of attention:
// flash-attn's return_attn_probs.
#define FA_DROPOUT_PROBS 2
// Dropout's generator state, a buffer of this many 32-bit words (FA_FORWARD_BUFFER_RNG,
// FA_BACKWARD_BUFFER_RNG): seed low, high, offset low, high.
#define FA_DROPOUT_RNG_WORDS 4

typedef struct fa_params {
  fa_i32 batch;      // B
  fa_i32 q_heads;    // Hq
  fa_i32 kv_heads;   // Hkv
  fa_i32 gqa_factor; // Hq / Hkv: query head h reads kv head h / gqa_factor
  fa_i32 q_len;      // L
  fa_i32 kv_len;     // S
  fa_i32 head_dim;   // E (q and k)
  fa_i32 v_head_dim; // Ev (v and out)
  // Strides in elements, in (batch, head, row, column) order. 64-bit: views of large tensors
  // overflow 32-bit offsets.
  fa_i64 q_strides[4];
  fa_i64 k_strides[4];
  fa_i64 v_strides[4];
  fa_i64 o_strides[4];
  fa_i64 lse_strides[3]; // (batch, head, row) of the float32 log-sum-exp
  float scale_log2;      // scale * log2(e): scores live in base 2 so softmax uses exp2
  float softcap_log2;    // softcap * log2(e) under FA_FC_SOFTCAP (fa_variants.h)
  // Split-K of the decode kernel: each row's keys are shared by split_count threadgroups,
  // split_keys keys each. With more than one, partial results go to the workspace (layout in
  // fa_decode.h) and fa_decode_merge combines them.
  fa_i32 split_count;
  fa_i32 split_keys;
  fa_i64 split_stats_offset; // floats from the workspace start to the partial (max, sum) pairs
  fa_i64 mask_strides[4];    // (batch, head, row, key) of the attn_mask view; 0 where broadcast
  // Under FA_FC_BAND row i sees the keys j with i + band_lo <= j <= i + band_hi (and j < S): the
  // causal masks (top-left: band_hi = 0; bottom-right: S - L) and sliding windows (fa_plan_forward.c). The
  // planner keeps both in [-L, S], so i + either fits 32 bits.
  fa_i32 band_lo;
  fa_i32 band_hi;
  fa_i32 split_begin;      // decode split-K: the first key of split 0 (the band's first key of any row)
  fa_i32 diagonal;         // row i's diagonal key is i + diagonal (0 top-left, S - L bottom-right): ALiBi's origin
  fa_i64 alibi_strides[2]; // (batch, head) of the float32 slopes under FA_FC_ALIBI; batch 0 for (H,) slopes
  // Dropout under FA_FC_DROPOUT (fa_dropout.h): a probability whose random word is below
  // dropout_drop_below = round(p * 2^32) is dropped, kept ones are multiplied by dropout_scale =
  // 1 / (1 - p). p = 1 stores 2^32 - 1 and scale 0: nothing contributes.
  fa_u32 dropout_drop_below;
  float dropout_scale;
  // Attention sinks: under FA_FC_SINKS, FA_FORWARD_BUFFER_SINKS holds the float32 sink logit of each query head.
  fa_i64 sink_stride; // elements between heads' sinks
  // Packed sequences and KV caches under FA_FC_SEQUENCES (fa_sequence.h). The planner fills the
  // first eight from the views and options; fa_sequence_table writes one copy of these params per
  // sequence with its own q_len, kv_len, band, diagonal, split_begin and the last four.
  fa_i32 seq_q_batches; // q's view (batches, rows): every table entry is clamped into it
  fa_i32 seq_q_rows;
  fa_i32 seq_k_batches; // k's and v's
  fa_i32 seq_k_rows;
  fa_i32 seq_window_left; // the band around each sequence's diagonal: -1 unbounded (right 0 under causal)
  fa_i32 seq_window_right;
  fa_i32 seq_bottom_right; // diagonal key of row i: i + S_b - L_b (flash-attn's), else i
  fa_i32 seq_grid_q_len;   // max_seqlen_q: the rows the grid and the split workspace are sized for
  fa_i32 seq_q_batch;      // this sequence's rows: q[seq_q_batch, :, seq_q_row0 + i]
  fa_i32 seq_q_row0;
  fa_i32 seq_k_batch; // its keys: k[seq_k_batch, :, seq_k_row0 + j]
  fa_i32 seq_k_row0;
  // Paged KV under FA_FC_PAGED: key position t of sequence b is row t % page_size of page
  // block_table[b][t / page_size] of k's view (pages, Hkv, page_size, E).
  fa_i32 page_size;
  fa_i32 pages_per_sequence; // the block table's columns
  fa_i32 page_count;         // pages in the pool: table entries are clamped into it
  fa_i32 page_pad;
  // Quantized K/V under FA_FC_K_BITS / FA_FC_V_BITS (fa_quant.h): k_strides (v_strides) are then in
  // bytes of the uint8 data, these the strides of each group's scale and bias (q's dtype), and a
  // row's element c belongs to group c >> group_shift.
  fa_i64 k_scale_strides[4];
  fa_i64 k_bias_strides[4];
  fa_i64 v_scale_strides[4];
  fa_i64 v_bias_strides[4];
  fa_i32 k_group_shift;
  fa_i32 v_group_shift;
  // The additive mask's block classes under FA_FC_MASK_BLOCKS (fa_mask_blocks.h), in the workspace:
  // one byte per 8 x 8 block of each distinct broadcast block of the mask, mask_block_counts along
  // (batch, head, row block, key block) (1 where the mask broadcasts) and mask_block_strides
  // between them (0 there); max |q| per (batch, head, 8 rows) and max |k| per (batch, kv head,
  // 8 keys) at these float offsets from the workspace's start.
  fa_i64 mask_block_strides[4];
  fa_i32 mask_block_counts[4];
  fa_i64 q_block_max_offset;
  fa_i64 k_block_max_offset;
} fa_params;

// Arguments of the backward kernels (fa_backward.metal): the forward's, plus the gradients'.
typedef struct fa_backward_params {
  fa_params forward;       // shapes, strides of q, k, v, out, lse and scale_log2, as the forward had them
  fa_i64 do_strides[4];    // dO, the gradient of out (B, Hq, L, Ev)
  fa_i64 dq_strides[4];    // dQ (B, Hq, L, E)
  fa_i64 dk_strides[4];    // dK (B, Hkv, S, E)
  fa_i64 dv_strides[4];    // dV (B, Hkv, S, Ev)
  fa_i64 delta_strides[3]; // D = rowsum(dO * out), float32 (B, Hq, L)
  float scale;             // the scale itself: dQ = scale * dS K, dK = scale * dS^T Q
  float pad0;
  // Attention sinks: FA_BACKWARD_BUFFER_SINKS the sinks, FA_BACKWARD_BUFFER_SINK_GRAD each row's share of their gradient.
  fa_i64 sink_grad_strides[3]; // (batch, head, row) of the float32 per-row terms of dsinks
  // Under FA_FC_MASK_BLOCKS, max |dO| per (batch, head, 8 rows) and max |V| per (batch, kv head,
  // 8 keys) at these float offsets of the workspace (fa_mask_blocks.h), after forward's.
  fa_i64 do_block_max_offset;
  fa_i64 v_block_max_offset;
} fa_backward_params;

// The backward pre-pass's geometry: rows (one per SIMD-group) of D per threadgroup.
#define FA_BACKWARD_DELTA_ROWS 4
#define FA_MASK_BLOCK_THREADS 64 // threads per threadgroup of the mask's block-class passes (fa_mask_blocks.h)

#ifdef __METAL_VERSION__
// The kernels' view of the function constants above.
constant bool fa_banded [[function_constant(FA_FC_BAND)]];
constant bool fa_write_lse [[function_constant(FA_FC_WRITE_LSE)]];
constant int fa_mask_kind [[function_constant(FA_FC_MASK_KIND)]];
constant bool fa_contiguous_tiles [[function_constant(FA_FC_CONTIGUOUS_TILES)]];
constant bool fa_exact_head_dims [[function_constant(FA_FC_EXACT_HEAD_DIMS)]];
#endif

#endif
