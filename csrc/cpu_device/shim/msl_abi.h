/* The ABI between a kernel library compiled for the CPU Metal device and the runtime that runs it.
 *
 * A compiled library (a shared object built from MSL source by build.c) exports:
 *   void __msl_bind_runtime(const msl_runtime_api *api);   called once, right after dlopen
 *   void __msl_launch_<host_name>(void);                    one per kernel: runs the kernel body for
 *                                                          the GPU thread api->current() describes
 * The runtime (runtime.c) runs every GPU thread of a threadgroup as a fiber on one OS thread and
 * hands kernels everything through the structs below. Plain C so both sides agree on layout. */
#ifndef MSL_ABI_H
#define MSL_ABI_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MSL_ABI_VERSION 3u
#ifdef __cplusplus
#define MSL_ALIGN16 alignas(16)
#else
#define MSL_ALIGN16 _Alignas(16)
#endif
#define MSL_SIMD_WIDTH 32u
#define MSL_MAX_THREADS_PER_THREADGROUP 1024u
/* Bytes a lane may publish in one SIMD-group exchange (simd_shuffle of the widest vector, or the
 * elements a simdgroup_matrix operation gathers). */
#define MSL_XCHG_BYTES 64u
#define MSL_MAX_BUFFERS 31u
#define MSL_MAX_THREADGROUP_ARGS 31u
/* Function-constant indices are 0..65535 as in Metal; a dispatch sets at most 65536 of them. */
#define MSL_FUNCTION_CONSTANT_INDICES 65536u
/* Bytes of the read-only zeroed storage an unbound optional buffer argument points to. */
#define MSL_UNBOUND_BYTES 65536u

typedef enum msl_constant_kind {
    MSL_CONSTANT_UNDEFINED = 0,
    MSL_CONSTANT_BOOL = 1,
    MSL_CONSTANT_INT = 2,  /* value in .i */
    MSL_CONSTANT_FLOAT = 3 /* value in .f */
} msl_constant_kind;

typedef struct msl_constant_value {
    int32_t kind;   /* msl_constant_kind */
    uint32_t index; /* [[function_constant(index)]] */
    int64_t i;
    double f;
} msl_constant_value;

/* What one dispatch binds: the same for every thread of every threadgroup. */
typedef struct msl_launch {
    const char *kernel_name;
    void *const *buffers; /* [[buffer(n)]]: host address, storage offset already applied */
    uint32_t n_buffers;
    uint32_t n_threadgroup_args; /* [[threadgroup(n)]] arguments bound */
    const uint64_t *threadgroup_arg_lengths;
    const msl_constant_value *constants; /* the constants set, by increasing index */
    uint32_t n_constants;
    uint32_t threadgroups_per_grid[3];
    uint32_t threads_per_threadgroup[3];
    /* Bytes bound at each buffer (setBuffer's length minus its offset), UINT64_MAX where unknown;
     * NULL when the caller gave none. Checked mode copies buffers into guarded storage by them. */
    const uint64_t *buffer_lengths;
} msl_launch;

/* One SIMD-group's exchange area: a lane publishes into slot[its parity][lane], synchronises, then
 * reads. Each lane's two parities let consecutive collectives proceed with one synchronisation
 * each. A sync completes only when every live lane of the SIMD-group waits (at a SIMD-group sync
 * or a threadgroup barrier), so every lane has finished reading the one before; it releases the
 * lanes waiting at the earliest point, the active lanes (all of them unless control flow
 * diverged). */
typedef struct msl_simd_exchange {
    MSL_ALIGN16 unsigned char slot[2][MSL_SIMD_WIDTH][MSL_XCHG_BYTES];
    uint32_t live_lanes; /* bit i set while lane i has not returned; kept by the runtime */
    /* The active lanes of the SIMD-group's latest completed sync, whose slots a collective reads;
     * sync_parity bit i: the parity lane i published in; generation: completed syncs. Set by the
     * runtime; they stay put while released lanes read, even if one of them returns first. */
    uint32_t sync_lanes;
    uint32_t sync_parity;
    uint32_t generation;
    /* A reduction's result: the first lane to read sync `generation` computes it into
     * result[generation % 2] and sets reduced[generation % 2] = generation; the others copy it.
     * Kernel side only (the runtime zeroes reduced per threadgroup). */
    MSL_ALIGN16 unsigned char result[2][MSL_XCHG_BYTES];
    uint32_t reduced[2];
} msl_simd_exchange;

