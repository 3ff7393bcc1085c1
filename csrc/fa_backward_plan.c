/* Validation and planning of the backward pass.
 *
 * The backward kernels take the forward kernel's specialisation: the forward's tile table
 * (fa_plan.c) fits them as it is, because each streams two tiles of the forward's shapes through
 * threadgroup memory:
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
 * (bf16 as fp32 with the fp16 tiles). Over the budget of about 128: dK/dV from D = 128 in fp32,
 * everything at D = 256. metal-flash-attention blocks the head dim there (keeps dK/dV accumulators
 * for one D block per pass); not in yet, to be measured on a Mac first.
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
#include "fa_plan.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char fa_backward_source[] = "fa_backward.metal";

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

static void copy_strides(fa_i64 *dst, const fa_tensor *t, int32_t n) {
    for (int32_t d = 0; d < n; ++d) {
        dst[d] = t->strides[d];
    }
}

/* A dispatch of step `step` with the forward's macros and function constants; the caller sets its
 * grid and cost. */
static fa_plan_dispatch *set_dispatch(fa_plan_dispatch *d, const fa_plan_dispatch *forward, const char *step,
                                      int32_t dtype) {
    *d = *forward;
    memset(&d->cost, 0, sizeof d->cost); /* the forward's: set_backward_costs counts the backward's */
    snprintf(d->source_name, sizeof d->source_name, "%s", fa_backward_source);
    snprintf(d->function, sizeof d->function, "fa_backward_%s_%s", step, fa_kernel_type_name(dtype));
    return d;
}

/* ---- What the backward's dispatches cost (explain_plan(backward=True)), counted as the forward's
 * (fa_plan.c: FLOPs over padded widths, rows and tiles; useful FLOPs per visible pair; each input
 * element once). Per (query, key) pair the useful multiply-adds are dK/dV 2E + 2Ev (S, dP, dV, dK)
 * and dQ 2E + Ev (S, dP, dQ); the pre-pass does Ev per row. Tiles: dQ visits the forward's key
 * tiles (the same loop over the same band); dK/dV, for each key block and each query head of its
 * GQA group, the query tiles of BK rows the band lets its keys see (fa_visible_queries). */

static int32_t macro_value(const fa_plan_dispatch *d, const char *name) {
    for (uint32_t m = 0; m < d->n_macros; ++m) {
        if (strcmp(d->macros[m].name, name) == 0) {
            return (int32_t)strtol(d->macros[m].value, NULL, 10);
        }
    }
    return 0;
}

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

static void set_backward_costs(fa_backward_plan *plan, const fa_plan *forward, const fa_backward_args *a) {
    const fa_plan_dispatch *tiled = &forward->dispatches[0];
    const fa_params *f = &forward->params;
    const int32_t bd = macro_value(tiled, "FA_BD"), bdv = macro_value(tiled, "FA_BDV");
    const int32_t bk = macro_value(tiled, "FA_BK"), wm = macro_value(tiled, "FA_WM");
    const int64_t elem = fa_dtype_bytes(a->q.dtype), block = 8 * wm;
    const double heads = (double)f->batch * f->q_heads, rows = heads * f->q_len;
    const double e = f->head_dim, ev = f->v_head_dim, pairs = heads * fa_plan_visible_pairs(forward);
    const double issued_e = (double)((f->head_dim + 7) / 8 * 8), issued_ev = (double)((f->v_head_dim + 7) / 8 * 8);
    const int64_t rows_bytes = (int64_t)rows * 4; /* lse or D, float32 */
    const int64_t dout_bytes = (int64_t)rows * f->v_head_dim * elem;
    const int64_t sink_bytes = a->sinks.ndim != 0 ? rows_bytes : 0;
    /* Operand fragments are half for fp16 inputs (fa_fragments.h), accumulators and scores float. */
    const int32_t operand = a->q.dtype == FA_F16 ? 1 : 2;
    const int64_t tile_bytes = tiled->cost.threadgroup_bytes; /* two tiles of BK rows and the tile votes */
    double key_tiles = 0;
    for (int64_t key0 = 0; key0 < f->kv_len; key0 += block) {
        key_tiles += (double)key_block_tiles(forward, key0, block, bk);
    }
    key_tiles *= heads; /* every query head of each kv head's group */
    const fa_dispatch_cost delta = {0,     0,    2.0 * rows * ev, 0, 2.0 * rows * ev, 2 * dout_bytes + sink_bytes,
                                    rows_bytes + sink_bytes};
    const fa_dispatch_cost dkdv = {
        tile_bytes + 2 * bk * 4, /* and the tile's lse and D */
        (bd + bdv) / 8 * operand + (bd + bdv) / 8 * 2 + bk / 8 * 2 * 2,
        2.0 * key_tiles * (double)(block * bk) * (2 * issued_e + 2 * issued_ev),
        key_tiles,
        2.0 * pairs * (2 * e + 2 * ev),
        tiled->cost.min_bytes_read + dout_bytes + 2 * rows_bytes,
        whole_bytes(&a->k) + whole_bytes(&a->v)};
    const fa_dispatch_cost dq = {
        tile_bytes,
        (bd + bdv) / 8 * operand + bd / 8 * 2 + bk / 8 * 2 * 2,
        2.0 * tiled->cost.tiles * (double)(block * bk) * (2 * issued_e + issued_ev),
        tiled->cost.tiles,
        2.0 * pairs * (2 * e + ev),
        tiled->cost.min_bytes_read + dout_bytes + 2 * rows_bytes,
        (int64_t)rows * f->head_dim * elem};
    plan->dispatches[FA_BACKWARD_DELTA].cost = delta;
    plan->dispatches[FA_BACKWARD_DKDV].cost = dkdv;
    plan->dispatches[FA_BACKWARD_DQ].cost = dq;
}

