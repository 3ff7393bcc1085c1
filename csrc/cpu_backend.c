/* The fa_backend of the CPU Metal device: pipelines are (library, kernel, function constants). */
#include "fa_backend.h"
#include "cpu_device/cpu_device.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

struct fa_pipeline {
    const mcpu_library *library;
    char function[64];
    msl_constant_value constants[MSL_MAX_FUNCTION_CONSTANTS];
    uint32_t n_constants;
    struct fa_pipeline *next;
};

static pthread_mutex_t pipelines_lock = PTHREAD_MUTEX_INITIALIZER;
static struct fa_pipeline *pipelines_head = NULL;

static int32_t same_pipeline(const struct fa_pipeline *a, const struct fa_pipeline *b) {
    return a->library == b->library && strcmp(a->function, b->function) == 0 &&
           a->n_constants == b->n_constants &&
           memcmp(a->constants, b->constants, sizeof a->constants[0] * a->n_constants) == 0;
}

static fa_pipeline *cpu_get_pipeline(const fa_pipeline_key *key, fa_status *st) {
    const char *source = fa_lookup_source(key->source_name);
    if (source == NULL) {
        fa_fail(st, FA_ERR_VALUE, "no kernel source named '%s' is registered", key->source_name);
        return NULL;
    }
    mcpu_macro macros[FA_MAX_MACROS];
    for (uint32_t i = 0; i < key->n_macros && i < FA_MAX_MACROS; ++i) {
        macros[i].name = key->macros[i].name;
        macros[i].value = key->macros[i].value;
    }
    mcpu_library *library = NULL;
    if (mcpu_compile_library(source, key->source_name, macros, key->n_macros, &library, st) != FA_OK) {
        return NULL;
    }
    if (mcpu_library_kernel(library, key->function) == NULL) {
        fa_fail(st, FA_ERR_VALUE, "%s has no kernel named '%s'", key->source_name, key->function);
        return NULL;
    }

    struct fa_pipeline wanted;
    memset(&wanted, 0, sizeof wanted);
    wanted.library = library;
    strncpy(wanted.function, key->function, sizeof wanted.function - 1);
    for (uint32_t i = 0; i < key->n_constants; ++i) {
        const fa_constant *c = &key->constants[i];
        if (c->index >= MSL_MAX_FUNCTION_CONSTANTS) {
            fa_fail(st, FA_ERR_VALUE, "function constant index %u is out of range", c->index);
            return NULL;
        }
        msl_constant_value *v = &wanted.constants[c->index];
        v->kind = c->kind == FA_CONST_BOOL ? MSL_CONSTANT_BOOL
                  : c->kind == FA_CONST_INT ? MSL_CONSTANT_INT
                                            : MSL_CONSTANT_FLOAT;
        v->i = c->i;
        v->f = c->f;
        if (c->index + 1 > wanted.n_constants) {
            wanted.n_constants = c->index + 1;
        }
    }

    pthread_mutex_lock(&pipelines_lock);
    struct fa_pipeline *found = pipelines_head;
    while (found != NULL && !same_pipeline(found, &wanted)) {
        found = found->next;
    }
    if (found == NULL && (found = malloc(sizeof *found)) != NULL) {
        *found = wanted;
        found->next = pipelines_head;
        pipelines_head = found;
    }
    pthread_mutex_unlock(&pipelines_lock);
    if (found == NULL) {
        fa_fail(st, FA_ERR_RUNTIME, "out of memory creating a pipeline");
    }
    return found;
}

static int32_t cpu_dispatch(fa_pipeline *pipeline, const fa_dispatch *d, fa_status *st) {
    void *buffers[FA_MAX_BINDINGS];
    for (uint32_t i = 0; i < d->n_bindings; ++i) {
        const fa_binding *b = &d->bindings[i];
        /* Inline bytes are read in place: the dispatch is synchronous, so they outlive it. */
        buffers[i] = b->bytes != NULL ? (void *)b->bytes : (char *)b->storage + b->byte_offset;
    }
    mcpu_dispatch_args args;
    memset(&args, 0, sizeof args);
    args.kernel = pipeline->function;
    memcpy(args.grid, d->grid, sizeof args.grid);
    memcpy(args.threadgroup, d->threadgroup, sizeof args.threadgroup);
    args.buffers = buffers;
    args.n_buffers = d->n_bindings;
    args.threadgroup_arg_lengths = d->threadgroup_bytes;
    args.n_threadgroup_args = d->n_threadgroup_args;
    args.constants = pipeline->constants;
    args.n_constants = pipeline->n_constants;
    return mcpu_dispatch(pipeline->library, &args, st);
}

static const fa_backend cpu_backend = {"cpu", cpu_get_pipeline, cpu_dispatch};

const fa_backend *fa_cpu_backend(void) { return &cpu_backend; }
