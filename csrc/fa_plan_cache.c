/* The plan cache (fa_plan_cache.h): direct-mapped tables of recent plans with their pipelines.
 * A table is small and bounded (decode changes the key length every token; old shapes are simply
 * overwritten); a hit copies its plan out under the table's lock. */
#include "fa_plan_cache.h"
#include "fa_cache.h"
#include "fa_plan_sequences.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

enum { PLAN_SLOTS = 256 };

/* What a descriptor contributes to a plan: everything but its storage, size and byte offset, except
 * the alignment of its first element (the planner's choice of the contiguous tile loads depends on
 * it: fa_plan_set_contiguous_tiles). */
enum { PLAN_ALIGNMENT_BYTES = 16 }; /* FA_TILE_VEC elements of the widest dtype */
typedef struct shape_key {
    int32_t dtype, ndim;
    int64_t start_residue; /* first element's address (MPS: byte offset) modulo PLAN_ALIGNMENT_BYTES */
    int64_t sizes[FA_MAX_DIMS], strides[FA_MAX_DIMS];
} shape_key;

/* A plan's key: the kernel text's generation (sources: plan_generation), the device, the options
 * as bytes (fa_options has no padding) and one shape per tensor slot of the call's direction that
 * determines the plan (fa_tensor_slots; an absent optional one stays zero). Nothing is listed by
 * hand, so a new option or slot is part of the key as soon as it is part of the contract. */
typedef struct plan_key {
    int32_t sources, device;
    fa_options options;
    shape_key shapes[FA_SLOT_COUNT]; /* the direction's key slots, in table order; the rest unused */
} plan_key;

typedef struct plan_table {
    pthread_mutex_t lock;
    size_t key_bytes, value_bytes;
    unsigned char *slots; /* PLAN_SLOTS x (hash, key, value), allocated on first store */
} plan_table;

/* key_bytes is the room for a key; a direction's keys use its first bytes (key_of), compared as such. */
static plan_table forward_plans = {PTHREAD_MUTEX_INITIALIZER, sizeof(plan_key), sizeof(fa_forward_ready), NULL};
static plan_table backward_plans = {PTHREAD_MUTEX_INITIALIZER, sizeof(plan_key), sizeof(fa_backward_ready), NULL};

/* Lookups that found their plan and those that planned afresh, forward then backward. */
static atomic_llong plan_counts[4];

void fa_plan_cache_counts(int64_t counts[4]) {
    for (int i = 0; i < 4; ++i) {
        counts[i] = atomic_load_explicit(&plan_counts[i], memory_order_relaxed);
    }
}

static size_t slot_bytes(const plan_table *t) { return sizeof(uint64_t) + t->key_bytes + t->value_bytes; }

/* Copies the plan stored under key into value and returns 1, or returns 0. A hash of 0 marks an
 * empty slot, so a real hash of 0 is stored as 1. */
static int32_t table_find(plan_table *t, const void *key, size_t key_bytes, uint64_t hash, void *value) {
    hash += hash == 0;
    int32_t found = 0;
    pthread_mutex_lock(&t->lock);
    if (t->slots != NULL) {
        const unsigned char *slot = t->slots + (hash % PLAN_SLOTS) * slot_bytes(t);
        uint64_t stored;
        memcpy(&stored, slot, sizeof stored);
        if (stored == hash && memcmp(slot + sizeof stored, key, key_bytes) == 0) {
            memcpy(value, slot + sizeof stored + t->key_bytes, t->value_bytes);
            found = 1;
        }
    }
    pthread_mutex_unlock(&t->lock);
    return found;
}

/* Stores a plan, replacing whatever shared its slot; a table that cannot be allocated stays empty
 * (every call then plans afresh, correctly). */
static void table_store(plan_table *t, const void *key, size_t key_bytes, uint64_t hash, const void *value) {
    hash += hash == 0;
    pthread_mutex_lock(&t->lock);
    if (t->slots == NULL) {
        t->slots = calloc(PLAN_SLOTS, slot_bytes(t));
    }
    if (t->slots != NULL) {
        unsigned char *slot = t->slots + (hash % PLAN_SLOTS) * slot_bytes(t);
        memcpy(slot, &hash, sizeof hash);
        memcpy(slot + sizeof hash, key, key_bytes);
        memcpy(slot + sizeof hash + t->key_bytes, value, t->value_bytes);
    }
    pthread_mutex_unlock(&t->lock);
}

