/* Validation and planning of the forward pass. */
#include "fa_plan.h"

#include <stdio.h>
#include <string.h>

static const char *const dtype_names[] = {"float32", "float16", "bfloat16"};
static const char *const kernel_type_names[] = {"float", "half", "bfloat"};
static const int64_t dtype_bytes[] = {4, 2, 2};

static const char *simple_source = "fa_simple.metal";
static const char *forward_source = "fa_forward.metal";

/* The forward kernel's tile table.
 *
 * Head dims are padded (inside the kernel, never by copying) to one of these widths, so a handful of
 * specialisations cover every E and Ev in 0..256: steps of 16 up to 128, where common models live,
 * then 32.
 *
 * Keys per tile (BK) by element size and the wider padded head dim, max(BD, BDV). Each entry keeps
 * the K and V tiles, BK * (BD + 8 + BDV + 8) elements of threadgroup memory, under Apple7-9's 32 KiB
 * (the largest use is 18 KiB, leaving room for a second resident threadgroup at D <= 64):
 *   4-byte elements: D <= 64: BK 32 (18.0 KiB); D <= 128: BK 16 (17.0 KiB); D <= 256: BK 8 (16.5 KiB)
 *   2-byte elements: D <= 128: BK 32 (17.0 KiB); D <= 256: BK 16 (16.5 KiB)
 * Registers per thread: BD/4 (Q) + BDV/4 (O) + BK/4 (S) floats, at most 64 + 64 + 8 at D = 256,
 * which is where spilling may start on Apple GPUs (to be measured on a Mac).
 * WM = 4 SIMD-groups, so 32 query rows per threadgroup (MLX uses the same), 128 threads. */
static const int32_t padded_head_dims[] = {16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256};
enum { N_PADDED_HEAD_DIMS = sizeof padded_head_dims / sizeof padded_head_dims[0], FORWARD_WM = 4 };

typedef struct forward_tiles {
    int32_t bd, bdv, bk, wm;
} forward_tiles;

static int32_t padded_head_dim(int64_t d) {
    for (int32_t i = 0; i < N_PADDED_HEAD_DIMS; ++i) {
        if (d <= padded_head_dims[i]) {
            return padded_head_dims[i];
        }
    }
    return -1; /* validated away before */
}

static forward_tiles choose_forward_tiles(int64_t e, int64_t ev, int32_t element_bytes) {
    forward_tiles t = {padded_head_dim(e), padded_head_dim(ev), 0, FORWARD_WM};
    const int32_t widest = t.bd > t.bdv ? t.bd : t.bdv;
    if (element_bytes == 4) {
        t.bk = widest <= 64 ? 32 : widest <= 128 ? 16 : 8;
    } else {
        t.bk = widest <= 128 ? 32 : 16;
    }
    return t;
}

enum { FA_MAX_HEAD_DIM = 256 };

static void describe_shape(const fa_tensor *t, char *out, size_t len) {
    size_t used = (size_t)snprintf(out, len, "(");
    for (int32_t d = 0; d < t->ndim && d < FA_MAX_DIMS && used < len; ++d) {
        used += (size_t)snprintf(out + used, len - used, d ? ", %lld" : "%lld", (long long)t->sizes[d]);
    }
    if (used < len) {
        snprintf(out + used, len - used, ")");
    }
}

/* A descriptor is usable when its rank and dtype are as expected and every element it addresses
 * lies inside its storage (checked with overflow-safe 64-bit arithmetic). */
