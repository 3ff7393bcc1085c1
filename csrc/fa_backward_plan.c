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
#include "fa_sequence.h"

#include <stdio.h>
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

static void copy_strides(fa_i64 *dst, const fa_tensor *t, int32_t n) {
    for (int32_t d = 0; d < n; ++d) {
        dst[d] = t->strides[d];
    }
}

/* A dispatch of step `step` with the forward's macros and function constants; the caller sets its grid. */
static fa_plan_dispatch *set_dispatch(fa_plan_dispatch *d, const fa_plan_dispatch *forward, const char *step,
                                      int32_t dtype) {
    *d = *forward;
    memset(&d->cost, 0, sizeof d->cost); /* the forward's; the backward's are not counted */
    snprintf(d->source_name, sizeof d->source_name, "%s", fa_backward_source);
    snprintf(d->function, sizeof d->function, "fa_backward_%s_%s", step, fa_kernel_type_name(dtype));
    return d;
}

int32_t fa_plan_check_backward_aliases(const fa_backward_args *a, fa_status *st) {
    const fa_tensor *views[] = {&a->dq, &a->dk, &a->dv, &a->delta, &a->q, &a->k, &a->v, &a->out, &a->dout, &a->lse,
                                &a->mask};
    const char *const names[] = {"dq", "dk", "dv", "delta", "q", "k", "v", "out", "dout", "lse", "mask"};
    return fa_check_no_alias(views, names, 11, 4, st);
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
    forward_args.sequences = a->sequences;
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

    const fa_plan_dispatch *tiled = &forward.dispatches[0];
    const uint32_t threads = tiled->threadgroup[0];
    const int64_t rows_per_group = threads / 32 * 8; /* 8 rows per SIMD-group */
    const fa_params *f = &p->forward;
    const int32_t dtype = a->q.dtype;
    fa_plan_dispatch *delta = set_dispatch(&plan->dispatches[FA_BACKWARD_DELTA], tiled, "delta", dtype);
    /* D is per row: with sequences it runs over q's whole view, not the grid's. */
    const int64_t delta_rows = forward.sequences ? f->seq_q_rows : f->q_len;
    fa_plan_set_geometry(delta, (uint32_t)((delta_rows + FA_BACKWARD_DELTA_ROWS - 1) / FA_BACKWARD_DELTA_ROWS),
                         (uint32_t)f->q_heads, (uint32_t)(forward.sequences ? f->seq_q_batches : f->batch),
                         32u * FA_BACKWARD_DELTA_ROWS);
    /* dK/dV streams Q and dO tiles; dQ, as the forward, K and V tiles. */
    fa_plan_dispatch *dkdv = set_dispatch(&plan->dispatches[FA_BACKWARD_DKDV], tiled, "dkdv", dtype);
    fa_plan_set_contiguous_tiles(dkdv, &a->q, &a->dout, a->device);
    fa_plan_set_block_grid(dkdv, f->kv_len, rows_per_group, (uint32_t)f->kv_heads, (uint32_t)f->batch,
                           forward.banded, threads);
    fa_plan_dispatch *dq = set_dispatch(&plan->dispatches[FA_BACKWARD_DQ], tiled, "dq", dtype);
    fa_plan_set_block_grid(dq, f->q_len, rows_per_group, (uint32_t)f->q_heads, (uint32_t)f->batch, forward.banded,
                           threads);
    plan->sequences = forward.sequences;
    if (plan->sequences) {
        fa_sequence_set_builder(&plan->sequence_builder, tiled, fa_backward_source, dtype, (uint32_t)f->batch);
    }
    return FA_OK;
}
