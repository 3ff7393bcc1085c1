/* The fa_backend of the CPU Metal device: pipelines are (library, kernel, function constants).
 * Both are cached here by plain values (fa_cache.h), in front of the device's compile_library,
 * whose own cache hashes the whole source and checks the disk: that runs once per library and
 * process. The device is reached only through its table (cpu_device/metal_cpu.h, mcpu_api), which
 * flashattn_mps._C attaches when it is imported. */
#include "fa_backend.h"
#include "fa_cache.h"
#include "fa_gpu_family.h"
#include "cpu_device/metal_cpu.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

static _Atomic(const mcpu_api *) device; /* NULL until fa_cpu_backend_attach */

int32_t fa_cpu_backend_attach(const void *api, fa_status *st) {
    const mcpu_api *table = api;
    if (table == NULL || table->abi_version != MCPU_API_VERSION) {
        return fa_fail(st, FA_ERR_UNSUPPORTED,
                       "the CPU Metal device (flashattn_mps._metal_cpu) has table version %u; this build "
                       "of flashattn_mps._C needs %u (rebuild both)",
                       table != NULL ? table->abi_version : 0u, (unsigned)MCPU_API_VERSION);
    }
    atomic_store(&device, table);
    return FA_OK;
}

static const mcpu_api *attached(fa_status *st) {
    const mcpu_api *api = atomic_load_explicit(&device, memory_order_acquire);
    if (api == NULL) {
        fa_fail(st, FA_ERR_UNSUPPORTED,
                "CPU tensors need the CPU Metal device (flashattn_mps._metal_cpu), which is not attached");
    }
    return api;
}

/* The device's status as the library's (the codes agree; see metal_cpu.h). */
static int32_t device_failed(const mcpu_status *ms, fa_status *st) {
    const int32_t code = ms->code == MCPU_ERR_VALUE         ? FA_ERR_VALUE
                         : ms->code == MCPU_ERR_COMPILE     ? FA_ERR_COMPILE
                         : ms->code == MCPU_ERR_UNSUPPORTED ? FA_ERR_UNSUPPORTED
                                                            : FA_ERR_RUNTIME;
    return fa_fail(st, code, "%s", ms->message);
}

struct fa_pipeline {
    const mcpu_library *library;
    char function[FA_FUNCTION_NAME_BYTES];
    msl_constant_value constants[FA_MAX_CONSTANTS]; /* by increasing index */
    uint32_t n_constants;
};

/* fa_library_identity -> mcpu_library, unchecked and checked (the device's default_mode) */
static fa_cache libraries[2] = {FA_CACHE_INITIALIZER, FA_CACHE_INITIALIZER};
static fa_cache pipelines = FA_CACHE_INITIALIZER; /* fa_pipeline_identity -> struct fa_pipeline */

/* A Metal 4 library (FA_LANGUAGE_MACRO, fa_gpu_family.h) as compile_library builds one: the language
 * version, __METAL__, the emulated family (fa_cpu_tensor_family) and the cooperative tensors' layout
 * (FLASHATTN_MPS_CPU_TENSOR_LAYOUT: "family", the default, or "scrambled"), appended to macros.
 * Read once per library: a process keeps the layout it compiled first. */
enum { METAL4_MACROS = 4 };
static int32_t add_metal4_macros(const char *version, mcpu_macro *macros, uint32_t *n, fa_status *st) {
    const int32_t family = fa_cpu_tensor_family();
    const char *layout = getenv("FLASHATTN_MPS_CPU_TENSOR_LAYOUT");
    const int32_t scrambled = layout != NULL && strcmp(layout, "scrambled") == 0;
    if (family == 0) {
        fa_fail(st, FA_ERR_VALUE,
                "FLASHATTN_MPS_CPU_GPU_FAMILY: Metal 4 tensor code runs as apple9 or apple10, got '%s'",
                getenv("FLASHATTN_MPS_CPU_GPU_FAMILY"));
        return 0;
    }
    if (layout != NULL && layout[0] != '\0' && !scrambled && strcmp(layout, "family") != 0) {
        fa_fail(st, FA_ERR_VALUE, "FLASHATTN_MPS_CPU_TENSOR_LAYOUT: must be family or scrambled, got '%s'", layout);
        return 0;
    }
    macros[(*n)++] = (mcpu_macro){"__METAL_VERSION__", version};
    macros[(*n)++] = (mcpu_macro){"__METAL__", "1"};
    macros[(*n)++] = (mcpu_macro){"__MSL_CPU_GPU_FAMILY__", family == FA_FAMILY_APPLE9 ? "9" : "10"};
    macros[(*n)++] = (mcpu_macro){"__MSL_CPU_TENSOR_LAYOUT__", scrambled ? "1" : "0"};
    return 1;
}