static int32_t check_tensor(const fa_tensor *t, const char *name, int32_t ndim, int32_t float32_only,
                            fa_status *st) {
    if (t->ndim != ndim) {
        return fa_fail(st, FA_ERR_VALUE, "%s: expected a %d-D descriptor, got ndim=%d", name, ndim, t->ndim);
    }
    if (t->dtype < FA_F32 || t->dtype > FA_BF16) {
        return fa_fail(st, FA_ERR_TYPE, "%s: unknown dtype code %d", name, t->dtype);
    }
    if (float32_only && t->dtype != FA_F32) {
        return fa_fail(st, FA_ERR_TYPE, "%s: must be float32, got %s", name, dtype_names[t->dtype]);
    }
    int64_t last = 0; /* offset of the last addressed element, in elements */
    int32_t empty = 0;
    for (int32_t d = 0; d < ndim; ++d) {
        if (t->sizes[d] < 0 || t->strides[d] < 0) {
            return fa_fail(st, FA_ERR_VALUE, "%s: negative size or stride in dim %d (size %lld, stride %lld)",
                           name, d, (long long)t->sizes[d], (long long)t->strides[d]);
        }
        empty |= t->sizes[d] == 0;
    }
    if (empty) {
        return FA_OK; /* addresses nothing */
    }
    for (int32_t d = 0; d < ndim; ++d) {
        int64_t span;
        if (__builtin_mul_overflow(t->sizes[d] - 1, t->strides[d], &span) ||
            __builtin_add_overflow(last, span, &last)) {
            return fa_fail(st, FA_ERR_VALUE, "%s: strides overflow 64-bit offsets", name);
        }
    }
    int64_t end_bytes;
    if (t->storage == NULL || t->byte_offset < 0 ||
        __builtin_mul_overflow(last + 1, dtype_bytes[t->dtype], &end_bytes) ||
        __builtin_add_overflow(end_bytes, t->byte_offset, &end_bytes) || end_bytes > t->storage_bytes) {
        return fa_fail(st, FA_ERR_VALUE,
                       "%s: the view (byte offset %lld, last element %lld) does not fit its storage of %lld bytes",
                       name, (long long)t->byte_offset, (long long)last, (long long)t->storage_bytes);
    }
    return FA_OK;
}

static int32_t check_shapes(const fa_forward_args *a, fa_status *st) {
    const int64_t *q = a->q.sizes, *k = a->k.sizes, *v = a->v.sizes, *o = a->out.sizes;
    char qs[96], ks[96], vs[96], os[96];
    describe_shape(&a->q, qs, sizeof qs);
    describe_shape(&a->k, ks, sizeof ks);
    describe_shape(&a->v, vs, sizeof vs);
    describe_shape(&a->out, os, sizeof os);
    if (a->k.dtype != a->q.dtype || a->v.dtype != a->q.dtype || a->out.dtype != a->q.dtype) {
        return fa_fail(st, FA_ERR_TYPE, "q, k, v and out must share one dtype, got %s, %s, %s, %s",
                       dtype_names[a->q.dtype], dtype_names[a->k.dtype], dtype_names[a->v.dtype],
                       dtype_names[a->out.dtype]);
    }
    if (k[0] != q[0] || v[0] != q[0]) {
        return fa_fail(st, FA_ERR_VALUE, "batch sizes differ: q %s, k %s, v %s", qs, ks, vs);
    }
    if (k[1] != v[1] || k[2] != v[2]) {
        return fa_fail(st, FA_ERR_VALUE, "k %s and v %s must have the same heads and sequence length", ks, vs);
    }
    if (k[3] != q[3]) {
        return fa_fail(st, FA_ERR_VALUE, "q %s and k %s must have the same head dim", qs, ks);
    }
    if (k[1] < 1 || q[1] % k[1] != 0) {
        return fa_fail(st, FA_ERR_VALUE, "q heads (%lld) must be a multiple of k/v heads (%lld): q %s, k %s",
                       (long long)q[1], (long long)k[1], qs, ks);
    }
    if (q[3] > FA_MAX_HEAD_DIM || v[3] > FA_MAX_HEAD_DIM) {
        return fa_fail(st, FA_ERR_VALUE, "head dims must be at most %d: q %s, v %s", FA_MAX_HEAD_DIM, qs, vs);
    }
    if (o[0] != q[0] || o[1] != q[1] || o[2] != q[2] || o[3] != v[3]) {
        return fa_fail(st, FA_ERR_VALUE, "out %s must be (B, Hq, L, Ev) for q %s and v %s", os, qs, vs);
    }
    if (a->lse.storage != NULL &&
        (a->lse.sizes[0] != q[0] || a->lse.sizes[1] != q[1] || a->lse.sizes[2] != q[2])) {
        return fa_fail(st, FA_ERR_VALUE, "lse must be (B, Hq, L) for q %s", qs);
    }
    /* Grid dimensions and kernel arguments are 32-bit. */
    const int64_t limit = INT32_MAX;
    if (q[0] > limit || q[1] > limit || q[2] > limit || k[2] > limit) {
        return fa_fail(st, FA_ERR_VALUE, "sizes beyond 2^31-1 are not supported: q %s, k %s", qs, ks);
    }
    return FA_OK;
}

