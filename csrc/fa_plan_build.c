/* Plan-building helpers shared by the planners: a dispatch's source, function, macros, function
 * constants and geometry (fa_plan_build.h). */
#include "fa_plan_build.h"

#include <stdio.h>
#include <string.h>

void fa_plan_copy_strides(fa_i64 *dst, const fa_tensor *t, int32_t n) {
    for (int32_t d = 0; d < n; ++d) {
        dst[d] = t->strides[d];
    }
}

void fa_plan_add_constant(fa_plan_dispatch *d, uint32_t index, int32_t kind, int64_t value) {
    uint32_t at = 0;
    while (at < d->n_constants && d->constants[at].index != index) {
        ++at; /* a constant already set is replaced */
    }
    d->n_constants += at == d->n_constants;
    fa_constant *c = &d->constants[at];
    memset(c, 0, sizeof *c);
    c->index = index;
    c->kind = kind;
    c->i = value;
}

void fa_plan_add_constant_bool(fa_plan_dispatch *d, uint32_t index, int32_t value) {
    fa_plan_add_constant(d, index, FA_CONST_BOOL, value != 0);
}

/* Whether a tensor's (row, column) tiles may take the tiled kernels' contiguous load path
 * (fa_loader.h): a unit column stride, a width that is a multiple of FA_TILE_VEC, every row start
 * aligned to FA_TILE_VEC elements (strides of the dims indexed and the view's start address; an
 * MTLBuffer's contents are page-aligned, a CPU storage is checked as it is), and in-tile offsets,
 * up to (tile rows + threads per threadgroup) row strides, within 32 bits. Size-1 dims are never
 * indexed, so their strides do not matter. */
static int32_t tiles_contiguous(const fa_tensor *t, int32_t device) {
    const int64_t vec = FA_TILE_VEC, align_bytes = FA_TILE_VEC * fa_dtype_bytes(t->dtype);
    const uint64_t start = (uint64_t)t->byte_offset + (device == FA_DEVICE_CPU ? (uint64_t)(uintptr_t)t->storage : 0);
    if (t->sizes[3] > 1 && t->strides[3] != 1) {
        return 0;
    }
    if (t->sizes[3] % vec != 0 || start % (uint64_t)align_bytes != 0) {
        return 0;
    }
    for (int32_t d = 0; d < 3; ++d) {
        if (t->sizes[d] > 1 && t->strides[d] % vec != 0) {
            return 0;
        }
    }
    return t->sizes[2] <= 1 || t->strides[2] <= FA_CONTIGUOUS_MAX_ROW_STRIDE;
}

void fa_plan_set_contiguous_tiles(fa_plan_dispatch *d, const fa_tensor *a, const fa_tensor *b, int32_t device) {
    fa_plan_add_constant_bool(d, FA_FC_CONTIGUOUS_TILES, tiles_contiguous(a, device) && tiles_contiguous(b, device));
}

void fa_plan_set_block_grid(fa_plan_dispatch *d, int64_t rows, int64_t rows_per_block, uint32_t heads, uint32_t batch,
                            int32_t banded, uint32_t threads) {
    const uint32_t blocks = (uint32_t)((rows + rows_per_block - 1) / rows_per_block);
    if (banded) {
        fa_plan_set_geometry(d, heads, batch, blocks, threads); /* heaviest first, fa_schedule.h */
    } else {
        fa_plan_set_geometry(d, blocks, heads, batch, threads);
    }
}

void fa_plan_add_constant_int(fa_plan_dispatch *d, uint32_t index, int32_t value) {
    fa_plan_add_constant(d, index, FA_CONST_INT, value);
}

void fa_plan_add_macro_text(fa_plan_dispatch *d, const char *name, const char *value) {
    uint32_t at = 0;
    while (at < d->n_macros && strcmp(d->macros[at].name, name) != 0) {
        ++at; /* a macro already set is replaced (the backward's own tiles, fa_plan_backward.c) */
    }
    d->n_macros += at == d->n_macros;
    fa_macro *m = &d->macros[at];
    snprintf(m->name, sizeof m->name, "%s", name);
    snprintf(m->value, sizeof m->value, "%s", value);
}

void fa_plan_add_macro(fa_plan_dispatch *d, const char *name, int32_t value) {
    char text[16];
    snprintf(text, sizeof text, "%d", value);
    fa_plan_add_macro_text(d, name, text);
}

/* Names function `<kernel>_<type>` of `source` and instantiates the library for that element type
 * only (FA_DTYPE, metal/fa_instantiate.h): the planner and fa_plan_each_specialisation both start
 * every dispatch here. */
void fa_plan_start_dispatch(fa_plan_dispatch *d, const char *source, const char *kernel, int32_t dtype) {
    snprintf(d->source_name, sizeof d->source_name, "%s", source);
    snprintf(d->function, sizeof d->function, "%s_%s", kernel, fa_kernel_type_name(dtype));
    fa_plan_add_macro_text(d, "FA_DTYPE", fa_kernel_type_name(dtype));
}

void fa_plan_set_tile_macros(fa_plan_dispatch *d, fa_tiles t) {
    fa_plan_add_macro(d, "FA_BD", t.bd);
    fa_plan_add_macro(d, "FA_BDV", t.bdv);
    fa_plan_add_macro(d, "FA_BK", t.bk);
    fa_plan_add_macro(d, "FA_WM", t.wm);
}

void fa_plan_set_exact_head_dims(fa_plan_dispatch *d, fa_tiles t, int64_t e, int64_t ev) {
    fa_plan_add_constant_bool(d, FA_FC_EXACT_HEAD_DIMS, e == t.bd && ev == t.bdv);
}

void fa_plan_set_geometry(fa_plan_dispatch *d, uint32_t x, uint32_t y, uint32_t z, uint32_t threads) {
    d->grid[0] = x;
    d->grid[1] = y;
    d->grid[2] = z;
    d->threadgroup[0] = threads;
    d->threadgroup[1] = 1;
    d->threadgroup[2] = 1;
}

int32_t fa_plan_check_column_grid(int64_t heads, int32_t column_blocks, fa_status *st) {
    if (heads * column_blocks > UINT32_MAX) {
        return fa_fail(st, FA_ERR_VALUE, "too many heads for head dims in %d column blocks: %lld heads", column_blocks,
                       (long long)heads);
    }
    return FA_OK;
}

fa_pipeline_key fa_plan_pipeline_key(const fa_plan_dispatch *d) {
    fa_pipeline_key key = {d->source_name, d->function, d->macros, d->n_macros, d->constants, d->n_constants};
    return key;
}
