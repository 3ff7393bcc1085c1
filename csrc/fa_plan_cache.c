/* The plan cache (fa_plan_cache.h): direct-mapped tables of recent plans with their pipelines.
 * A table is small and bounded (decode changes the key length every token; old shapes are simply
 * overwritten); a hit copies its plan out under the table's lock. */
#include "fa_plan_cache.h"
#include "fa_cache.h"
#include "fa_sequence.h"

#include <pthread.h>
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

/* sources: fa_sources_generation(), so new kernel text is never run through an old pipeline. */
typedef struct forward_key {
    int32_t sources, device, kernel, causal, has_lse, reserved;
    double scale, softcap;
    fa_band_args band;
    shape_key q, k, v, out, lse, mask, alibi, sinks;
    double dropout_p; /* dropout: the rate, the probability pass, the generator state's shape */
    int32_t write_probs, reserved_dropout;
    shape_key rng;
    shape_key sequences, block_table; /* the tables' shapes; the max lengths below */
    int64_t max_q_len, max_kv_len;
    int32_t num_splits, reserved_splits;
} forward_key;

typedef struct backward_key {
    int32_t sources, device, causal, has_lse;
    double scale, softcap;
    fa_band_args band;
    shape_key q, k, v, out, lse, dout, delta, dq, dk, dv, mask, alibi, sinks, sink_grad;
    double dropout_p; /* with the generator state's shape */
    shape_key rng;
    shape_key sequences, block_table;
    int64_t max_q_len, max_kv_len;
} backward_key;

typedef struct plan_table {
    pthread_mutex_t lock;
    size_t key_bytes, value_bytes;
    unsigned char *slots; /* PLAN_SLOTS x (hash, key, value), allocated on first store */
} plan_table;

static plan_table forward_plans = {PTHREAD_MUTEX_INITIALIZER, sizeof(forward_key), sizeof(fa_forward_ready), NULL};
static plan_table backward_plans = {PTHREAD_MUTEX_INITIALIZER, sizeof(backward_key), sizeof(fa_backward_ready), NULL};

static size_t slot_bytes(const plan_table *t) { return sizeof(uint64_t) + t->key_bytes + t->value_bytes; }

/* Copies the plan stored under key into value and returns 1, or returns 0. A hash of 0 marks an
 * empty slot, so a real hash of 0 is stored as 1. */
static int32_t table_find(plan_table *t, const void *key, uint64_t hash, void *value) {
    hash += hash == 0;
    int32_t found = 0;
    pthread_mutex_lock(&t->lock);
    if (t->slots != NULL) {
        const unsigned char *slot = t->slots + (hash % PLAN_SLOTS) * slot_bytes(t);
        uint64_t stored;
        memcpy(&stored, slot, sizeof stored);
        if (stored == hash && memcmp(slot + sizeof stored, key, t->key_bytes) == 0) {
            memcpy(value, slot + sizeof stored + t->key_bytes, t->value_bytes);
            found = 1;
        }
    }
    pthread_mutex_unlock(&t->lock);
    return found;
}

/* Stores a plan, replacing whatever shared its slot; a table that cannot be allocated stays empty
 * (every call then plans afresh, correctly). */