/* Per threadgroup state the kernel side may touch. */
typedef struct msl_group {
    void *const *threadgroup_args; /* base of each [[threadgroup(n)]] allocation */
    uint32_t threadgroup_position[3];
} msl_group;

/* One GPU thread (one fiber). Values are Metal's compute builtins. */
typedef struct msl_thread {
    uint32_t thread_position_in_grid[3];
    uint32_t threadgroup_position_in_grid[3];
    uint32_t thread_position_in_threadgroup[3];
    uint32_t threads_per_threadgroup[3];
    uint32_t threadgroups_per_grid[3];
    uint32_t thread_index_in_threadgroup;
    uint32_t thread_index_in_simdgroup;
    uint32_t simdgroup_index_in_threadgroup;
    uint32_t threads_per_simdgroup;
    uint32_t simdgroups_per_threadgroup;
    uint32_t xchg_parity;             /* flips at every SIMD-group exchange this lane takes part in */
    msl_simd_exchange *simd_exchange; /* this thread's SIMD-group's area */
    const msl_launch *launch;
    const msl_group *group;
} msl_thread;

/* Sync kinds, for diagnostics: which construct a thread is waiting in. A barrier's kind carries
 * its mem_flags shifted by MSL_SYNC_FLAGS_SHIFT (checked mode orders memory by them). */
typedef enum msl_sync_kind {
    MSL_SYNC_THREADGROUP_BARRIER = 1,
    MSL_SYNC_SIMDGROUP_BARRIER = 2,
    MSL_SYNC_SIMD_COLLECTIVE = 3
} msl_sync_kind;
#define MSL_SYNC_FLAGS_SHIFT 8
#define MSL_MEM_THREADGROUP 2u /* metal::mem_flags::mem_threadgroup */

/* Checked mode: what an instrumented load or store reports (api->access). */
typedef enum msl_access_kind {
    MSL_ACCESS_READ = 1,
    MSL_ACCESS_WRITE = 2, /* a read-modify-write is READ | WRITE */
    MSL_ACCESS_ATOMIC = 4 /* with READ and/or WRITE */
} msl_access_kind;

typedef struct msl_runtime_api {
    uint32_t abi_version; /* MSL_ABI_VERSION */
    /* The GPU thread running now on this OS thread. */
    msl_thread *(*current)(void);
    /* Block until every live thread of the caller's SIMD-group (kind SIMDGROUP_BARRIER or
     * SIMD_COLLECTIVE) or threadgroup (THREADGROUP_BARRIER) waits at the same construct and
     * source line; otherwise the dispatch fails with a divergence diagnostic. `what` names the
     * construct ("simd_sum", "threadgroup_barrier", ...). Does not return if the dispatch fails. */
    void (*sync)(msl_thread *t, int32_t kind, const char *what, const char *file, uint32_t line);
    /* Storage for a kernel-scope `threadgroup T a[N];`: one block per threadgroup and site_key,
     * zero-initialised is NOT promised (Metal does not), shared by the threadgroup's threads. */
    void *(*threadgroup_static)(msl_thread *t, const void *site_key, uint64_t size, uint64_t align);
    /* Fail the dispatch with a message (e.g. a shim precondition); does not return. */
    void (*fail)(msl_thread *t, const char *message, const char *file, uint32_t line);
    /* Like fail, for a dispatch whose arguments do not fit the kernel (an unbound [[buffer(n)]]):
     * reported as a bad argument (MCPU_ERR_VALUE), not a kernel failure. */
    void (*fail_argument)(msl_thread *t, const char *message, const char *file, uint32_t line);
    /* MSL_UNBOUND_BYTES of zeroes, read-only (a write faults, failing the dispatch): what an
     * optional [[buffer(n), function_constant(c)]] argument left unbound refers to. */
    const void *(*unbound_storage)(void);
    /* Checked mode (libraries built with MSL_CHECKED): every load and store of kernel code, before
     * it happens. `pc` is the return address into the kernel's code. Fails the dispatch (does not
     * return) on a threadgroup-memory race, an uninitialised threadgroup read or an access outside
     * the bound buffers or threadgroup memory; ignores memory that is neither. */
    void (*access)(const void *address, uint64_t size, int32_t kind, const void *pc);
} msl_runtime_api;

#ifdef __cplusplus
}
#endif
#endif
