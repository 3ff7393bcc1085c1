/* Process-lifetime caches of backend objects (compiled libraries, pipelines), keyed by plain
 * values: a library is identified by a source id (fa_find_source) and its macros, a pipeline by
 * its library, function and function constants. A hit hashes and compares a few hundred bytes;
 * it never hashes a source text or touches the file system. Entries are never removed: the
 * planner emits a bounded set of specialisations and callers keep the objects' pointers. */
#ifndef FA_CACHE_H
#define FA_CACHE_H

#include "fa_backend.h"

#include <pthread.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fa_cache_entry fa_cache_entry;

typedef struct fa_cache {
    pthread_mutex_t lock;
    fa_cache_entry **slots; /* chained hashing; grows with its entries */
    uint32_t n_slots, count;
} fa_cache;

#define FA_CACHE_INITIALIZER \
    { PTHREAD_MUTEX_INITIALIZER, NULL, 0, 0 }

/* Identities are zero-filled fixed layouts; their first `len` bytes (as the fa_*_identity_of
 * functions return) are the cache key. */
typedef struct fa_library_identity {
    int32_t source_id;
    uint32_t n_macros;
    fa_macro macros[FA_MAX_MACROS];
} fa_library_identity;

enum { FA_FUNCTION_NAME_BYTES = 64 };

typedef struct fa_pipeline_identity {
    const void *library; /* the backend's library object */
    char function[FA_FUNCTION_NAME_BYTES];
    uint32_t n_constants;
    uint32_t reserved; /* zero */
    fa_constant constants[FA_MAX_CONSTANTS];
} fa_pipeline_identity;

/* Both check the key (NULL fields, counts, unterminated or too long names, constant kinds) and
 * return the identity's length in bytes, or 0 with st set when the key is malformed. */
size_t fa_library_identity_of(const fa_pipeline_key *key, int32_t source_id, fa_library_identity *id, fa_status *st);
size_t fa_pipeline_identity_of(const fa_pipeline_key *key, const void *library, fa_pipeline_identity *id,
                               fa_status *st);

/* The value stored under the key's len bytes, or NULL. */
void *fa_cache_get(fa_cache *cache, const void *key, size_t len);
/* Stores value under the key unless one is there already, and returns the value stored (the
 * earlier one when two threads raced), or NULL when out of memory. */
void *fa_cache_put(fa_cache *cache, const void *key, size_t len, void *value);
/* Entries stored by fa_cache_put in every cache of the process so far: the libraries compiled and
 * pipelines built by the backends (what warmup's "compiles nothing new" is measured by). */
uint64_t fa_cache_entries_stored(void);

/* A 64-bit hash of len bytes, a word at a time (also the plan cache's). */
uint64_t fa_hash_bytes(const void *bytes, size_t len);

#ifdef __cplusplus
}
#endif
#endif
