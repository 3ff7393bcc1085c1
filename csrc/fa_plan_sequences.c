/* Packed sequences and KV caches: see fa_plan_sequences.h. */
#include "fa_plan_sequences.h"
#include "../metal/fa_sequence.h"

#include <stdio.h>
#include <string.h>

enum { SEQUENCE_SCRATCH_ALIGNMENT = 16, SEQUENCE_TABLE_THREADS = FA_SEQUENCE_TABLE_THREADS };

int32_t fa_sequences_present(const fa_sequence_args *s) { return fa_tensor_present(&s->table); }

int32_t fa_sequence_paged(const fa_sequence_args *s) { return fa_tensor_present(&s->block_table); }

int32_t fa_sequence_check_storage(const fa_sequence_args *s, int32_t device, fa_status *st) {
    int32_t rc = fa_check_tensor(&s->table, "sequences", 2, 0, st);
    if (rc != FA_OK) {
        return rc;
    }
    if (s->table.dtype != FA_I32) {
        return fa_fail(st, FA_ERR_TYPE, "sequences: the table must be int32, got %s", fa_dtype_name(s->table.dtype));
    }
    const int64_t n = s->table.sizes[0];
    if (s->table.sizes[1] != FA_SEQUENCE_COLUMNS || (n > 0 && s->table.strides[1] != 1) ||
        (n > 1 && s->table.strides[0] != FA_SEQUENCE_COLUMNS)) {
        char shape[64];
        fa_describe_shape(&s->table, shape, sizeof shape);
        return fa_fail(st, FA_ERR_VALUE, "sequences: the table must be a contiguous (B, %d) int32 tensor, got %s",
                       FA_SEQUENCE_COLUMNS, shape);
    }
    if ((rc = fa_check_tensor(&s->scratch, "sequence_scratch", 1, 1, st)) != FA_OK) {
        return rc;
    }
    if (fa_sequence_paged(s)) {
        const fa_tensor *t = &s->block_table;
        if ((rc = fa_check_tensor(t, "block_table", 2, 0, st)) != FA_OK) {
            return rc;
        }
        if (t->dtype != FA_I32 || t->sizes[0] != n || t->sizes[1] < 1 || t->sizes[1] > INT32_MAX ||
            (n > 0 && t->strides[1] != 1) || (n > 1 && t->strides[0] != t->sizes[1])) {
            char shape[64];
            fa_describe_shape(t, shape, sizeof shape);
            return fa_fail(st, t->dtype != FA_I32 ? FA_ERR_TYPE : FA_ERR_VALUE,
                           "block_table: must be a contiguous (B, pages) int32 tensor with B = %lld, got %s %s",
                           (long long)n, fa_dtype_name(t->dtype), shape);
        }
    }
    const int64_t needed = n * (int64_t)sizeof(fa_params);
    const uint64_t start =
        (uint64_t)s->scratch.byte_offset + (device == FA_DEVICE_CPU ? (uint64_t)(uintptr_t)s->scratch.storage : 0);
    if (s->scratch.sizes[0] * 4 < needed || (s->scratch.sizes[0] > 1 && s->scratch.strides[0] != 1) ||
        start % SEQUENCE_SCRATCH_ALIGNMENT != 0) {
        return fa_fail(st, FA_ERR_VALUE,
                       "sequence_scratch: needs a contiguous float32 tensor of at least %lld bytes starting on a "
                       "%d-byte boundary, got %lld bytes",
                       (long long)needed, SEQUENCE_SCRATCH_ALIGNMENT, (long long)(s->scratch.sizes[0] * 4));
    }
    return FA_OK;
}

static void set_grid_view(fa_tensor *t, int64_t batch, int64_t rows) {
    t->sizes[0] = batch;
    t->sizes[2] = rows;
}

