/* Validation and planning of the backward pass.
 *
 * The backward kernels take tiles of the forward's table (fa_plan_tiles: padded widths, BK by
 * element size halved to the GPU family's tile cap), because each streams two tiles of the
 * forward's shapes through threadgroup memory:
 *   dQ     K and V tiles of BK keys: BK * (BD + 8 + BDV + 8) elements, the forward's bytes;
 *   dK/dV  Q and dO tiles of BK queries, the same bytes, plus lse and D of those queries
 *          (2 * BK floats, at most 256 bytes).
 * Registers per thread for the live fragments (2 per float fragment, 1 per half or bfloat one; the
 * operands a kernel keeps, Q and dO or K and V, are half for fp16 inputs and bfloat for bf16 on
 * Apple9/10, float otherwise: fa_plan_operand_registers, fa_fragments.h):
 *   dQ     Q, dO (operands), dQ, S, dP:          (BD + BDV) / 8 * operand + BD / 4 + BK / 2
 *   dK/dV  K, V (operands), dK, dV, S^T, dP^T:   (BD + BDV) / 8 * (operand + 2) + BK / 2
 * Unblocked (BD = BDV = D, the table's BK):
 *            dQ                                    dK/dV
 *   D = 64   fp32 64, fp16 48 (BK 32)             fp32 80, fp16 64
 *   D = 128  fp32 104 (BK 16), fp16 80 (BK 32)    fp32 136, fp16 112 (bf16: fp32's on Apple7/8, fp16's on 9/10)
 *   D = 256  fp32 196 (BK 8), fp16 136 (BK 16)    fp32 260, fp16 200
 * Each kernel takes, on its own, the widest column blocks whose registers fit the family's budget
 * (fa_gpu_family.c): blocks of at most 128 columns, then 96, 64, 32 (each dim in the fewest equal
 * blocks of at most that width, padded: 192 -> 2 x 96, 256 -> 2 x 128 or 3 x 88, ...); dims above
 * 128 with float operand fragments (fp32, and bf16 on Apple7/8) start at 96, whose fragments take twice the
 * registers (the blocking tested since it was introduced). Blocked,
 * products over a head dim (S, dP and their transposes) stream both operands block by block; each
 * accumulator keeps one block per threadgroup, the grid's head axis carrying the block: dQ
 * (Hq x E blocks), dK/dV (Hkv x max(E blocks, Ev blocks)), each recomputing S and dP for its block;
 * so what stays resident is the accumulators' block, the operands stream (metal/fa_head_blocks.h).
 * The price is that recomputation: (2 blocks) dK/dV 6D instead of 4D multiply-adds per pair, dQ 5D
 * instead of 3D. The alternative, a spill, round-trips accumulators through memory on every tile.
 *   Apple7/8, budget 96 (metal-flash-attention keeps no dK/dV operand resident above D = 96 there):
 *            dQ                                    dK/dV
 *   D = 64   unblocked in every dtype (<= 64)      unblocked (fp32 BK 16: 72; bf16 80)
 *   D = 128  fp16 unblocked (BK 16: 72);           2 x 64 in every dtype (fp16 64, bf16 80, fp32 72)
 *            fp32, bf16 2 x 64 (56, 64)
 *   D = 256  fp16 2 x 128 (72), fp32 3 x 96 (80)   fp16 3 x 96 (88), fp32 4 x 64 (72)
 *   Apple9/10, budget 144 (dynamic caching allocates registers as used, so a wide configuration
 *   costs occupancy gradually; metal-flash-attention keeps dK and dV resident to D = 144 there):
 *   D <= 128 unblocked in every dtype (fp32 dK/dV at 128 takes 136); D = 256: fp16 and bf16
 *   2 x 128, fp32 3 x 96 (at most 114).
 * Threadgroup memory at most BK * (2 * (128 + 8)) * 2 bytes = 17 KiB, 15 KiB on Apple7/8.
 * Geometry, WM = 4 SIMD-groups of 8 rows each, as the forward:
 *   delta  one SIMD-group per row, FA_BACKWARD_DELTA_ROWS rows per threadgroup: (ceil(L / 4), Hq, B)
 *   dK/dV  8 WM keys per threadgroup:                                        (ceil(S / 32), Hkv, B)
 *   dQ     8 WM query rows per threadgroup, the forward's launch:             (ceil(L / 32), Hq, B)
 * Under a band (causal, window) the blocks become the slowest axis, heaviest first (metal/fa_schedule.h):
 * dK/dV (Hkv, B, ceil(S / 32)) from the first key block, dQ (Hq, B, ceil(L / 32)) from the last
 * query block. Each kernel checks the contiguous tile path on the two operands it streams: Q and dO
 * for dK/dV, K and V for dQ.
 * Work, as multiply-adds per (query, key) pair: dK/dV 2E + 2Ev, dQ 2E + Ev (S is recomputed by
 * both: 7 matrix products against the forward's 2, metal-flash-attention's count). */