static void copy_strides(fa_i64 *dst, const fa_tensor *t, int32_t n) {
    for (int32_t d = 0; d < n; ++d) {
        dst[d] = t->strides[d];
    }
}

static void add_constant_bool(fa_plan *plan, uint32_t index, int32_t value) {
    fa_constant *c = &plan->constants[plan->n_constants++];
    memset(c, 0, sizeof *c);
    c->index = index;
    c->kind = FA_CONST_BOOL;
    c->i = value != 0;
}

static void add_macro(fa_plan *plan, const char *name, int32_t value) {
    fa_macro *m = &plan->macros[plan->n_macros++];
    snprintf(m->name, sizeof m->name, "%s", name);
    snprintf(m->value, sizeof m->value, "%d", value);
}

static void set_forward_macros(fa_plan *plan, forward_tiles t) {
    add_macro(plan, "FA_BD", t.bd);
    add_macro(plan, "FA_BDV", t.bdv);
    add_macro(plan, "FA_BK", t.bk);
    add_macro(plan, "FA_WM", t.wm);
}

static void set_launch(fa_plan *plan, const fa_forward_args *a, int64_t rows_per_group, uint32_t threads) {
    plan->grid[0] = (uint32_t)((a->q.sizes[2] + rows_per_group - 1) / rows_per_group);
    plan->grid[1] = (uint32_t)a->q.sizes[1];
    plan->grid[2] = (uint32_t)a->q.sizes[0];
    plan->threadgroup[0] = threads;
    plan->threadgroup[1] = 1;
    plan->threadgroup[2] = 1;
    add_constant_bool(plan, FA_FC_CAUSAL, a->causal);
    add_constant_bool(plan, FA_FC_WRITE_LSE, a->lse.storage != NULL);
}

static int32_t plan_forward(const fa_forward_args *a, fa_plan *plan) {
    const forward_tiles t = choose_forward_tiles(a->q.sizes[3], a->v.sizes[3], (int32_t)dtype_bytes[a->q.dtype]);
    snprintf(plan->source_name, sizeof plan->source_name, "%s", forward_source);
    snprintf(plan->function, sizeof plan->function, "fa_forward_%s", kernel_type_names[a->q.dtype]);
    set_forward_macros(plan, t);
    set_launch(plan, a, 8 * t.wm, 32u * (uint32_t)t.wm);
    return FA_OK;
}

static int32_t plan_simple(const fa_forward_args *a, fa_plan *plan) {
    snprintf(plan->source_name, sizeof plan->source_name, "%s", simple_source);
    snprintf(plan->function, sizeof plan->function, "fa_simple_%s", kernel_type_names[a->q.dtype]);
    set_launch(plan, a, FA_SIMPLE_ROWS_PER_GROUP, 32u * FA_SIMPLE_ROWS_PER_GROUP);
    return FA_OK;
}

