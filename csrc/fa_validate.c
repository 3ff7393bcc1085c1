/* Validation of descriptors (fa_validate.h): storage bounds, aliasing, and dtype names for messages. */
#include "fa_validate.h"

#include <stdio.h>
#include <string.h>

static const char *const dtype_names[] = {"float32", "float16", "bfloat16", "bool", "int32", "uint8"};

static const char *const kernel_type_names[] = {"float", "half", "bfloat"};

static const int64_t dtype_bytes[] = {4, 2, 2, 1, 4, 1};

const char *fa_dtype_name(int32_t dtype) { return dtype_names[dtype]; }

int64_t fa_dtype_bytes(int32_t dtype) { return dtype_bytes[dtype]; }

const char *fa_kernel_type_name(int32_t dtype) { return kernel_type_names[dtype]; }

void fa_describe_shape(const fa_tensor *t, char *out, size_t len) {
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
int32_t fa_check_tensor(const fa_tensor *t, const char *name, int32_t ndim, int32_t float32_only, fa_status *st) {
    if (t->ndim != ndim) {
        return fa_fail(st, FA_ERR_VALUE, "%s: expected a %d-D descriptor, got ndim=%d", name, ndim, t->ndim);
    }
    if (t->dtype < FA_F32 || t->dtype > FA_U8) {
        return fa_fail(st, FA_ERR_TYPE, "%s: unknown dtype code %d", name, t->dtype);
    }
    if (float32_only && t->dtype != FA_F32) {
        return fa_fail(st, FA_ERR_TYPE, "%s: must be float32, got %s", name, dtype_names[t->dtype]);
    }
    if (t->byte_offset % dtype_bytes[t->dtype] != 0) {
        return fa_fail(st, FA_ERR_VALUE, "%s: byte offset %lld is not a multiple of the %s element size (%lld bytes)",
                       name, (long long)t->byte_offset, dtype_names[t->dtype], (long long)dtype_bytes[t->dtype]);
    }
    int64_t last = 0; /* offset of the last addressed element, in elements */
    int32_t empty = 0;
    for (int32_t d = 0; d < ndim; ++d) {
        if (t->sizes[d] < 0 || t->strides[d] < 0) {
            return fa_fail(st, FA_ERR_VALUE, "%s: negative size or stride in dim %d (size %lld, stride %lld)", name, d,
                           (long long)t->sizes[d], (long long)t->strides[d]);
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

/* The bytes [*lo, *hi) of its storage a validated view addresses; 0 if it addresses none. */
static int32_t byte_extent(const fa_tensor *t, int64_t *lo, int64_t *hi) {
    int64_t last = 0;
    for (int32_t d = 0; d < t->ndim; ++d) {
        if (t->sizes[d] == 0) {
            return 0;
        }
        last += (t->sizes[d] - 1) * t->strides[d]; /* fa_check_tensor ruled out overflow */
    }
    *lo = t->byte_offset;
    *hi = t->byte_offset + (last + 1) * dtype_bytes[t->dtype];
    return t->storage != NULL;
}

/* Whether two elements of a validated view share an address: with the dims of size > 1 ordered by
 * stride, each stride must pass the span of the smaller ones. */
static int32_t overlaps_itself(const fa_tensor *t) {
    int32_t order[FA_MAX_DIMS], n = 0;
    for (int32_t d = 0; d < t->ndim; ++d) {
        if (t->sizes[d] == 0) {
            return 0;
        }
        if (t->sizes[d] > 1) {
            int32_t i = n++;
            for (; i > 0 && t->strides[order[i - 1]] > t->strides[d]; --i) {
                order[i] = order[i - 1];
            }
            order[i] = d;
        }
    }
    int64_t span = 0; /* offset of the last element of the dims so far */
    for (int32_t i = 0; i < n; ++i) {
        if (t->strides[order[i]] <= span) {
            return 1;
        }
        span += (t->sizes[order[i]] - 1) * t->strides[order[i]];
    }
    return 0;
}

int32_t fa_check_no_alias(const fa_tensor *const *views, const char *const *names, int32_t n_views, int32_t n_outputs,
                          fa_status *st) {
    for (int32_t i = 0; i < n_outputs; ++i) {
        int64_t lo, hi, lo2, hi2;
        if (!byte_extent(views[i], &lo, &hi)) {
            continue;
        }
        if (overlaps_itself(views[i])) {
            char shape[96];
            fa_describe_shape(views[i], shape, sizeof shape);
            return fa_fail(st, FA_ERR_VALUE,
                           "%s: an output whose elements overlap (shape %s, strides %lld, %lld, ...); outputs must "
                           "address each element once",
                           names[i], shape, (long long)views[i]->strides[0], (long long)views[i]->strides[1]);
        }
        for (int32_t j = i + 1; j < n_views; ++j) {
            if (byte_extent(views[j], &lo2, &hi2) && views[j]->storage == views[i]->storage && lo < hi2 && lo2 < hi) {
                return fa_fail(st, FA_ERR_VALUE,
                               "%s (bytes %lld..%lld of its storage) overlaps %s (bytes %lld..%lld of the same "
                               "storage); an output must not alias an input or another output",
                               names[i], (long long)lo, (long long)hi, names[j], (long long)lo2, (long long)hi2);
            }
        }
    }
    return FA_OK;
}

int32_t fa_check_slot_aliases(const void *args, int32_t direction, int32_t with_workspace, fa_status *st) {
    const fa_tensor *views[FA_SLOT_COUNT];
    const char *names[FA_SLOT_COUNT];
    int32_t n = 0, outputs = 0;
    for (int32_t pass = 0; pass < 2; ++pass) { /* the outputs first, then the inputs */
        for (int32_t i = 0; i < FA_SLOT_COUNT; ++i) {
            const fa_tensor_slot *slot = &fa_tensor_slots[i];
            const fa_tensor *t = fa_slot_tensor(args, direction, i);
            const int32_t role = direction == FA_FORWARD ? slot->forward_role : slot->backward_role;
            if (t == NULL || role != (pass == 0 ? FA_ROLE_OUTPUT : FA_ROLE_INPUT) ||
                (i == FA_SLOT_WORKSPACE && !with_workspace)) {
                continue;
            }
            views[n] = t;
            names[n++] = slot->name;
        }
        if (pass == 0) {
            outputs = n;
        }
    }
    return fa_check_no_alias(views, names, n, outputs, st);
}

int32_t fa_check_no_empty_slot(const void *args, int32_t direction, fa_status *st) {
    for (int32_t i = 0; i < FA_SLOT_COUNT; ++i) {
        const fa_tensor *t = fa_slot_tensor(args, direction, i);
        if (t == NULL || i == FA_SLOT_WORKSPACE || fa_tensor_slots[i].dtype_rule == FA_RULE_TABLE ||
            !fa_tensor_present(t)) {
            continue;
        }
        for (int32_t d = 0; d < t->ndim && d < FA_MAX_DIMS; ++d) {
            if (t->sizes[d] == 0) {
                char shape[96];
                fa_describe_shape(t, shape, sizeof shape);
                return fa_fail(st, FA_ERR_VALUE,
                               "%s: an empty tensor %s in a call that launches kernels; no kernel runs on an empty "
                               "tensor (flashattn_mps returns the result of such a call without the core)",
                               fa_tensor_slots[i].name, shape);
            }
        }
    }
    return FA_OK;
}

int32_t fa_plan_check_workspace(int64_t workspace_bytes, const fa_tensor *w, fa_status *st) {
    if (workspace_bytes == 0) {
        return FA_OK;
    }
    if (w->storage == NULL) {
        return fa_fail(st, FA_ERR_VALUE, "this call needs a workspace of %lld bytes (fa_forward_workspace_bytes)",
                       (long long)workspace_bytes);
    }
    int32_t rc = fa_check_tensor(w, "workspace", 1, 1, st);
    if (rc == FA_OK && w->sizes[0] * 4 < workspace_bytes) {
        rc = fa_fail(st, FA_ERR_VALUE, "workspace: %lld bytes, this call needs %lld", (long long)(w->sizes[0] * 4),
                     (long long)workspace_bytes);
    }
    if (rc == FA_OK && w->strides[0] != 1) {
        rc = fa_fail(st, FA_ERR_VALUE, "workspace: must be contiguous, got stride %lld", (long long)w->strides[0]);
    }
    return rc;
}