#include "fa_plan_backward.h"
#include "fa_plan_sequences.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char fa_backward_source[] = FA_BACKWARD_SOURCE;
static const char fa_backward_tensor_source[] = "fa_backward_tensor.metal";

/* t must be an ndim-D view of `dtype` whose sizes are the first ndim sizes of `like`; `expected`
 * names the shape rule in messages. */
static int32_t check_matches(const fa_tensor *t, const char *name, int32_t ndim, int32_t dtype, const fa_tensor *like,
                             const char *expected, fa_status *st) {
    int32_t rc = fa_check_tensor(t, name, ndim, 0, st);
    if (rc != FA_OK) {
        return rc;
    }
    if (t->dtype != dtype) {
        return fa_fail(st, FA_ERR_TYPE, "%s: must be %s, got %s", name, fa_dtype_name(dtype), fa_dtype_name(t->dtype));
    }
    for (int32_t d = 0; d < ndim; ++d) {
        if (t->sizes[d] != like->sizes[d]) {
            char ts[96], ls[96];
            fa_describe_shape(t, ts, sizeof ts);
            fa_describe_shape(like, ls, sizeof ls);
            return fa_fail(st, FA_ERR_VALUE, "%s %s must be %s %s", name, ts, expected, ls);
        }
    }
    return FA_OK;
}

/* Bytes of a view's elements, each once (dK, dV are written whole). */
static int64_t whole_bytes(const fa_tensor *t) {
    int64_t n = fa_dtype_bytes(t->dtype);
    for (int32_t d = 0; d < t->ndim; ++d) {
        n *= t->sizes[d];
    }
    return n;
}

enum {
    BACKWARD_MAX_WIDTH = 128,
    BACKWARD_FLOAT_BLOCK_WIDTH = 96, /* blocked dims with float operand fragments start here */
    BACKWARD_MIN_WIDTH = 32,
    BACKWARD_WIDTH_STEP = 32,
};

/* Fragment registers per thread (see above): operands `operand` registers per fragment
 * (fa_plan_operand_registers), accumulators and scores float. dK/dV: K, V, dK, dV and S^T, dP^T of
 * BK queries; dQ: Q, dO, dQ and S, dP of BK keys. */
static int32_t dkdv_fragment_registers(fa_tiles t, int32_t operand) {
    return (t.bd + t.bdv) / 8 * operand + (t.bd + t.bdv) / 8 * 2 + t.bk / 8 * 2 * 2;
}

static int32_t dq_fragment_registers(fa_tiles t, int32_t operand) {
    return (t.bd + t.bdv) / 8 * operand + t.bd / 8 * 2 + t.bk / 8 * 2 * 2;
}

/* One kernel's tiles (see above): the widest blocks, of at most 128 columns (96 for a blocked dim
 * with float operand fragments) and then 32 fewer at a time, whose fragment registers fit the
 * family's budget. */
static fa_tiles backward_tiles(int32_t (*registers)(fa_tiles, int32_t), int64_t e, int64_t ev, int32_t dtype,
                               const fa_gpu_profile *gpu) {
    const int32_t blocked = e > BACKWARD_MAX_WIDTH || ev > BACKWARD_MAX_WIDTH;
    const int32_t operand = fa_plan_operand_registers(dtype, gpu);
    const int32_t first = blocked && operand == 2 ? BACKWARD_FLOAT_BLOCK_WIDTH : BACKWARD_MAX_WIDTH;
    for (int32_t widest = first;; widest -= BACKWARD_WIDTH_STEP) {
        const fa_tiles t = fa_plan_tiles(fa_plan_block_width(e, widest), fa_plan_block_width(ev, widest),
                                         (int32_t)fa_dtype_bytes(dtype), gpu);
        if (widest <= BACKWARD_MIN_WIDTH || registers(t, operand) <= gpu->fragment_register_budget) {
            return t;
        }
    }
}

