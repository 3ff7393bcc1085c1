/* The CPU Metal device: compiles MSL source as C++ against the shim in shim/ and runs kernels with
 * Metal's execution model (threadgroups on worker threads, GPU threads as fibers, 32-lane
 * SIMD-groups). Mirrors newLibraryWithSource:options: and dispatchThreadgroups. */
#ifndef METAL_CPU_H
#define METAL_CPU_H

#include <stddef.h>
#include <stdint.h>

#include "shim/msl_abi.h"

#ifdef __cplusplus
extern "C" {
#endif

/* How a call ended: MCPU_OK, or an error code with a message in an mcpu_status. */
enum { MCPU_STATUS_MESSAGE_BYTES = 8192 };

typedef enum mcpu_code {
    MCPU_OK = 0,
    MCPU_ERR_VALUE = 1,      /* bad argument (Python ValueError) */
    MCPU_ERR_COMPILE = 3,    /* a library failed to compile, or the cache refused an entry */
    MCPU_ERR_RUNTIME = 4,    /* a dispatch failed (divergence, deadlock, kernel fault, watchdog) */
    MCPU_ERR_UNSUPPORTED = 5 /* no usable compiler on this machine */
} mcpu_code;

typedef struct mcpu_status {
    int32_t code; /* mcpu_code */
    char message[MCPU_STATUS_MESSAGE_BYTES];
} mcpu_status;

/* Sets *st (when not NULL) and returns code; message is printf-formatted and truncated to fit,
 * never inside a UTF-8 character. */
int32_t mcpu_fail(mcpu_status *st, int32_t code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

typedef struct mcpu_library mcpu_library; /* cached for the life of the process, never freed */

typedef struct mcpu_macro {
    const char *name;
    const char *value; /* NULL or "" defines the macro as 1 */
} mcpu_macro;

/* How a library's kernels run (bits of a mode; 0: plainly, as fast as the device can):
 * MCPU_CHECKED: dispatches report threadgroup-memory races, reads of threadgroup memory never
 * written in the threadgroup and accesses outside the bound buffers or threadgroup memory
 * (docs/cpu-device.md, "Checked mode"). MCPU_LOCKSTEP: the lanes of each SIMD-group take their
 * threadgroup-memory accesses in step, as kernels that rely on a GPU's lockstep need (docs/cpu-device.md,
 * "Lockstep"); with MCPU_CHECKED, accesses of one SIMD-group then never race. Either builds the
 * library instrumented: a separate build with its own cache key, which both share. */
enum { MCPU_CHECKED = 1u, MCPU_LOCKSTEP = 2u, MCPU_MODES = MCPU_CHECKED | MCPU_LOCKSTEP };

/* Compile (or fetch from the in-process cache, then the on-disk cache) a library built for `mode`
 * (bits above; callers wanting the default ask mcpu_checked). source_name names the source in
 * diagnostics ("fa_simple.metal"). On a compile error returns
 * MCPU_ERR_COMPILE with the compiler's message, MSL file and line in st->message; also when the
 * cache holds an entry it refuses to trust (docs/security.md). Compiler runs
 * time out after $FLASHATTN_MPS_COMPILE_TIMEOUT seconds (default 600). Thread-safe and safe
 * across processes sharing the disk cache. */
int32_t mcpu_compile_library(const char *source, const char *source_name, const mcpu_macro *macros, uint32_t n_macros,
                             uint32_t mode, mcpu_library **out, mcpu_status *st);
uint32_t mcpu_library_mode(const mcpu_library *lib);

/* Whether libraries are built checked unless said otherwise (the Python API's
 * compile_library, the library's kernels): as set (0 or 1), else (never set, or set to -1) what $FLASHATTN_MPS_CPU_CHECKED (0 or
 * 1, default 0) says when first asked after that. Returns 0 or 1, or -1 with st set when the
 * variable holds anything else. */
int32_t mcpu_checked(mcpu_status *st);
void mcpu_set_checked(int32_t checked);
uint64_t mcpu_checked_dispatches(void); /* dispatches of checked libraries so far (for tests) */

/* Kernel names (host names) the library defines, NULL-terminated; valid for the process life. */
const char *const *mcpu_library_kernels(const mcpu_library *lib);

/* Launch entry of a kernel, or NULL if the library has no kernel of that name. */
typedef void (*mcpu_kernel_fn)(void);
mcpu_kernel_fn mcpu_library_kernel(const mcpu_library *lib, const char *name);

/* Run one dispatch synchronously: grid counts threadgroups. buffers[i] binds [[buffer(i)]] (host
 * addresses with offsets applied); threadgroup_arg_lengths[i] sizes [[threadgroup(i)]];
 * constants holds the function constants set, by strictly increasing index (0..65535).
 * Fails with MCPU_ERR_VALUE on bad geometry (more than 1024 threads, a zero dimension, more than
 * 32 KiB of threadgroup memory) and MCPU_ERR_RUNTIME on a divergence, deadlock or kernel failure
 * (a fault of kernel code: invalid memory access, stack overflow; SIGINT; the watchdog), naming
 * the kernel, source line and threads. Thread-safe. */
typedef struct mcpu_dispatch_args {
    const char *kernel;
    uint32_t grid[3];
    uint32_t threadgroup[3];
    void *const *buffers;
    uint32_t n_buffers;
    const uint64_t *threadgroup_arg_lengths;
    uint32_t n_threadgroup_args;
    const msl_constant_value *constants;
    uint32_t n_constants;
    /* Bytes bound at buffers[i] (from its address on), UINT64_MAX where unknown; NULL: all
     * unknown. A checked library's dispatch runs on guarded copies of the known ones. */
    const uint64_t *buffer_lengths;
} mcpu_dispatch_args;

int32_t mcpu_dispatch(const mcpu_library *lib, const mcpu_dispatch_args *args, mcpu_status *st);

/* The dispatch time limit (docs/security.md): a dispatch running longer than
 * `seconds` fails with MCPU_ERR_RUNTIME naming the kernel; 0 (the default) means no limit.
 * Initially $FLASHATTN_MPS_CPU_WATCHDOG. Applies to dispatches started afterwards. */
int32_t mcpu_set_watchdog(double seconds, mcpu_status *st);
double mcpu_watchdog(void);

/* Threadgroup memory a threadgroup may use, as on Apple7-9 GPUs. */
enum { MCPU_MAX_THREADGROUP_MEMORY = 32768 };

/* Where compiled libraries are cached: $FLASHATTN_MPS_CACHE, else $XDG_CACHE_HOME/flashattn_mps,
 * else ~/.cache/flashattn_mps. */
int32_t mcpu_cache_dir(char *out, size_t out_len, mcpu_status *st);

/* The directory holding the shim headers (msl_shim.h, ...) and include/ with empty <metal_*>
 * stubs, written into the cache on first use: what the strict MSL check compiles against. */
int32_t mcpu_shim_dir(char *out, size_t out_len, mcpu_status *st);

/* The preprocessing step's flags (`c++ -E` as an MSL compiler sees the source: its language and
 * predefined macros), which the strict MSL check preprocesses with too: their count, *flags the
 * array (static). */
uint32_t mcpu_preprocessor_flags(const char *const **flags);

/* Rewrite MSL source into C++ for the shim (strict = 0) or for the address-space-strict syntax
 * check (strict = 1). Returns a malloc'ed string or NULL with st set. */
char *mcpu_preprocess(const char *source, const char *source_name, int32_t strict, mcpu_status *st);

/* What another extension module (the attention library, flashattn_mps._C) calls the device
 * through: a const table exported by flashattn_mps._metal_cpu as the PyCapsule named
 * MCPU_API_CAPSULE. A caller checks abi_version == MCPU_API_VERSION before using the rest. */
#define MCPU_API_CAPSULE "flashattn_mps._metal_cpu._api"
enum { MCPU_API_VERSION = 1 };

typedef struct mcpu_api {
    uint32_t abi_version; /* MCPU_API_VERSION */
    /* The mode libraries are built in unless said otherwise: 0 or MCPU_CHECKED (mcpu_checked),
     * or -1 with st set. */
    int32_t (*default_mode)(mcpu_status *st);
    /* A number that differs whenever default_mode does (never negative, below 4): what callers
     * key caches of pipelines by, so that modes never mix. A bad environment reads as 0; its
     * error is reported by default_mode. */
    uint32_t (*generation)(void);
    int32_t (*compile_library)(const char *source, const char *source_name, const mcpu_macro *macros, uint32_t n_macros,
                               uint32_t mode, mcpu_library **out, mcpu_status *st);
    mcpu_kernel_fn (*find_kernel)(const mcpu_library *lib, const char *name);
    int32_t (*dispatch)(const mcpu_library *lib, const mcpu_dispatch_args *args, mcpu_status *st);
} mcpu_api;

/* The table itself (api.c), for the module that exports it. */
const mcpu_api *mcpu_api_table(void);

#ifdef __cplusplus
}
#endif
#endif