static void table_store(plan_table *t, const void *key, uint64_t hash, const void *value) {
    hash += hash == 0;
    pthread_mutex_lock(&t->lock);
    if (t->slots == NULL) {
        t->slots = calloc(PLAN_SLOTS, slot_bytes(t));
    }
    if (t->slots != NULL) {
        unsigned char *slot = t->slots + (hash % PLAN_SLOTS) * slot_bytes(t);
        memcpy(slot, &hash, sizeof hash);
        memcpy(slot + sizeof hash, key, t->key_bytes);
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

/* An optional descriptor (mask, ALiBi slopes) is present when it has dims or storage: a 0-D
 * descriptor with storage is refused by fa_check_tensor, never taken for "absent". */
/* An absent optional descriptor leaves its part of the key zero. */
static void shape_of_optional(const fa_tensor *t, int32_t device, shape_key *s) {
    if (fa_tensor_present(t)) {
        shape_of(t, device, s);
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

/* The checks a cached plan cannot vouch for: every descriptor's elements inside its storage (the
 * outputs' aliasing is checked by fa_forward_execute, for every call). */
static int32_t check_forward_storage(const fa_forward_args *a, fa_status *st) {
    int32_t rc;
    if ((rc = fa_check_tensor(&a->q, "q", 4, 0, st)) || (rc = fa_check_tensor(&a->k, "k", 4, 0, st)) ||
        (rc = fa_check_tensor(&a->v, "v", 4, 0, st)) || (rc = fa_check_tensor(&a->out, "out", 4, 0, st)) ||
        (a->lse.storage != NULL && (rc = fa_check_tensor(&a->lse, "lse", 3, 1, st))) ||
        (fa_tensor_present(&a->mask) && (rc = fa_check_tensor(&a->mask, "mask", 4, 0, st))) ||
        (fa_tensor_present(&a->alibi_slopes) && (rc = fa_check_tensor(&a->alibi_slopes, "alibi_slopes", 2, 1, st))) ||
        (fa_tensor_present(&a->rng_state) && (rc = fa_check_tensor(&a->rng_state, "rng_state", 1, 1, st))) ||
        (fa_tensor_present(&a->sinks) && (rc = fa_check_tensor(&a->sinks, "sinks", 1, 1, st))) ||
        (fa_sequences_present(&a->sequences) && (rc = fa_sequence_check_storage(&a->sequences, a->device, st)))) {
        return rc;
    }
    return FA_OK;
}

/* The sequence table's part of a plan key (zero without one). */
static void sequences_of(const fa_sequence_args *s, int32_t device, shape_key *shape, shape_key *pages,
                         int64_t *max_q_len, int64_t *max_kv_len) {
    if (fa_sequences_present(s)) {
        shape_of(&s->table, device, shape);
        shape_of_optional(&s->block_table, device, pages);
        *max_q_len = s->max_q_len;
        *max_kv_len = s->max_kv_len;
    }
}

/* The table kernel's pipeline, when the plan has one. */
static int32_t resolve_builder(const fa_backend *backend, int32_t sequences, const fa_plan_dispatch *builder,
                               fa_ready_dispatch *ready, fa_status *st) {
    return sequences ? resolve(backend, builder, 1, 0, ready, st) : FA_OK;
}

int32_t fa_forward_prepare(const fa_forward_args *a, fa_forward_ready *ready, fa_status *st) {
    if (a == NULL || ready == NULL) {
        return fa_fail(st, FA_ERR_VALUE, "fa_forward_prepare: NULL argument");
    }
    forward_key key;
    memset(&key, 0, sizeof key);
    key.sources = plan_generation(a->device);
    key.device = a->device;
    key.kernel = a->kernel;
    key.causal = a->causal != 0;
    key.has_lse = a->lse.storage != NULL;
    key.scale = a->scale;
    key.band = a->band; /* no padding in fa_band_args: compared as bytes */
    key.softcap = a->softcap;
    shape_of(&a->q, a->device, &key.q);
    shape_of(&a->k, a->device, &key.k);
    shape_of(&a->v, a->device, &key.v);
    shape_of(&a->out, a->device, &key.out);
    if (key.has_lse) {
        shape_of(&a->lse, a->device, &key.lse);
    }
    shape_of_optional(&a->mask, a->device, &key.mask);
    shape_of_optional(&a->alibi_slopes, a->device, &key.alibi);
    key.dropout_p = a->dropout_p;
    key.write_probs = a->write_probs != 0;
    shape_of_optional(&a->rng_state, a->device, &key.rng);
    shape_of_optional(&a->sinks, a->device, &key.sinks);
    sequences_of(&a->sequences, a->device, &key.sequences, &key.block_table, &key.max_q_len, &key.max_kv_len);
    key.num_splits = a->num_splits;
    const uint64_t hash = fa_hash_bytes(&key, sizeof key);
    if (table_find(&forward_plans, &key, hash, ready)) {
        return check_forward_storage(a, st);
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
    table_store(&forward_plans, &key, hash, ready);
    return FA_OK;
}

static int32_t check_backward_storage(const fa_backward_args *a, fa_status *st) {
    const fa_tensor *four_d[] = {&a->q, &a->k, &a->v, &a->out, &a->dout, &a->dq, &a->dk, &a->dv};
    const char *const four_d_names[] = {"q", "k", "v", "out", "dout", "dq", "dk", "dv"};
    int32_t rc;
    for (uint32_t i = 0; i < sizeof four_d / sizeof four_d[0]; ++i) {
        if ((rc = fa_check_tensor(four_d[i], four_d_names[i], 4, 0, st)) != FA_OK) {
            return rc;
        }
    }
    if ((rc = fa_check_tensor(&a->lse, "lse", 3, 1, st)) || (rc = fa_check_tensor(&a->delta, "delta", 3, 1, st)) ||
        (fa_tensor_present(&a->mask) && (rc = fa_check_tensor(&a->mask, "mask", 4, 0, st))) ||
        (fa_tensor_present(&a->alibi_slopes) && (rc = fa_check_tensor(&a->alibi_slopes, "alibi_slopes", 2, 1, st))) ||
        (fa_tensor_present(&a->rng_state) && (rc = fa_check_tensor(&a->rng_state, "rng_state", 1, 1, st))) ||
        (fa_tensor_present(&a->sinks) && ((rc = fa_check_tensor(&a->sinks, "sinks", 1, 1, st)) ||
                                (rc = fa_check_tensor(&a->sink_grad, "sink_grad", 3, 1, st)))) ||
        (fa_sequences_present(&a->sequences) && (rc = fa_sequence_check_storage(&a->sequences, a->device, st)))) {
        return rc;
    }
    return fa_plan_check_backward_aliases(a, st);
}

int32_t fa_backward_prepare(const fa_backward_args *a, fa_backward_ready *ready, fa_status *st) {
    if (a == NULL || ready == NULL) {
        return fa_fail(st, FA_ERR_VALUE, "fa_backward_prepare: NULL argument");
    }
    backward_key key;
    memset(&key, 0, sizeof key);
    key.sources = plan_generation(a->device);
    key.device = a->device;
    key.causal = a->causal != 0;
    key.has_lse = a->lse.storage != NULL;
    key.scale = a->scale;
    key.band = a->band; /* no padding in fa_band_args: compared as bytes */
    key.softcap = a->softcap;
    const fa_tensor *tensors[] = {&a->q, &a->k, &a->v, &a->out, &a->lse, &a->dout, &a->delta, &a->dq, &a->dk, &a->dv};
    shape_key *shapes[] = {&key.q, &key.k, &key.v, &key.out, &key.lse, &key.dout, &key.delta, &key.dq, &key.dk, &key.dv};
    for (uint32_t i = 0; i < sizeof tensors / sizeof tensors[0]; ++i) {
        shape_of(tensors[i], a->device, shapes[i]);
    }
    shape_of_optional(&a->mask, a->device, &key.mask);
    shape_of_optional(&a->alibi_slopes, a->device, &key.alibi);
    key.dropout_p = a->dropout_p;
    shape_of_optional(&a->rng_state, a->device, &key.rng);
    shape_of_optional(&a->sinks, a->device, &key.sinks);
    shape_of_optional(&a->sink_grad, a->device, &key.sink_grad);
    sequences_of(&a->sequences, a->device, &key.sequences, &key.block_table, &key.max_q_len, &key.max_kv_len);
    const uint64_t hash = fa_hash_bytes(&key, sizeof key);
    if (table_find(&backward_plans, &key, hash, ready)) {
        return check_backward_storage(a, st);
    }

    fa_backward_plan plan;
    int32_t rc = fa_plan_backward(a, &plan, st);
    if (rc != FA_OK) {
        return rc;
    }
    memset(ready, 0, sizeof *ready);
    ready->params = plan.params;
    if ((ready->backend = backend_of(a->device, st)) == NULL) {
        return st->code;
    }
    if ((rc = resolve(ready->backend, plan.dispatches, FA_BACKWARD_DISPATCHES, 1, ready->dispatches, st)) != FA_OK ||
        (rc = resolve_builder(ready->backend, plan.sequences, &plan.sequence_builder, &ready->sequence_builder,
                              st)) != FA_OK) {
        return rc;
    }
    table_store(&backward_plans, &key, hash, ready);
    return FA_OK;
}