/* A dispatch of step `step` with the forward's function constants and the backward's tiles (and
 * whether f's head dims are exactly their widths); the caller sets its grid and cost. */
static fa_plan_dispatch *set_dispatch(fa_plan_dispatch *d, const fa_plan_dispatch *forward, fa_tiles tiles,
                                      const fa_params *f, const char *step, int32_t dtype) {
    *d = *forward;
    fa_plan_set_tile_macros(d, tiles);
    fa_plan_set_exact_head_dims(d, tiles, f->head_dim, f->v_head_dim);
    memset(&d->cost, 0, sizeof d->cost);                /* the forward's: set_backward_costs counts the backward's */
    fa_plan_add_constant_bool(d, FA_FC_MASK_BLOCKS, 0); /* the mask's block classes are the forward's alone */
    snprintf(d->source_name, sizeof d->source_name, "%s", fa_backward_source);
    snprintf(d->function, sizeof d->function, "fa_backward_%s_%s", step, fa_kernel_type_name(dtype));
    return d;
}

/* ---- What the backward's dispatches cost (explain_plan(backward=True)), counted as the forward's
 * (fa_plan_forward.c: FLOPs over padded widths, rows and tiles; useful FLOPs per visible pair; each input
 * element once). Per (query, key) pair the useful multiply-adds are dK/dV 2E + 2Ev (S, dP, dV, dK)
 * and dQ 2E + Ev (S, dP, dQ); the pre-pass does Ev per row. Tiles, of the backward's tiles t: dQ
 * visits the key tiles the forward's loop would (fa_plan_key_tiles); dK/dV, for each key block and
 * each query head of its GQA group, the query tiles of BK rows the band lets its keys see
 * (fa_visible_queries). Above 256 each column block's threadgroups visit them all again and
 * recompute S and dP over the whole head dims, then their own block of the accumulators. */

/* Query tiles of `bk` rows one key block visits: the queries that see a key of keys [key0, key0 +
 * keys) under the band (all L without one), from the first of them. */
static int64_t key_block_tiles(const fa_plan *forward, int64_t key0, int64_t keys, int64_t bk) {
    const fa_params *f = &forward->params;
    int64_t begin = 0, end = f->q_len;
    if (forward->banded) {
        const int64_t last = (key0 + keys < f->kv_len ? key0 + keys : f->kv_len) - 1;
        begin = key0 - f->band_hi > 0 ? key0 - f->band_hi : 0;
        end = last - f->band_lo + 1 < f->q_len ? last - f->band_lo + 1 : f->q_len;
    }
    return end > begin ? (end - begin + bk - 1) / bk : 0;
}

