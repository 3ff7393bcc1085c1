/* Validation and planning of the backward pass.
 *
 * Up to head dims of 128 the backward kernels take the forward kernel's tiles: the forward's tile
 * table (fa_plan_forward.c) fits them as it is, because each streams two tiles of the forward's shapes
 * through threadgroup memory:
 *   dQ     K and V tiles of BK keys: BK * (BD + 8 + BDV + 8) elements, the forward's bytes;
 *   dK/dV  Q and dO tiles of BK queries, the same bytes, plus lse and D of those queries
 *          (2 * BK floats, at most 256 bytes): at most 18.3 KiB of Apple7-9's 32 KiB.
 * Registers per thread for the live fragments (BD = BDV = D; 2 per float fragment, 1 per half one;
 * the operands a kernel keeps, Q and dO or K and V, are half for fp16 inputs, fa_fragments.h), and
 * which operands stay in registers (metal-flash-attention's table; here every one does, in every
 * configuration):
 *            dQ: Q, dO (operands), dQ, S, dP       dK/dV: K, V (operands), dK, dV, S^T, dP^T
 *   D = 64   fp32 64, fp16 48 (BK 32)             fp32 80, fp16 64
 *   D = 128  fp32 104 (BK 16), fp16 80 (BK 32)    fp32 136, fp16 112
 *   D = 256  fp32 196 (BK 8), fp16 136 (BK 16)    fp32 260, fp16 200
 * (bf16 as fp32 with the fp16 tiles). Over the budget of about 128: dK/dV at D = 128 in fp32 (by
 * 8, kept), and everything above 128, by up to twice the budget at D = 256: a spill of that size
 * round-trips most of the accumulators through memory on every tile, so those dims take the blocked
 * configuration below instead (as metal-flash-attention blocks its backward above D = 128), trading
 * a recomputation of S and dP per block (2x at D = 256 in fp16, 3x in fp32) for no spill.
 *
 * Above 128 (E or Ev, up to 576) the backward blocks along D (metal/fa_head_blocks.h) with tiles of
 * its own: each dim in the fewest equal blocks of at most BACKWARD_BLOCK_HALF = 128 columns (fp16)
 * or BACKWARD_BLOCK_FLOAT = 96 (fp32 and bf16, whose operand fragments are float): 192 -> 2 x 96,
 * 256 -> 2 x 128 (fp16) or 3 x 88, 320 -> 3 x 112 or 4 x 80, 448 -> 4 x 112 or 5 x 96, 512 -> 4 x
 * 128 or 6 x 96, 576 -> 5 x 128 or 6 x 96.
 * Products over a head dim (S, dP and their transposes) stream both operands block by block; each
 * accumulator keeps one block per threadgroup, the grid's head axis carrying the block: dQ
 * (Hq x E blocks), dK/dV (Hkv x max(E blocks, Ev blocks)), each recomputing S and dP for its block.
 * metal-flash-attention keeps no operand in registers at these dims (its tables: nothing cached above
 * 160 to 384), round-tripping accumulators through memory instead. Which operands stay in registers,
 * and the registers of the widest block (the operand fragments hold one block while streamed):
 *            dQ: Q, dO streamed; dQ, S, dP in registers    dK/dV: K, V streamed; dK, dV, S^T, dP^T
 *   fp16 128 (BK 32): 16 + 16 + 32 + 16 + 1 = 81         16 + 16 + 32 + 32 + 16 + 1 = 113
 *   fp32 96 (BK 16): 24 + 24 + 24 + 8 + 2 = 82           24 + 24 + 24 + 24 + 8 + 2 = 106
 *   bf16 96 (BK 32): 24 + 24 + 24 + 16 + 2 = 90          24 + 24 + 24 + 24 + 16 + 2 = 114
 * all under the budget; threadgroup memory at most BK * (2 * (128 + 8)) * 2 bytes = 17 KiB.
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

enum { BACKWARD_RESIDENT_MAX_HEAD_DIM = 128, BACKWARD_BLOCK_HALF = 128, BACKWARD_BLOCK_FLOAT = 96 };

/* The backward's tiles (see above): the forward's up to 128, blocks of its own beyond. */
static fa_tiles backward_tiles(int64_t e, int64_t ev, int32_t dtype) {
    const int32_t blocked = e > BACKWARD_RESIDENT_MAX_HEAD_DIM || ev > BACKWARD_RESIDENT_MAX_HEAD_DIM;
    const int32_t widest = !blocked          ? BACKWARD_RESIDENT_MAX_HEAD_DIM
                           : dtype == FA_F16 ? BACKWARD_BLOCK_HALF
                                             : BACKWARD_BLOCK_FLOAT;
    return fa_plan_tiles(fa_plan_block_width(e, widest), fa_plan_block_width(ev, widest),
                         (int32_t)fa_dtype_bytes(dtype));
}