int32_t fa_sequence_grid_args(const fa_forward_args *a, fa_forward_args *grid, fa_status *st) {
    const fa_sequence_args *s = &a->sequences;
    int32_t rc = fa_sequence_check_storage(s, a->device, st);
    if (rc != FA_OK) {
        return rc;
    }
    if (fa_tensor_present(&a->mask)) {
        return fa_fail(st, FA_ERR_VALUE, "sequences: an attn_mask cannot be combined with a sequence table");
    }
    if (a->options.diagonal_offset != 0) {
        return fa_fail(st, FA_ERR_VALUE, "sequences: diagonal_offset cannot be combined with a sequence table");
    }
    if (a->options.max_q_len < 0 || a->options.max_q_len > INT32_MAX || a->options.max_kv_len < 0 ||
        a->options.max_kv_len > INT32_MAX) {
        return fa_fail(st, FA_ERR_VALUE, "max_seqlen_q and max_seqlen_k must be in [0, 2^31), got %lld and %lld",
                       (long long)a->options.max_q_len, (long long)a->options.max_kv_len);
    }
    const int64_t *q = a->q.sizes, *o = a->out.sizes, *k = a->k.sizes, *v = a->v.sizes;
    if (o[0] != q[0] || o[2] != q[2] ||
        (a->lse.storage != NULL && (a->lse.sizes[0] != q[0] || a->lse.sizes[2] != q[2]))) {
        return fa_fail(st, FA_ERR_VALUE, "sequences: out and lse must have q's batches and rows");
    }
    if (v[0] != k[0] || v[2] != k[2]) {
        return fa_fail(st, FA_ERR_VALUE, "sequences: k and v must have the same batches and rows");
    }
    if (q[0] > INT32_MAX || q[2] > INT32_MAX || k[0] > INT32_MAX || k[2] > INT32_MAX) {
        return fa_fail(st, FA_ERR_VALUE, "sequences: views beyond 2^31-1 batches or rows are not supported");
    }
    if (fa_sequence_paged(s)) {
        if (a->options.kernel == FA_KERNEL_SIMPLE || a->options.write_probs) {
            return fa_fail(st, FA_ERR_VALUE,
                           "block_table: a paged KV cache is read by the prefill and decode "
                           "kernels only (forward, no gradients)");
        }
        if (k[0] < 1 || k[2] < 1 || k[2] * s->block_table.sizes[1] > INT32_MAX) {
            return fa_fail(st, FA_ERR_VALUE,
                           "block_table: the pool must hold pages of at least one row, and pages x page size must "
                           "be below 2^31 (pool %lld pages of %lld rows, %lld per sequence)",
                           (long long)k[0], (long long)k[2], (long long)s->block_table.sizes[1]);
        }
    }
    *grid = *a;
    const int64_t batch = s->table.sizes[0];
    set_grid_view(&grid->q, batch, a->options.max_q_len);
    set_grid_view(&grid->out, batch, a->options.max_q_len);
    set_grid_view(&grid->k, batch, a->options.max_kv_len);
    set_grid_view(&grid->v, batch, a->options.max_kv_len);
    if (grid->lse.storage != NULL) {
        set_grid_view(&grid->lse, batch, a->options.max_q_len);
    }
    return FA_OK;
}

void fa_sequence_set_params(const fa_forward_args *real, fa_params *p) {
    p->seq_q_batches = (fa_i32)real->q.sizes[0];
    p->seq_q_rows = (fa_i32)real->q.sizes[2];
    p->seq_k_batches = (fa_i32)real->k.sizes[0];
    p->seq_k_rows = (fa_i32)real->k.sizes[2];
    const fa_options *o = &real->options;
    p->seq_window_left = o->window_left >= 0 ? (fa_i32)(o->window_left < INT32_MAX ? o->window_left : INT32_MAX) : -1;
    p->seq_window_right = o->causal              ? 0
                          : o->window_right >= 0 ? (fa_i32)(o->window_right < INT32_MAX ? o->window_right : INT32_MAX)
                                                 : -1;
    p->seq_bottom_right = o->bottom_right != 0;
    p->seq_grid_q_len = p->q_len;
    const fa_sequence_args *s = &real->sequences;
    if (fa_sequence_paged(s)) { /* a sequence's keys: every page its table row names */
        p->page_size = (fa_i32)real->k.sizes[2];
        p->pages_per_sequence = (fa_i32)s->block_table.sizes[1];
        p->page_count = (fa_i32)real->k.sizes[0];
        p->seq_k_batches = 1;
        p->seq_k_rows = p->page_size * p->pages_per_sequence;
    }
}

void fa_sequence_set_builder(fa_plan_dispatch *builder, const fa_plan_dispatch *like, const char *source, int32_t dtype,
                             uint32_t sequences) {
    memset(builder, 0, sizeof *builder);
    snprintf(builder->source_name, sizeof builder->source_name, "%s", source);
    snprintf(builder->function, sizeof builder->function, "fa_sequence_table_%s", fa_kernel_type_name(dtype));
    memcpy(builder->macros, like->macros, sizeof builder->macros);
    builder->n_macros = like->n_macros;
    fa_plan_set_geometry(builder, (sequences + SEQUENCE_TABLE_THREADS - 1) / SEQUENCE_TABLE_THREADS, 1, 1,
                         SEQUENCE_TABLE_THREADS);
    /* explain_plan's figures: the table's rows and the call's params in, one params per sequence out. */
    builder->cost.min_bytes_read = (int64_t)sequences * FA_SEQUENCE_COLUMNS * 4 + (int64_t)sizeof(fa_params);
    builder->cost.min_bytes_written = (int64_t)sequences * (int64_t)sizeof(fa_params);
}