static void set_backward_costs(fa_backward_plan *plan, const fa_plan *forward, const fa_backward_args *a, fa_tiles kv,
                               fa_tiles tq, int32_t e_blocks, int32_t key_blocks) {
    const fa_plan_dispatch *tiled = &forward->dispatches[forward->n_dispatches - 1];
    const fa_params *f = &forward->params;
    const int64_t elem = fa_dtype_bytes(a->q.dtype), block = 8 * kv.wm;
    const int32_t operand = fa_plan_operand_registers(a->q.dtype, fa_gpu_profile_of(forward->gpu_family));
    const double heads = (double)f->batch * f->q_heads, rows = heads * f->q_len;
    const double e = f->head_dim, ev = f->v_head_dim, pairs = heads * fa_plan_visible_pairs(forward);
    const double issued_e = (double)((f->head_dim + 7) / 8 * 8), issued_ev = (double)((f->v_head_dim + 7) / 8 * 8);
    const int64_t rows_bytes = (int64_t)rows * 4; /* lse or D, float32 */
    const int64_t dout_bytes = (int64_t)rows * f->v_head_dim * elem;
    const int64_t sink_bytes = fa_tensor_present(&a->sinks) ? rows_bytes : 0;
    double key_tiles = 0;
    for (int64_t key0 = 0; key0 < f->kv_len; key0 += block) {
        key_tiles += (double)key_block_tiles(forward, key0, block, kv.bk);
    }
    key_tiles *= heads * key_blocks; /* every query head of each kv head's group, every column block */
    const double query_tiles = fa_plan_key_tiles(forward, tq) * heads * e_blocks;
    const fa_dispatch_cost delta = {
        0, 0, 2.0 * rows * ev, 0, 2.0 * rows * ev, 2 * dout_bytes + sink_bytes, rows_bytes + sink_bytes};
    /* Two tiles of BK rows and the tile votes; dK/dV also the tile's lse and D. */
    const fa_dispatch_cost dkdv = {
        fa_plan_tile_bytes(kv, elem) + 2 * kv.wm + 2 * kv.bk * 4, dkdv_fragment_registers(kv, operand),
        /* S^T and dP^T over the whole dims in each block; dK and dV once over all blocks */
        2.0 * key_tiles * (double)(block * kv.bk) * (issued_e + issued_ev) * (1.0 + 1.0 / key_blocks), key_tiles,
        2.0 * pairs * (2 * e + 2 * ev), tiled->cost.min_bytes_read + dout_bytes + 2 * rows_bytes,
        whole_bytes(&a->k) + whole_bytes(&a->v)};
    const fa_dispatch_cost dq = {fa_plan_tile_bytes(tq, elem) + 2 * tq.wm,
                                 dq_fragment_registers(tq, operand),
                                 2.0 * query_tiles * (double)(block * tq.bk) *
                                     (issued_e + issued_ev + issued_e / e_blocks),
                                 query_tiles,
                                 2.0 * pairs * (2 * e + ev),
                                 tiled->cost.min_bytes_read + dout_bytes + 2 * rows_bytes,
                                 (int64_t)rows * f->head_dim * elem};
    plan->dispatches[FA_BACKWARD_DELTA].cost = delta;
    plan->dispatches[FA_BACKWARD_DKDV].cost = dkdv;
    plan->dispatches[FA_BACKWARD_DQ].cost = dq;
}

/* ---- The tensor path (metal/fa_backward_tensor.h): dK/dV and dQ on matmul2d, shaped like the tensor
 * forward (fa_plan_forward.c): TENSOR_SIMDGROUPS SIMD-groups of TENSOR_ROWS rows each (keys for
 * dK/dV, query rows for dQ), the other side streaming through threadgroup tiles of TENSOR_TILE rows.
 * Width BD: the tensor forward's one padded width of both head dims (64, 96 or 128,
 * fa_plan_tensor_width). Threadgroup memory: one region of max(64, 2 x 32) rows of BD + 8 elements (the
 * resident operands' staging, then the two streamed tiles, then the gradients' staging), and per
 * row lse and D (dK/dV: of the tile's 32 queries; dQ: of the block's 64 rows): 17 KiB at 128.
 * Registers per lane (32-bit), of cooperative tensors of 16 rows over 32 lanes: the two resident
 * operands as 2-byte left inputs BD / 4 each; float accumulators dK, dV BD / 2 each or dQ BD / 2;
 * the float 16 x 32 tiles S^T, dP^T and their copies as left inputs (16 each; dQ: S, dP, dS).
 * What it takes is what the tensor forward takes (float16, bfloat16; head dims up to 128; no
 * dropout) with every option of the simdgroup backward besides: causal and windows, masks,
 * softcap, ALiBi, sinks (their gradient comes from the delta pre-pass), GQA, packed sequences. */
enum {
    TENSOR_ROWS = 16,
    TENSOR_TILE = 32,
    TENSOR_SIMDGROUPS = 4,
    TENSOR_TILE_PAD = 8, /* FA_TILE_PAD of metal/fa_loader.h */
};

/* The rows of the other side that rows [first, first + n) see under the band (all without one):
 * queries that see a key of them (key_side), or keys a query of them sees. */