/* The key is memset first, so padding and unused dims compare equal. */
static void shape_of(const fa_tensor *t, int32_t device, shape_key *s) {
    const uint64_t start = (uint64_t)t->byte_offset + (device == FA_DEVICE_CPU ? (uint64_t)(uintptr_t)t->storage : 0);
    s->dtype = t->dtype;
    s->ndim = t->ndim;
    s->start_residue = (int64_t)(start % PLAN_ALIGNMENT_BYTES);
    for (int32_t d = 0; d < t->ndim && d < FA_MAX_DIMS; ++d) {
        s->sizes[d] = t->sizes[d];
        s->strides[d] = t->strides[d];
    }
}

/* A plan's key part `sources`: the kernel text's generation, and for the CPU device whether its
 * libraries are built checked, so a plan never runs old text or a pipeline of the other mode. */
static int32_t plan_generation(int32_t device) {
    /* The device's generation is below 4 (cpu_device/metal_cpu.h). */
    return fa_sources_generation() * 4 + (device == FA_DEVICE_CPU ? (int32_t)fa_cpu_backend_generation() : 0);
}

static const fa_backend *backend_of(int32_t device, fa_status *st) {
    return device == FA_DEVICE_MPS ? fa_metal_backend(st) : fa_cpu_backend();
}

/* The plan's pipelines, every one before any dispatch, so a compile error never leaves half a
 * plan encoded. Steps with an empty grid (backward) get none. */
static int32_t resolve(const fa_backend *backend, const fa_plan_dispatch *steps, uint32_t n, int32_t skip_empty,
                       fa_ready_dispatch *ready, fa_status *st) {
    for (uint32_t i = 0; i < n; ++i) {
        const fa_plan_dispatch *step = &steps[i];
        fa_ready_dispatch *r = &ready[i];
        memcpy(r->grid, step->grid, sizeof r->grid);
        memcpy(r->threadgroup, step->threadgroup, sizeof r->threadgroup);
        memcpy(r->threadgroup_bytes, step->threadgroup_bytes, sizeof r->threadgroup_bytes);
        r->n_threadgroup_args = step->n_threadgroup_args;
        r->pipeline = NULL;
        if (skip_empty && (step->grid[0] == 0 || step->grid[1] == 0 || step->grid[2] == 0)) {
            continue;
        }
        const fa_pipeline_key key = fa_plan_pipeline_key(step);
        if ((r->pipeline = backend->get_pipeline(&key, st)) == NULL) {
            return st->code;
        }
    }
    return FA_OK;
}

/* The checks a cached plan cannot vouch for: every present (or required) descriptor's elements
 * inside its storage, by the slot table (the sequence tables by their own checks; the workspace by
 * execute). The outputs' aliasing is checked by execute (forward) or here (backward). */
static int32_t check_storage(const void *a, int32_t device, int32_t direction, fa_status *st) {
    const int32_t optional_bit = direction == FA_FORWARD ? FA_OPTIONAL_FORWARD : FA_OPTIONAL_BACKWARD;
    for (int32_t i = 0; i < FA_SLOT_COUNT; ++i) {
        const fa_tensor_slot *slot = &fa_tensor_slots[i];
        const fa_tensor *t = fa_slot_tensor(a, direction, i);
        if (t == NULL || i == FA_SLOT_WORKSPACE || slot->dtype_rule == FA_RULE_TABLE) {
            continue;
        }
        const int32_t required =
            !(slot->optional & optional_bit) || (slot->required_with != FA_SLOT_NONE &&
                                                 fa_tensor_present(fa_slot_tensor(a, direction, slot->required_with)));
        int32_t rc;
        if ((required || fa_tensor_present(t)) &&
            (rc = fa_check_tensor(t, slot->name, slot->rank, slot->dtype_rule == FA_RULE_FLOAT32, st)) != FA_OK) {
            return rc;
        }
    }
    const fa_sequence_args *s = (const fa_sequence_args *)fa_slot_tensor(a, direction, FA_SLOT_SEQUENCES);
    return fa_sequences_present(s) ? fa_sequence_check_storage(s, device, st) : FA_OK;
}

/* The key of a call: see plan_key. Returns the bytes of it that count. */
static size_t key_of(const void *a, int32_t device, const fa_options *options, int32_t direction, plan_key *key) {
    memset(key, 0, sizeof *key);
    key->sources = plan_generation(device);
    key->device = device;
    key->options = *options;
    int32_t n = 0;
    for (int32_t i = 0; i < FA_SLOT_COUNT; ++i) {
        const fa_tensor *t = fa_slot_tensor(a, direction, i);
        if (t != NULL && fa_tensor_slots[i].in_plan_key) {
            if (fa_tensor_present(t)) {
                shape_of(t, device, &key->shapes[n]);
            }
            ++n;
        }
    }
    return offsetof(plan_key, shapes) + (size_t)n * sizeof(shape_key);
}