/* A dispatch of step `step` with the forward's function constants and the backward's tiles; the
 * caller sets its grid and cost. */
static fa_plan_dispatch *set_dispatch(fa_plan_dispatch *d, const fa_plan_dispatch *forward, fa_tiles tiles,
                                      const char *step, int32_t dtype) {
    *d = *forward;
    fa_plan_set_tile_macros(d, tiles);
    memset(&d->cost, 0, sizeof d->cost); /* the forward's: set_backward_costs counts the backward's */
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

static void set_backward_costs(fa_backward_plan *plan, const fa_plan *forward, const fa_backward_args *a, fa_tiles t,
                               int32_t e_blocks, int32_t key_blocks) {
    const fa_plan_dispatch *tiled = &forward->dispatches[0];
    const fa_params *f = &forward->params;
    const int64_t elem = fa_dtype_bytes(a->q.dtype), block = 8 * t.wm;
    const double heads = (double)f->batch * f->q_heads, rows = heads * f->q_len;
    const double e = f->head_dim, ev = f->v_head_dim, pairs = heads * fa_plan_visible_pairs(forward);
    const double issued_e = (double)((f->head_dim + 7) / 8 * 8), issued_ev = (double)((f->v_head_dim + 7) / 8 * 8);
    const int64_t rows_bytes = (int64_t)rows * 4; /* lse or D, float32 */
    const int64_t dout_bytes = (int64_t)rows * f->v_head_dim * elem;
    const int64_t sink_bytes = fa_tensor_present(&a->sinks) ? rows_bytes : 0;
    /* Operand fragments are half for fp16 inputs (fa_fragments.h), accumulators and scores float. */
    const int32_t operand = a->q.dtype == FA_F16 ? 1 : 2;
    const int64_t tile_bytes = fa_plan_tile_bytes(t, elem) + 2 * t.wm; /* two tiles of BK rows and the tile votes */
    double key_tiles = 0;
    for (int64_t key0 = 0; key0 < f->kv_len; key0 += block) {
        key_tiles += (double)key_block_tiles(forward, key0, block, t.bk);
    }
    key_tiles *= heads * key_blocks; /* every query head of each kv head's group, every column block */
    const double query_tiles = fa_plan_key_tiles(forward, t) * heads * e_blocks;
    const fa_dispatch_cost delta = {
        0, 0, 2.0 * rows * ev, 0, 2.0 * rows * ev, 2 * dout_bytes + sink_bytes, rows_bytes + sink_bytes};
    const fa_dispatch_cost dkdv = {
        tile_bytes + 2 * t.bk * 4, /* and the tile's lse and D */
        (t.bd + t.bdv) / 8 * operand + (t.bd + t.bdv) / 8 * 2 + t.bk / 8 * 2 * 2,
        /* S^T and dP^T over the whole dims in each block; dK and dV once over all blocks */
        2.0 * key_tiles * (double)(block * t.bk) * (issued_e + issued_ev) * (1.0 + 1.0 / key_blocks), key_tiles,
        2.0 * pairs * (2 * e + 2 * ev), tiled->cost.min_bytes_read + dout_bytes + 2 * rows_bytes,
        whole_bytes(&a->k) + whole_bytes(&a->v)};
    const fa_dispatch_cost dq = {tile_bytes,
                                 (t.bd + t.bdv) / 8 * operand + t.bd / 8 * 2 + t.bk / 8 * 2 * 2,
                                 2.0 * query_tiles * (double)(block * t.bk) *
                                     (issued_e + issued_ev + issued_e / e_blocks),
                                 query_tiles,
                                 2.0 * pairs * (2 * e + ev),
                                 tiled->cost.min_bytes_read + dout_bytes + 2 * rows_bytes,
                                 (int64_t)rows * f->head_dim * elem};
    plan->dispatches[FA_BACKWARD_DELTA].cost = delta;
    plan->dispatches[FA_BACKWARD_DKDV].cost = dkdv;
    plan->dispatches[FA_BACKWARD_DQ].cost = dq;
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

    const fa_plan_dispatch *tiled = &forward.dispatches[0];
    const fa_params *f = &p->forward;
    const int32_t dtype = a->q.dtype;
    const fa_tiles t = backward_tiles(f->head_dim, f->v_head_dim, dtype);
    const uint32_t threads = 32u * (uint32_t)t.wm;
    const int64_t rows_per_group = 8 * t.wm; /* 8 rows per SIMD-group */
    /* Head dims above the tiles: a threadgroup per column block of each head (see above). */
    const int32_t e_blocks = fa_plan_head_blocks(f->head_dim, t.bd);
    const int32_t v_blocks = fa_plan_head_blocks(f->v_head_dim, t.bdv);
    const int32_t key_blocks = e_blocks > v_blocks ? e_blocks : v_blocks;
    if ((rc = fa_plan_check_column_grid(f->q_heads, e_blocks, st)) ||
        (rc = fa_plan_check_column_grid(f->kv_heads, key_blocks, st))) {
        return rc;
    }
    fa_plan_dispatch *delta = set_dispatch(&plan->dispatches[FA_BACKWARD_DELTA], tiled, t, "delta", dtype);
    /* D is per row: with sequences it runs over q's whole view, not the grid's. */
    const int64_t delta_rows = forward.sequences ? f->seq_q_rows : f->q_len;
    fa_plan_set_geometry(delta, (uint32_t)((delta_rows + FA_BACKWARD_DELTA_ROWS - 1) / FA_BACKWARD_DELTA_ROWS),
                         (uint32_t)f->q_heads, (uint32_t)(forward.sequences ? f->seq_q_batches : f->batch),
                         32u * FA_BACKWARD_DELTA_ROWS);
    /* dK/dV streams Q and dO tiles; dQ, as the forward, K and V tiles. */
    fa_plan_dispatch *dkdv = set_dispatch(&plan->dispatches[FA_BACKWARD_DKDV], tiled, t, "dkdv", dtype);
    fa_plan_set_contiguous_tiles(dkdv, &a->q, &a->dout, a->device);
    fa_plan_set_block_grid(dkdv, f->kv_len, rows_per_group, (uint32_t)(f->kv_heads * key_blocks), (uint32_t)f->batch,
                           forward.banded, threads);
    fa_plan_dispatch *dq = set_dispatch(&plan->dispatches[FA_BACKWARD_DQ], tiled, t, "dq", dtype);
    fa_plan_set_block_grid(dq, f->q_len, rows_per_group, (uint32_t)(f->q_heads * e_blocks), (uint32_t)f->batch,
                           forward.banded, threads);
    set_backward_costs(plan, &forward, a, t, e_blocks, key_blocks);
    plan->sequences = forward.sequences;
    if (plan->sequences) {
        fa_sequence_set_builder(&plan->sequence_builder, tiled, fa_backward_source, dtype, (uint32_t)f->batch);
    }
    return FA_OK;
}