static void tensor_visible(const fa_plan *forward, int32_t key_side, int64_t first, int64_t n, int64_t *begin,
                           int64_t *end) {
    const fa_params *f = &forward->params;
    const int64_t own = key_side ? f->kv_len : f->q_len, other = key_side ? f->q_len : f->kv_len;
    *begin = 0;
    *end = other;
    if (forward->banded) {
        const int64_t last = (first + n < own ? first + n : own) - 1;
        const int64_t lo = key_side ? first - f->band_hi : first + f->band_lo;
        const int64_t hi = key_side ? last - f->band_lo + 1 : last + f->band_hi + 1;
        *begin = lo > 0 ? lo : 0;
        *end = hi < other ? hi : other;
    }
}

/* Score tiles the SIMD-groups of one (batch, head) multiply: a threadgroup's tiles of TENSOR_TILE
 * rows start at the first row its block sees, and each SIMD-group multiplies those that overlap
 * the rows its own TENSOR_ROWS see. */
static double tensor_score_tiles(const fa_plan *forward, int32_t key_side) {
    const int64_t own = key_side ? forward->params.kv_len : forward->params.q_len;
    const int64_t block = (int64_t)TENSOR_ROWS * TENSOR_SIMDGROUPS;
    double tiles = 0;
    for (int64_t r0 = 0; r0 < own; r0 += block) {
        int64_t begin, end;
        tensor_visible(forward, key_side, r0, block, &begin, &end);
        for (int64_t s0 = r0; s0 < r0 + block && s0 < own; s0 += TENSOR_ROWS) {
            int64_t mine_begin, mine_end;
            tensor_visible(forward, key_side, s0, TENSOR_ROWS, &mine_begin, &mine_end);
            if (mine_end > mine_begin && end > begin) {
                const int64_t first = (mine_begin - begin) / TENSOR_TILE;
                const int64_t last = (mine_end - begin + TENSOR_TILE - 1) / TENSOR_TILE;
                tiles += (double)(last - first);
            }
        }
    }
    return tiles;
}

void fa_plan_backward_tensor_dispatch(fa_plan_dispatch *d, const char *step, int32_t dtype, int32_t width) {
    char kernel[48];
    snprintf(kernel, sizeof kernel, "fa_backward_tensor_%s", step);
    d->n_macros = 0; /* the library is this one's, whatever the dispatch held */
    fa_plan_start_dispatch(d, fa_backward_tensor_source, kernel, dtype);
    fa_plan_add_macro_text(d, FA_LANGUAGE_MACRO, FA_LANGUAGE_METAL4);
    fa_plan_add_macro(d, "FA_BD", width);
    fa_plan_add_macro(d, "FA_WM", TENSOR_SIMDGROUPS);
}

/* The dK/dV and dQ dispatches on the tensor kernels, with their grids and costs (counted as the
 * simdgroup ones, set_backward_costs: issued FLOPs over the widths and tiles, the same useful
 * FLOPs and bytes). */