static const mcpu_library *get_library(const mcpu_api *api, const fa_pipeline_key *key, fa_status *st) {
    fa_source source;
    if (key == NULL || !fa_find_source(key->source_name, &source)) {
        fa_fail(st, FA_ERR_VALUE, "no kernel source named '%s' is registered",
                key != NULL && key->source_name != NULL ? key->source_name : "(null)");
        return NULL;
    }
    fa_library_identity id;
    const size_t len = fa_library_identity_of(key, source.id, &id, st);
    if (len == 0) {
        return NULL;
    }
    mcpu_status ms;
    const int32_t mode = api->default_mode(&ms);
    if (mode < 0) {
        device_failed(&ms, st);
        return NULL;
    }
    const int32_t checked = mode == MCPU_CHECKED;
    const mcpu_library *found = fa_cache_get(&libraries[checked], &id, len);
    if (found != NULL) {
        return found;
    }
    mcpu_macro macros[FA_MAX_MACROS + METAL4_MACROS];
    uint32_t n_macros = id.n_macros;
    for (uint32_t i = 0; i < id.n_macros; ++i) {
        macros[i].name = id.macros[i].name;
        macros[i].value = id.macros[i].value;
        if (strcmp(id.macros[i].name, FA_LANGUAGE_MACRO) == 0 &&
            !add_metal4_macros(id.macros[i].value, macros, &n_macros, st)) {
            return NULL;
        }
    }
    mcpu_library *library = NULL;
    if (api->compile_library(source.text, source.name, macros, n_macros, (uint32_t)mode, &library, &ms) != MCPU_OK) {
        device_failed(&ms, st);
        return NULL;
    }
    /* Libraries live for the process, so storing one twice (a race) is harmless. */
    if ((found = fa_cache_put(&libraries[checked], &id, len, library)) == NULL) {
        fa_fail(st, FA_ERR_RUNTIME, "out of memory caching a library");
    }
    return found;
}

static fa_pipeline *cpu_get_pipeline(const fa_pipeline_key *key, fa_status *st) {
    const mcpu_api *api = attached(st);
    const mcpu_library *library = api != NULL ? get_library(api, key, st) : NULL;
    if (library == NULL) {
        return NULL;
    }
    fa_pipeline_identity id;
    const size_t len = fa_pipeline_identity_of(key, library, &id, st);
    if (len == 0) {
        return NULL;
    }
    struct fa_pipeline *found = fa_cache_get(&pipelines, &id, len);
    if (found != NULL) {
        return found;
    }
    if (api->find_kernel(library, id.function) == NULL) {
        fa_fail(st, FA_ERR_VALUE, "%s has no kernel named '%s'", key->source_name, id.function);
        return NULL;
    }
    struct fa_pipeline *fresh = calloc(1, sizeof *fresh);
    if (fresh == NULL) {
        fa_fail(st, FA_ERR_RUNTIME, "out of memory creating a pipeline");
        return NULL;
    }
    fresh->library = library;
    memcpy(fresh->function, id.function, sizeof fresh->function);
    for (uint32_t i = 0; i < id.n_constants; ++i) {
        const fa_constant *c = &id.constants[i];
        if (c->index >= MSL_FUNCTION_CONSTANT_INDICES) {
            free(fresh);
            fa_fail(st, FA_ERR_VALUE, "function constant index %u is out of range 0..%u", c->index,
                    MSL_FUNCTION_CONSTANT_INDICES - 1);
            return NULL;
        }
        uint32_t at = fresh->n_constants++; /* insertion by index */
        for (; at > 0 && fresh->constants[at - 1].index > c->index; at--) {
            fresh->constants[at] = fresh->constants[at - 1];
        }
        msl_constant_value *v = &fresh->constants[at];
        v->kind = c->kind == FA_CONST_BOOL  ? MSL_CONSTANT_BOOL
                  : c->kind == FA_CONST_INT ? MSL_CONSTANT_INT
                                            : MSL_CONSTANT_FLOAT;
        v->index = c->index;
        v->i = c->i;
        v->f = c->f;
    }
    found = fa_cache_put(&pipelines, &id, len, fresh);
    if (found != fresh) {
        free(fresh); /* another thread stored the same pipeline first, or out of memory */
    }
    if (found == NULL) {
        fa_fail(st, FA_ERR_RUNTIME, "out of memory caching a pipeline");
    }
    return found;
}

static int32_t cpu_dispatch(fa_pipeline *pipeline, const fa_dispatch *d, fa_status *st) {
    if (pipeline == NULL || d == NULL || d->n_bindings > FA_MAX_BINDINGS) {
        return fa_fail(st, FA_ERR_VALUE, "CPU backend: malformed dispatch");
    }
    void *buffers[FA_MAX_BINDINGS];
    uint64_t lengths[FA_MAX_BINDINGS]; /* what checked mode bounds accesses by */
    for (uint32_t i = 0; i < d->n_bindings; ++i) {
        const fa_binding *b = &d->bindings[i];
        /* Inline bytes are read in place: the dispatch is synchronous, so they outlive it. */
        buffers[i] = b->bytes != NULL ? (void *)b->bytes : (char *)b->storage + b->byte_offset;
        lengths[i] = b->length > 0 || b->bytes != NULL ? (uint64_t)b->length : UINT64_MAX;
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
    args.buffer_lengths = lengths;
    if (fa_skip_execution()) {
        return FA_OK;
    }
    const mcpu_api *api = attached(st);
    mcpu_status ms;
    if (api == NULL) {
        return st->code;
    }
    return api->dispatch(pipeline->library, &args, &ms) == MCPU_OK ? FA_OK : device_failed(&ms, st);
}

static const fa_backend cpu_backend = {"cpu", cpu_get_pipeline, cpu_dispatch};

const fa_backend *fa_cpu_backend(void) { return &cpu_backend; }

uint32_t fa_cpu_backend_generation(void) {
    const mcpu_api *api = atomic_load_explicit(&device, memory_order_acquire);
    return api != NULL ? api->generation() : 0u;
}
