/* Process-lifetime caches of backend objects keyed by plain values (fa_cache.h). */
#include "fa_cache.h"

#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

static atomic_uint_fast64_t entries_stored;

uint64_t fa_cache_entries_stored(void) { return (uint64_t)atomic_load_explicit(&entries_stored, memory_order_relaxed); }

struct fa_cache_entry {
    uint64_t hash;
    size_t len;
    void *value;
    fa_cache_entry *next;
    unsigned char key[];
};

enum { FIRST_SLOTS = 64 };

uint64_t fa_hash_bytes(const void *bytes, size_t len) {
    const unsigned char *b = bytes;
    uint64_t h = 0xcbf29ce484222325ull ^ (uint64_t)len;
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t word;
        memcpy(&word, b + i, 8);
        h = (h ^ word) * 0x100000001b3ull;
        h ^= h >> 29;
    }
    uint64_t tail = 0;
    memcpy(&tail, b + i, len - i);
    h = (h ^ tail) * 0x100000001b3ull;
    return h ^ (h >> 32);
}

/* A name of at most bytes - 1 characters copied into a zeroed field; 0 when it does not fit. */
static int32_t copy_name(char *field, size_t bytes, const char *name) {
    const size_t n = strnlen(name, bytes);
    if (n == bytes) {
        return 0;
    }
    memcpy(field, name, n);
    return 1;
}

size_t fa_library_identity_of(const fa_pipeline_key *key, int32_t source_id, fa_library_identity *id, fa_status *st) {
    if (key == NULL || key->source_name == NULL || key->function == NULL) {
        fa_fail(st, FA_ERR_VALUE, "pipeline key: source name and function are required");
        return 0;
    }
    if (key->n_macros > FA_MAX_MACROS || (key->n_macros > 0 && key->macros == NULL)) {
        fa_fail(st, FA_ERR_VALUE, "pipeline key of %s: %u macros (at most %d, with macros set)", key->source_name,
                key->n_macros, FA_MAX_MACROS);
        return 0;
    }
    memset(id, 0, offsetof(fa_library_identity, macros) + key->n_macros * sizeof id->macros[0]);
    id->source_id = source_id;
    id->n_macros = key->n_macros;
    for (uint32_t i = 0; i < key->n_macros; ++i) {
        const fa_macro *m = &key->macros[i];
        if (!copy_name(id->macros[i].name, sizeof m->name, m->name) ||
            !copy_name(id->macros[i].value, sizeof m->value, m->value) || m->name[0] == '\0') {
            fa_fail(st, FA_ERR_VALUE, "pipeline key of %s: macro %u is empty or not terminated within %zu bytes",
                    key->source_name, i, sizeof m->name);
            return 0;
        }
    }
    return offsetof(fa_library_identity, macros) + key->n_macros * sizeof id->macros[0];
}

size_t fa_pipeline_identity_of(const fa_pipeline_key *key, const void *library, fa_pipeline_identity *id,
                               fa_status *st) {
    if (key->n_constants > FA_MAX_CONSTANTS || (key->n_constants > 0 && key->constants == NULL)) {
        fa_fail(st, FA_ERR_VALUE, "pipeline key of %s: %u function constants (at most %d, with constants set)",
                key->source_name, key->n_constants, FA_MAX_CONSTANTS);
        return 0;
    }
    memset(id, 0, offsetof(fa_pipeline_identity, constants) + key->n_constants * sizeof id->constants[0]);
    id->library = library;
    if (!copy_name(id->function, sizeof id->function, key->function) || key->function[0] == '\0') {
        fa_fail(st, FA_ERR_VALUE, "pipeline key of %s: the function name is empty or longer than %d bytes",
                key->source_name, FA_FUNCTION_NAME_BYTES - 1);
        return 0;
    }
    id->n_constants = key->n_constants;
    for (uint32_t i = 0; i < key->n_constants; ++i) {
        const fa_constant *c = &key->constants[i];
        if (c->kind != FA_CONST_BOOL && c->kind != FA_CONST_INT && c->kind != FA_CONST_FLOAT) {
            fa_fail(st, FA_ERR_VALUE, "function constant %u of %s has unknown kind %d", c->index, key->function,
                    c->kind);
            return 0;
        }
        id->constants[i] = *c; /* no padding inside fa_constant */
    }
    return offsetof(fa_pipeline_identity, constants) + key->n_constants * sizeof id->constants[0];
}

static fa_cache_entry *find(const fa_cache *cache, uint64_t hash, const void *key, size_t len) {
    if (cache->n_slots == 0) {
        return NULL;
    }
    for (fa_cache_entry *e = cache->slots[hash & (cache->n_slots - 1)]; e != NULL; e = e->next) {
        if (e->hash == hash && e->len == len && memcmp(e->key, key, len) == 0) {
            return e;
        }
    }
    return NULL;
}

void *fa_cache_get(fa_cache *cache, const void *key, size_t len) {
    const uint64_t hash = fa_hash_bytes(key, len);
    pthread_mutex_lock(&cache->lock);
    const fa_cache_entry *e = find(cache, hash, key, len);
    void *value = e != NULL ? e->value : NULL;
    pthread_mutex_unlock(&cache->lock);
    return value;
}

/* Doubles the slots (a power of two) once the entries outnumber them; keeps the old table when
 * memory runs out (chains just get longer). */
static void grow(fa_cache *cache) {
    const uint32_t n = cache->n_slots == 0 ? FIRST_SLOTS : cache->n_slots * 2;
    fa_cache_entry **slots = calloc(n, sizeof *slots);
    if (slots == NULL) {
        return;
    }
    for (uint32_t i = 0; i < cache->n_slots; ++i) {
        for (fa_cache_entry *e = cache->slots[i], *next; e != NULL; e = next) {
            next = e->next;
            e->next = slots[e->hash & (n - 1)];
            slots[e->hash & (n - 1)] = e;
        }
    }
    free(cache->slots);
    cache->slots = slots;
    cache->n_slots = n;
}

void *fa_cache_put(fa_cache *cache, const void *key, size_t len, void *value) {
    const uint64_t hash = fa_hash_bytes(key, len);
    fa_cache_entry *fresh = malloc(sizeof *fresh + len);
    if (fresh == NULL) {
        return NULL;
    }
    fresh->hash = hash;
    fresh->len = len;
    fresh->value = value;
    memcpy(fresh->key, key, len);
    pthread_mutex_lock(&cache->lock);
    const fa_cache_entry *present = find(cache, hash, key, len);
    if (present != NULL) {
        value = present->value;
    } else {
        if (cache->count >= cache->n_slots) {
            grow(cache);
        }
        if (cache->n_slots == 0) {
            value = NULL;
        } else {
            fresh->next = cache->slots[hash & (cache->n_slots - 1)];
            cache->slots[hash & (cache->n_slots - 1)] = fresh;
            cache->count++;
            atomic_fetch_add_explicit(&entries_stored, 1, memory_order_relaxed);
            fresh = NULL;
        }
    }
    pthread_mutex_unlock(&cache->lock);
    free(fresh);
    return value;
}