int32_t fa_plan_forward(const fa_forward_args *a, fa_plan *plan, fa_status *st) {
    if (a == NULL || plan == NULL) {
        return fa_fail(st, FA_ERR_VALUE, "fa_plan_forward: NULL argument");
    }
    memset(plan, 0, sizeof *plan);
    if (a->device != FA_DEVICE_CPU && a->device != FA_DEVICE_MPS) {
        return fa_fail(st, FA_ERR_TYPE, "unknown device code %d", a->device);
    }
    if (a->kernel < FA_KERNEL_AUTO || a->kernel > FA_KERNEL_FORWARD) {
        return fa_fail(st, FA_ERR_VALUE, "unknown kernel choice %d", a->kernel);
    }
    int32_t rc;
    if ((rc = check_tensor(&a->q, "q", 4, 0, st)) || (rc = check_tensor(&a->k, "k", 4, 0, st)) ||
        (rc = check_tensor(&a->v, "v", 4, 0, st)) || (rc = check_tensor(&a->out, "out", 4, 0, st)) ||
        (a->lse.storage != NULL && (rc = check_tensor(&a->lse, "lse", 3, 1, st))) ||
        (rc = check_shapes(a, st))) {
        return rc;
    }

    fa_params *p = &plan->params;
    p->batch = (fa_i32)a->q.sizes[0];
    p->q_heads = (fa_i32)a->q.sizes[1];
    p->kv_heads = (fa_i32)a->k.sizes[1];
    p->gqa_factor = p->q_heads / p->kv_heads;
    p->q_len = (fa_i32)a->q.sizes[2];
    p->kv_len = (fa_i32)a->k.sizes[2];
    p->head_dim = (fa_i32)a->q.sizes[3];
    p->v_head_dim = (fa_i32)a->v.sizes[3];
    copy_strides(p->q_strides, &a->q, 4);
    copy_strides(p->k_strides, &a->k, 4);
    copy_strides(p->v_strides, &a->v, 4);
    copy_strides(p->o_strides, &a->out, 4);
    if (a->lse.storage != NULL) {
        copy_strides(p->lse_strides, &a->lse, 3);
    }
    /* With E == 0 every score is exactly 0 whatever the scale (SDPA gives the mean of v even for
     * the default scale 1/sqrt(0) = inf), so the scale must not turn 0 into NaN. */
    p->scale_log2 = p->head_dim == 0 ? 0.0f : (float)(a->scale * 1.4426950408889634);

    plan->empty = p->batch == 0 || p->q_heads == 0 || p->q_len == 0;
    return a->kernel == FA_KERNEL_SIMPLE ? plan_simple(a, plan) : plan_forward(a, plan);
}

fa_pipeline_key fa_plan_pipeline_key(const fa_plan *plan) {
    fa_pipeline_key key = {plan->source_name, plan->function, plan->macros, plan->n_macros,
                           plan->constants, plan->n_constants};
    return key;
}

/* Macros decide what a library contains; every dtype's kernel is in each library, so the strict
 * check visits one key per (source, macro set), naming the float kernel. */
int32_t fa_plan_each_specialisation(fa_plan_visitor visit, void *ctx) {
    fa_pipeline_key simple = {simple_source, "fa_simple_float", NULL, 0, NULL, 0};
    int32_t rc = visit(&simple, ctx);
    for (int32_t i = 0; rc == 0 && i < N_PADDED_HEAD_DIMS; ++i) {
        for (int32_t j = 0; rc == 0 && j < N_PADDED_HEAD_DIMS; ++j) {
            for (int32_t element_bytes = 2; rc == 0 && element_bytes <= 4; element_bytes += 2) {
                fa_plan plan;
                memset(&plan, 0, sizeof plan);
                const forward_tiles t = choose_forward_tiles(padded_head_dims[i], padded_head_dims[j], element_bytes);
                set_forward_macros(&plan, t);
                fa_pipeline_key key = {forward_source, "fa_forward_float", plan.macros, plan.n_macros, NULL, 0};
                rc = visit(&key, ctx);
            }
        }
    }
    return rc;
}
