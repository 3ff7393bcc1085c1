/* Binding and the sequence-table kernel, for fa_forward.c and fa_backward.c (fa_execute.h). */
#include "fa_execute.h"

#include <string.h>

int32_t fa_sequence_prepare(const fa_ready_dispatch *builder, const void *params, int64_t params_bytes,
                            const void *args, int32_t direction, fa_dispatch *d, fa_status *st) {
    const fa_sequence_args *s = (const fa_sequence_args *)fa_slot_tensor(args, direction, FA_SLOT_SEQUENCES);
    /* the scratch it writes must overlap no other tensor of the call */
    const fa_tensor *checked[FA_SLOT_COUNT];
    const char *checked_names[FA_SLOT_COUNT];
    int32_t n = 0;
    checked[n] = &s->scratch;
    checked_names[n++] = "sequence_scratch";
    checked[n] = &s->table;
    checked_names[n++] = "sequences";
    for (int32_t i = 0; i < FA_SLOT_COUNT; ++i) {
        const fa_tensor *t = fa_slot_tensor(args, direction, i);
        if (t != NULL && (direction == FA_FORWARD ? fa_tensor_slots[i].forward_role
                                                  : fa_tensor_slots[i].backward_role) != FA_ROLE_SCRATCH) {
            checked[n] = t;
            checked_names[n++] = fa_tensor_slots[i].name;
        }
    }
    memset(d, 0, sizeof *d);
    const int32_t rc = fa_check_no_alias(checked, checked_names, n, 1, st);
    if (rc != FA_OK || s->table.sizes[0] == 0) {
        return rc; /* no sequences: d runs nothing (an empty grid) */
    }
    d->bindings[FA_TABLE_BUFFER_ENTRIES] = fa_tensor_binding(&s->table, &s->table);
    for (int i = FA_TABLE_BUFFER_OUT; i < FA_TABLE_BUFFERS; ++i) {
        d->bindings[i] = fa_tensor_binding(&s->scratch, &s->scratch); /* unused but the first: Metal wants an
                                                                          argument table without holes */
    }
    d->bindings[FA_TABLE_BUFFER_PARAMS].bytes = params;
    d->bindings[FA_TABLE_BUFFER_PARAMS].length = params_bytes;
    d->n_bindings = FA_TABLE_BUFFERS;
    memcpy(d->grid, builder->grid, sizeof d->grid);
    memcpy(d->threadgroup, builder->threadgroup, sizeof d->threadgroup);
    return FA_OK;
}

int32_t fa_sequence_build(const fa_backend *backend, const fa_ready_dispatch *builder, const void *params,
                          int64_t params_bytes, const void *args, int32_t direction, fa_status *st) {
    fa_dispatch d;
    const int32_t rc = fa_sequence_prepare(builder, params, params_bytes, args, direction, &d, st);
    if (rc != FA_OK || d.n_bindings == 0) {
        return rc;
    }
    return backend->dispatch(&builder->pipeline, &d, 1, st);
}

/* Every kernel reads the sequence scratch as `constant fa_params *`: without a table it is bound to
 * these zeros, never to a tensor the call writes (a constant buffer must not alias a written one).
 * One fa_params long, so a bound length check sees room for the element type. */
static const fa_params k_no_sequences;

void fa_bind_slots(fa_dispatch *d, const void *args, int32_t direction, const fa_tensor *present) {
    for (int32_t i = 0; i < FA_SLOT_COUNT; ++i) {
        const fa_tensor *t = fa_slot_tensor(args, direction, i);
        const int32_t buffer =
            direction == FA_FORWARD ? fa_tensor_slots[i].forward_buffer : fa_tensor_slots[i].backward_buffer;
        if (t == NULL || buffer < 0) {
            continue;
        }
        if (i == FA_SLOT_SEQUENCE_SCRATCH && t->storage == NULL) {
            d->bindings[buffer].bytes = &k_no_sequences;
            d->bindings[buffer].length = (int64_t)sizeof k_no_sequences;
        } else {
            d->bindings[buffer] = fa_tensor_binding(t, present);
        }
    }
}