/* The table kernel's pipeline, when the plan has one. */
static int32_t resolve_builder(const fa_backend *backend, int32_t sequences, const fa_plan_dispatch *builder,
                               fa_ready_dispatch *ready, fa_status *st) {
    return sequences ? resolve(backend, builder, 1, 0, ready, st) : FA_OK;
}

static plan_table *table_of(int32_t direction) { return direction == FA_FORWARD ? &forward_plans : &backward_plans; }

/* Whether the direction's table holds the plan of call a (copied into ready); the key, its bytes
 * and its hash, to store a new plan under. */
static int32_t lookup(const void *a, int32_t device, const fa_options *options, int32_t direction, void *ready,
                      plan_key *key, size_t *key_bytes, uint64_t *hash) {
    *key_bytes = key_of(a, device, options, direction, key);
    *hash = fa_hash_bytes(key, *key_bytes);
    const int32_t found = table_find(table_of(direction), key, *key_bytes, *hash, ready);
    atomic_fetch_add_explicit(&plan_counts[2 * (direction == FA_BACKWARD) + !found], 1, memory_order_relaxed);
    return found;
}

int32_t fa_forward_prepare(const fa_forward_args *a, fa_forward_ready *ready, fa_status *st) {
    if (a == NULL || ready == NULL) {
        return fa_fail(st, FA_ERR_VALUE, "fa_forward_prepare: NULL argument");
    }
    plan_key key;
    size_t key_bytes;
    uint64_t hash;
    if (lookup(a, a->device, &a->options, FA_FORWARD, ready, &key, &key_bytes, &hash)) {
        return check_storage(a, a->device, FA_FORWARD, st);
    }

    fa_plan plan;
    int32_t rc = fa_plan_forward(a, &plan, st);
    if (rc != FA_OK) {
        return rc;
    }
    memset(ready, 0, sizeof *ready);
    ready->params = plan.params;
    ready->workspace_bytes = plan.workspace_bytes;
    ready->empty = plan.empty;
    ready->n_dispatches = plan.n_dispatches;
    if (!plan.empty) {
        if ((ready->backend = backend_of(a->device, st)) == NULL) {
            return st->code;
        }
        if ((rc = resolve(ready->backend, plan.dispatches, plan.n_dispatches, 0, ready->dispatches, st)) != FA_OK ||
            (rc = resolve_builder(ready->backend, plan.sequences, &plan.sequence_builder, &ready->sequence_builder,
                                  st)) != FA_OK) {
            return rc;
        }
    }
    table_store(&forward_plans, &key, key_bytes, hash, ready);
    return FA_OK;
}

int32_t fa_backward_prepare(const fa_backward_args *a, fa_backward_ready *ready, fa_status *st) {
    if (a == NULL || ready == NULL) {
        return fa_fail(st, FA_ERR_VALUE, "fa_backward_prepare: NULL argument");
    }
    plan_key key;
    size_t key_bytes;
    uint64_t hash;
    if (lookup(a, a->device, &a->options, FA_BACKWARD, ready, &key, &key_bytes, &hash)) {
        int32_t rc = check_storage(a, a->device, FA_BACKWARD, st);
        return rc != FA_OK ? rc : fa_plan_check_backward_aliases(a, st);
    }

    fa_backward_plan plan;
    int32_t rc = fa_plan_backward(a, &plan, st);
    if (rc != FA_OK) {
        return rc;
    }
    memset(ready, 0, sizeof *ready);
    ready->params = plan.params;
    ready->workspace_bytes = plan.workspace_bytes;
    if ((ready->backend = backend_of(a->device, st)) == NULL) {
        return st->code;
    }
    if ((rc = resolve(ready->backend, plan.dispatches, FA_BACKWARD_DISPATCHES, 1, ready->dispatches, st)) != FA_OK ||
        (rc = resolve_builder(ready->backend, plan.sequences, &plan.sequence_builder, &ready->sequence_builder, st)) !=
            FA_OK) {
        return rc;
    }
    table_store(&backward_plans, &key, key_bytes, hash, ready);
    return FA_OK;
}
