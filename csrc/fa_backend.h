/* The interface every backend implements (the CPU Metal device, Metal on macOS): get-or-compile a
 * pipeline, and dispatch it. Planning happens before, in the planners (fa_plan_*.c); backends never see tensors. */
#ifndef FA_BACKEND_H
#define FA_BACKEND_H

#include "fa_core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* FA_MAX_BINDINGS: [[buffer(0)]] .. [[buffer(17)]] of the backward kernels (metal/fa_params.h). */
enum { FA_MAX_MACROS = 24, FA_MAX_CONSTANTS = 16, FA_MAX_BINDINGS = 18, FA_MAX_TG_ARGS = 4, FA_MAX_CHAIN = 4 };

typedef struct fa_macro {
    char name[48];
    char value[48];
} fa_macro;

typedef enum fa_constant_kind { FA_CONST_BOOL = 1, FA_CONST_INT = 2, FA_CONST_FLOAT = 3 } fa_constant_kind;

typedef struct fa_constant {
    uint32_t index; /* [[function_constant(index)]] */
    int32_t kind;   /* fa_constant_kind */
    int64_t i;
    double f;
} fa_constant;

/* What to build: a function of a registered source, specialised by macros (compile time) and
 * function constants (pipeline creation). */
typedef struct fa_pipeline_key {
    const char *source_name;
    const char *function;
    const fa_macro *macros;
    uint32_t n_macros;
    const fa_constant *constants;
    uint32_t n_constants;
} fa_pipeline_key;

/* One [[buffer(n)]] binding: a storage (handle as in fa_tensor) plus byte offset, or inline bytes
 * (setBytes) when bytes != NULL. length: the inline bytes, or for a storage the bytes addressed
 * from byte_offset (0 or less: unknown). */
typedef struct fa_binding {
    void *storage;
    int64_t byte_offset;
    const void *bytes;
    int64_t length;
} fa_binding;

/* Whether an optional descriptor is given: it has dims or storage. A 0-D one with storage is
 * present (and refused by fa_check_tensor), never taken for "none". */
static inline int32_t fa_tensor_present(const fa_tensor *t) { return t->ndim != 0 || t->storage != NULL; }

/* The binding of tensor t, or of `fallback` when t has no storage (an absent optional or an empty
 * tensor: Metal still wants a buffer bound where no kernel reads). */
static inline fa_binding fa_tensor_binding(const fa_tensor *t, const fa_tensor *fallback) {
    const fa_tensor *bound = t->storage != NULL ? t : fallback;
    const fa_binding b = {bound->storage, bound->byte_offset, NULL, bound->storage_bytes - bound->byte_offset};
    return b;
}

typedef struct fa_dispatch {
    fa_binding bindings[FA_MAX_BINDINGS];
    uint32_t n_bindings;
    uint64_t threadgroup_bytes[FA_MAX_TG_ARGS]; /* [[threadgroup(n)]] lengths */
    uint32_t n_threadgroup_args;
    uint32_t grid[3];        /* threadgroups per grid */
    uint32_t threadgroup[3]; /* threads per threadgroup */
    /* Nonzero when the bindings are those of the previous dispatch of the same call, which the
     * backend accepted: its buffer checks need not run again. */
    uint32_t same_bindings_as_previous;
} fa_dispatch;

typedef struct fa_pipeline fa_pipeline; /* backend-owned, cached, never freed by callers */

typedef struct fa_backend {
    const char *name;
    /* Cached for the process by (source id, macros, function, constants) as plain values
     * (fa_cache.h): a hit neither hashes the source text nor touches the file system. Safe to call
     * from several threads. */
    fa_pipeline *(*get_pipeline)(const fa_pipeline_key *key, fa_status *st);
    /* Runs dispatches[0 .. n-1] (1 <= n <= FA_MAX_CHAIN) of pipelines[0 .. n-1] in order, each seeing
     * the writes of those before it: on Metal one compute encoder (serial dispatches) and one
     * submission, so a split decode and its merge cost one encoder, not two. Checks every dispatch
     * before running any. */
    int32_t (*dispatch)(fa_pipeline *const *pipelines, const fa_dispatch *dispatches, uint32_t n, fa_status *st);
} fa_backend;

/* A registered kernel source (fa_register_source). Its id is unique to this name and text:
 * registering new text under the name gives a new id, so caches keyed by ids never mix texts. */
typedef struct fa_source {
    int32_t id;
    const char *name;
    const char *text; /* valid for the life of the process */
} fa_source;

/* Fills *out with the source registered as `name` and returns 1, or returns 0 when there is none. */
int32_t fa_find_source(const char *name, fa_source *out);

/* Changes whenever a source gets new text: caches holding pipelines of a plan key on it. */
int32_t fa_sources_generation(void);

/* FLASHATTN_MPS_SKIP_EXECUTION=1 (read once): backends do all the host work of a dispatch
 * (pipeline, bindings, checks) and skip only running it. A profiling aid for host overhead. */
int32_t fa_skip_execution(void);

/* The CPU Metal device (always present). */
const fa_backend *fa_cpu_backend(void);
/* Hands the CPU backend the device's table (a const mcpu_api *, cpu_device/metal_cpu.h, from
 * flashattn_mps._metal_cpu's capsule); fails with FA_ERR_UNSUPPORTED on another table version.
 * Until then CPU tensors fail with FA_ERR_UNSUPPORTED. */
int32_t fa_cpu_backend_attach(const void *api, fa_status *st);
/* The device's generation (0 before attach): differs whenever its default build mode does, so
 * the plan cache keys plans by it and never mixes pipelines of two modes. */
uint32_t fa_cpu_backend_generation(void);
/* Metal (macOS builds only); returns NULL with st set elsewhere. */
const fa_backend *fa_metal_backend(fa_status *st);

#ifdef __cplusplus
}
#endif
#endif