int32_t fa_plan_check_backward_aliases(const fa_backward_args *a, fa_status *st) {
    const fa_tensor *views[] = {&a->dq,  &a->dk,   &a->dv,  &a->delta, &a->sink_grad, &a->q,    &a->k,
                                &a->v,   &a->out,  &a->dout, &a->lse,  &a->mask,      &a->sinks, &a->rng_state};
    const char *const names[] = {"dq", "dk", "dv", "delta", "sink_grad", "q", "k", "v", "out", "dout", "lse", "mask",
                                 "sinks", "rng_state"};
    return fa_check_no_alias(views, names, 14, 5, st);
}

int32_t fa_plan_backward(const fa_backward_args *a, fa_backward_plan *plan, fa_status *st) {
    if (a == NULL || plan == NULL) {
        return fa_fail(st, FA_ERR_VALUE, "fa_plan_backward: NULL argument");
    }
    memset(plan, 0, sizeof *plan);
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
    forward_args.scale = a->scale;
    forward_args.causal = a->causal;
    forward_args.band = a->band;
    forward_args.softcap = a->softcap;
    forward_args.alibi_slopes = a->alibi_slopes;
    forward_args.dropout_p = a->dropout_p;
    forward_args.rng_state = a->rng_state;
    forward_args.sinks = a->sinks;
    forward_args.kernel = FA_KERNEL_FORWARD;
    fa_plan forward;
    int32_t rc;
    if ((rc = fa_plan_forward(&forward_args, &forward, st)) ||
        (rc = check_matches(&a->lse, "lse", 3, FA_F32, &a->q, "(B, Hq, L) for q", st)) ||
        (rc = check_matches(&a->dout, "dout", 4, a->out.dtype, &a->out, "the shape of out", st)) ||
        (rc = check_matches(&a->delta, "delta", 3, FA_F32, &a->q, "(B, Hq, L) for q", st)) ||
        (rc = check_matches(&a->dq, "dq", 4, a->q.dtype, &a->q, "the shape of q", st)) ||
        (rc = check_matches(&a->dk, "dk", 4, a->k.dtype, &a->k, "the shape of k", st)) ||
        (rc = check_matches(&a->dv, "dv", 4, a->v.dtype, &a->v, "the shape of v", st))) {
        return rc;
    }
    const int32_t with_sinks = a->sinks.ndim != 0 || a->sinks.storage != NULL; /* checked by the forward plan */
    if (with_sinks &&
        (rc = check_matches(&a->sink_grad, "sink_grad", 3, FA_F32, &a->q, "(B, Hq, L) for q", st)) != FA_OK) {
        return rc;
    }
    if ((rc = fa_plan_check_backward_aliases(a, st))) {
        return rc;
    }

    fa_backward_params *p = &plan->params;
    p->forward = forward.params;
    copy_strides(p->do_strides, &a->dout, 4);
    copy_strides(p->dq_strides, &a->dq, 4);
    copy_strides(p->dk_strides, &a->dk, 4);
    copy_strides(p->dv_strides, &a->dv, 4);
    copy_strides(p->delta_strides, &a->delta, 3);
    p->scale = (float)a->scale;
    if (with_sinks) {
        copy_strides(p->sink_grad_strides, &a->sink_grad, 3);
    }

    const fa_plan_dispatch *tiled = &forward.dispatches[0];
    const uint32_t threads = tiled->threadgroup[0];
    const int64_t rows_per_group = threads / 32 * 8; /* 8 rows per SIMD-group */
    const fa_params *f = &p->forward;
    const int32_t dtype = a->q.dtype;
    fa_plan_dispatch *delta = set_dispatch(&plan->dispatches[FA_BACKWARD_DELTA], tiled, "delta", dtype);
    fa_plan_set_geometry(delta, (uint32_t)((f->q_len + FA_BACKWARD_DELTA_ROWS - 1) / FA_BACKWARD_DELTA_ROWS),
                         (uint32_t)f->q_heads, (uint32_t)f->batch, 32u * FA_BACKWARD_DELTA_ROWS);
    /* dK/dV streams Q and dO tiles; dQ, as the forward, K and V tiles. */
    fa_plan_dispatch *dkdv = set_dispatch(&plan->dispatches[FA_BACKWARD_DKDV], tiled, "dkdv", dtype);
    fa_plan_set_contiguous_tiles(dkdv, &a->q, &a->dout, a->device);
    fa_plan_set_block_grid(dkdv, f->kv_len, rows_per_group, (uint32_t)f->kv_heads, (uint32_t)f->batch,
                           forward.banded, threads);
    fa_plan_dispatch *dq = set_dispatch(&plan->dispatches[FA_BACKWARD_DQ], tiled, "dq", dtype);
    fa_plan_set_block_grid(dq, f->q_len, rows_per_group, (uint32_t)f->q_heads, (uint32_t)f->batch, forward.banded,
                           threads);
    set_backward_costs(plan, &forward, a);
    return FA_OK;
}