static void set_tensor_backward(fa_backward_plan *plan, const fa_plan *forward, const fa_backward_args *a) {
    const fa_params *f = &forward->params;
    const int32_t dtype = a->q.dtype;
    const int32_t bd = fa_plan_tensor_width(f->head_dim, f->v_head_dim);
    const uint32_t threads = 32u * TENSOR_SIMDGROUPS;
    const int64_t rows_per_group = (int64_t)TENSOR_ROWS * TENSOR_SIMDGROUPS;
    fa_plan_dispatch *dkdv = &plan->dispatches[FA_BACKWARD_DKDV];
    fa_plan_dispatch *dq = &plan->dispatches[FA_BACKWARD_DQ];
    fa_plan_backward_tensor_dispatch(dkdv, "dkdv", dtype, bd);
    fa_plan_set_contiguous_tiles(dkdv, &a->q, &a->dout, a->device);
    fa_plan_set_block_grid(dkdv, f->kv_len, rows_per_group, (uint32_t)f->kv_heads, (uint32_t)f->batch, forward->banded,
                           threads);
    fa_plan_backward_tensor_dispatch(dq, "dq", dtype, bd);
    fa_plan_set_contiguous_tiles(dq, &a->k, &a->v, a->device);
    fa_plan_set_block_grid(dq, f->q_len, rows_per_group, (uint32_t)f->q_heads, (uint32_t)f->batch, forward->banded,
                           threads);
    const double heads = (double)f->batch * f->q_heads;
    const double key_side_tiles = tensor_score_tiles(forward, 1) * heads; /* every query head of each group */
    const double query_side_tiles = tensor_score_tiles(forward, 0) * heads;
    const double tile_pairs = (double)TENSOR_ROWS * TENSOR_TILE;
    const int64_t region = (rows_per_group > 2 * TENSOR_TILE ? rows_per_group : 2 * TENSOR_TILE) *
                           (bd + TENSOR_TILE_PAD) * fa_dtype_bytes(dtype);
    const int32_t tile_registers = TENSOR_ROWS * TENSOR_TILE / 32;
    dkdv->cost.threadgroup_bytes = region + 2 * TENSOR_TILE * (int64_t)sizeof(float);
    dkdv->cost.registers = bd / 2 + bd + 4 * tile_registers;
    dkdv->cost.flops = 2.0 * key_side_tiles * tile_pairs * 4 * bd;
    dkdv->cost.tiles = key_side_tiles;
    dq->cost.threadgroup_bytes = region + 2 * rows_per_group * (int64_t)sizeof(float);
    dq->cost.registers = bd / 2 + bd / 2 + 3 * tile_registers;
    dq->cost.flops = 2.0 * query_side_tiles * tile_pairs * 3 * bd;
    dq->cost.tiles = query_side_tiles;
}

/* The additive mask's block classes (metal/fa_mask_blocks.h), when the forward's plan has them: the
 * forward's items and workspace, then max |dO| per 8 rows and max |V| per 8 keys, written after D
 * (which poisons q's maxima where it is not finite). */
static void plan_mask_blocks(fa_backward_plan *plan, const fa_plan *forward, const fa_backward_args *a,
                             const fa_plan_dispatch *tiled, fa_tiles tq) {
    const fa_params *f = &forward->params;
    if (forward->workspace_bytes == 0 || f->mask_block_counts[0] == 0) {
        return;
    }
    fa_backward_params *p = &plan->params;
    const int64_t q_items = (int64_t)f->batch * f->q_heads * ((f->q_len + 7) / 8);
    const int64_t k_items = (int64_t)f->batch * f->kv_heads * ((f->kv_len + 7) / 8);
    const int64_t classes =
        (int64_t)f->mask_block_counts[0] * f->mask_block_counts[1] * f->mask_block_counts[2] * f->mask_block_counts[3];
    const int64_t items = classes + 2 * (q_items + k_items), threads = FA_MASK_BLOCK_THREADS;
    if ((items + threads - 1) / threads > UINT32_MAX) {
        p->forward.mask_block_counts[0] = 0;
        return;
    }
    p->do_block_max_offset = forward->workspace_bytes / (int64_t)sizeof(float);
    p->v_block_max_offset = p->do_block_max_offset + q_items;
    plan->workspace_bytes = (p->v_block_max_offset + k_items) * (int64_t)sizeof(float);
    fa_plan_dispatch *d =
        set_dispatch(&plan->dispatches[FA_BACKWARD_MASK_BLOCKS], tiled, tq, f, "mask_blocks", a->q.dtype);
    fa_plan_add_constant_bool(d, FA_FC_MASK_BLOCKS, 1);
    fa_plan_set_geometry(d, (uint32_t)((items + threads - 1) / threads), 1, 1, (uint32_t)threads);
    const fa_dispatch_cost cost = {0,
                                   4,
                                   0,
                                   0,
                                   0,
                                   forward->dispatches[0].cost.min_bytes_read + whole_bytes(&a->dout) +
                                       whole_bytes(&a->v) + whole_bytes(&a->delta),
                                   plan->workspace_bytes};
    d->cost = cost;
}

int32_t fa_plan_check_backward_aliases(const fa_backward_args *a, fa_status *st) {
    return fa_check_slot_aliases(a, FA_BACKWARD, 0, st);
}

int32_t fa_plan_backward(const fa_backward_args *a, fa_backward_plan *plan, fa_status *st) {
    if (a == NULL || plan == NULL) {
        return fa_fail(st, FA_ERR_VALUE, "fa_plan_backward: NULL argument");
    }
    memset(plan, 0, sizeof *plan);
    if (fa_sequence_paged(&a->sequences)) { /* as flash-attn: a paged KV cache has no backward */
        return fa_fail(st, FA_ERR_VALUE, "block_table: the backward does not read a paged KV cache (forward only)");
    }
    if (a->options.k_bits != 0 || a->options.v_bits != 0) { /* no gradient reaches quantized K/V */
        return fa_fail(st, FA_ERR_VALUE, "k_bits, v_bits: the backward does not read quantized K/V (forward only)");
    }
    /* Gradients of a call with an empty tensor are zeros or empty: its callers make them. */
    int32_t rc = fa_check_no_empty_slot(a, FA_BACKWARD, st);
    if (rc != FA_OK) {
        return rc;
    }
    /* Planning the forward validates q, k, v, out and lse and fills their kernel arguments. */
    fa_forward_args forward_args;
    memset(&forward_args, 0, sizeof forward_args);
    forward_args.device = a->device;
    forward_args.q = a->q;
    forward_args.k = a->k;
    forward_args.v = a->v;
    forward_args.out = a->out;
    forward_args.lse = a->lse;
    forward_args.mask = a->mask;
    forward_args.options = a->options;
    forward_args.options.kernel = FA_KERNEL_FORWARD;
    forward_args.options.num_splits = 0;
    forward_args.options.write_probs = 0;
    forward_args.alibi_slopes = a->alibi_slopes;
    forward_args.rng_state = a->rng_state;
    forward_args.sinks = a->sinks;
    forward_args.sequences = a->sequences;
    fa_plan forward;
    if ((rc = fa_plan_forward(&forward_args, &forward, st)) ||
        (rc = check_matches(&a->lse, "lse", 3, FA_F32, &a->q, "(B, Hq, L) for q", st)) ||
        (rc = check_matches(&a->dout, "dout", 4, a->out.dtype, &a->out, "the shape of out", st)) ||
        (rc = check_matches(&a->delta, "delta", 3, FA_F32, &a->q, "(B, Hq, L) for q", st)) ||
        (rc = check_matches(&a->dq, "dq", 4, a->q.dtype, &a->q, "the shape of q", st)) ||
        (rc = check_matches(&a->dk, "dk", 4, a->k.dtype, &a->k, "the shape of k", st)) ||
        (rc = check_matches(&a->dv, "dv", 4, a->v.dtype, &a->v, "the shape of v", st))) {
        return rc;
    }
    const int32_t with_sinks = fa_tensor_present(&a->sinks); /* checked by the forward plan */
    if (with_sinks &&
        (rc = check_matches(&a->sink_grad, "sink_grad", 3, FA_F32, &a->q, "(B, Hq, L) for q", st)) != FA_OK) {
        return rc;
    }
    if ((rc = fa_plan_check_backward_aliases(a, st))) {
        return rc;
    }

    fa_backward_params *p = &plan->params;
    p->forward = forward.params;
    fa_plan_copy_strides(p->do_strides, &a->dout, 4);
    fa_plan_copy_strides(p->dq_strides, &a->dq, 4);
    fa_plan_copy_strides(p->dk_strides, &a->dk, 4);
    fa_plan_copy_strides(p->dv_strides, &a->dv, 4);
    fa_plan_copy_strides(p->delta_strides, &a->delta, 3);
    p->scale = (float)a->options.scale;
    if (with_sinks) {
        fa_plan_copy_strides(p->sink_grad_strides, &a->sink_grad, 3);
    }

    /* the forward kernel's dispatch: the last, after the mask pre-pass when there is one */
    const fa_plan_dispatch *tiled = &forward.dispatches[forward.n_dispatches - 1];
    const fa_params *f = &p->forward;
    const int32_t dtype = a->q.dtype;
    const fa_gpu_profile *gpu = fa_gpu_profile_of(forward.gpu_family);
    const fa_tiles kv = backward_tiles(dkdv_fragment_registers, f->head_dim, f->v_head_dim, dtype, gpu);
    const fa_tiles tq = backward_tiles(dq_fragment_registers, f->head_dim, f->v_head_dim, dtype, gpu);
    const uint32_t threads = 32u * (uint32_t)kv.wm;
    const int64_t rows_per_group = 8 * kv.wm; /* 8 rows per SIMD-group */
    /* Head dims above the tiles: a threadgroup per column block of each head (see above). */
    const int32_t e_blocks = fa_plan_head_blocks(f->head_dim, tq.bd);
    const int32_t key_blocks = fa_plan_head_blocks(f->head_dim, kv.bd) > fa_plan_head_blocks(f->v_head_dim, kv.bdv)
                                   ? fa_plan_head_blocks(f->head_dim, kv.bd)
                                   : fa_plan_head_blocks(f->v_head_dim, kv.bdv);
    if ((rc = fa_plan_check_column_grid(f->q_heads, e_blocks, st)) ||
        (rc = fa_plan_check_column_grid(f->kv_heads, key_blocks, st))) {
        return rc;
    }
    fa_plan_dispatch *delta = set_dispatch(&plan->dispatches[FA_BACKWARD_DELTA], tiled, tq, f, "delta", dtype);
    /* D is per row: with sequences it runs over q's whole view, not the grid's. */
    const int64_t delta_rows = forward.sequences ? f->seq_q_rows : f->q_len;
    fa_plan_set_geometry(delta, (uint32_t)((delta_rows + FA_BACKWARD_DELTA_ROWS - 1) / FA_BACKWARD_DELTA_ROWS),
                         (uint32_t)f->q_heads, (uint32_t)(forward.sequences ? f->seq_q_batches : f->batch),
                         32u * FA_BACKWARD_DELTA_ROWS);
    /* dK/dV streams Q and dO tiles; dQ, as the forward, K and V tiles. */
    fa_plan_dispatch *dkdv = set_dispatch(&plan->dispatches[FA_BACKWARD_DKDV], tiled, kv, f, "dkdv", dtype);
    fa_plan_set_contiguous_tiles(dkdv, &a->q, &a->dout, a->device);
    fa_plan_set_block_grid(dkdv, f->kv_len, rows_per_group, (uint32_t)(f->kv_heads * key_blocks), (uint32_t)f->batch,
                           forward.banded, threads);
    fa_plan_dispatch *dq = set_dispatch(&plan->dispatches[FA_BACKWARD_DQ], tiled, tq, f, "dq", dtype);
    fa_plan_set_block_grid(dq, f->q_len, rows_per_group, (uint32_t)(f->q_heads * e_blocks), (uint32_t)f->batch,
                           forward.banded, threads);
    set_backward_costs(plan, &forward, a, kv, tq, e_blocks, key_blocks);
    /* The tensor forward's rule (fa_plan_forward.c): kernel='tensor' forces it, AUTO takes it when
     * planning for Apple10 on a device whose tensor operations are Apple10's. */
    const int32_t tensor_family = fa_device_tensor_family(a->device);
    const char *tensor_refused = fa_plan_tensor_refusal(&forward_args, tensor_family);
    if (a->options.kernel == FA_KERNEL_TENSOR && tensor_refused != NULL) {
        return fa_fail(st, FA_ERR_VALUE, "kernel='tensor': the tensor-path backward does not take %s", tensor_refused);
    }
    if (a->options.kernel == FA_KERNEL_TENSOR ||
        (a->options.kernel == FA_KERNEL_AUTO &&
         fa_plan_tensor_by_default(forward.gpu_family, tensor_family, tensor_refused))) {
        set_tensor_backward(plan, &forward, a); /* it adds a mask everywhere: no block classes */
    } else {
        plan_mask_blocks(plan, &forward, a, tiled, tq);
        fa_plan_add_constant_bool(dkdv, FA_FC_MASK_BLOCKS, plan->workspace_bytes > 0);
        fa_plan_add_constant_bool(dq, FA_FC_MASK_BLOCKS, plan->workspace_bytes > 0);
    }
    plan->gpu_family = forward.gpu_family;
    plan->sequences = forward.sequences;
    if (plan->sequences) {
        fa_sequence_set_builder(&plan->sequence_builder, tiled, fa_backward_source, dtype, (uint32_t)f->batch);
    }
    return FA_OK;
}
