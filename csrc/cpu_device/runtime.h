/* What the runtime's files share (runtime.c: running threadgroups; checked.c: checked mode's
 * buffers and findings; pool.c: the pool, the watchdog and mcpu_run; failures.c: messages). The
 * dispatch's hot path (scheduling, the runtime table, checked accesses, lockstep) stays in
 * runtime.c. pool.c -> runtime.c, checked.c, failures.c; runtime.c -> failures.c; checked.c ->
 * failures.c; never the other way. */
#ifndef MCPU_RUNTIME_H
#define MCPU_RUNTIME_H

#include "device.h"
#include "fiber.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>

#if defined(__GNUC__) && !defined(__APPLE__)
#define TLS_SIGNAL_SAFE __attribute__((tls_model("initial-exec"))) /* read in signal handlers */
#else
#define TLS_SIGNAL_SAFE
#endif

enum {
    MAX_THREADS = MSL_MAX_THREADS_PER_THREADGROUP,
    MAX_SIMDGROUPS = MSL_MAX_THREADS_PER_THREADGROUP / MSL_SIMD_WIDTH,
    MAX_STATIC_SITES = 64,
    GARBAGE = 0xFF /* uninitialised threadgroup memory reads as NaN (float, half) or -1 */
};

/* ---- checked mode's state (docs/cpu-device.md, "Checked mode") ---- */

/* One access to one byte of threadgroup memory: by thread (1 + its index; 0: none), in barrier
 * interval `epoch`, after `simd_epoch` simdgroup_barriers of its SIMD-group, at pc. */
typedef struct mark {
    uint32_t epoch, simd_epoch;
    uint16_t thread, atomic;
    const void *pc;
} mark;

/* Per byte: the last write and enough of the current interval's reads to find any read a write
 * races with: the last read, the last by another thread of its SIMD-group, and the last of
 * another SIMD-group (once two SIMD-groups read, every write races with one of them). */
typedef struct byte_marks {
    mark write, read, read_same_simd, read_other_simd;
} byte_marks;

enum { OWNER_STATIC = 32 }; /* owner: 1 + [[threadgroup(n)]], OWNER_STATIC + kernel-scope array, 0: none */

/* A dispatch's buffers of known length, copied into one region of guard pages (PROT_NONE, so an
 * access far off faults) around each group of overlapping bindings. */
typedef struct guarded {
    unsigned char *region;
    size_t bytes;
    uint32_t n, n_groups;
    uint32_t index[MSL_MAX_BUFFERS]; /* [[buffer(index)]] is at start, length bytes */
    uintptr_t start[MSL_MAX_BUFFERS];
    uint64_t length[MSL_MAX_BUFFERS];
    struct {
        unsigned char *original, *copy;
        uint64_t bytes;
    } group[MSL_MAX_BUFFERS];
} guarded;

typedef enum { FOUND_NOTHING, FOUND_RACE, FOUND_UNINITIALISED, FOUND_OUT_OF_BOUNDS } found_kind;
enum { NO_THREAD = UINT32_MAX, IN_THREADGROUP_MEMORY = 0, IN_BUFFER = 1 };

/* The first error a checked dispatch found, described (with source lines) once it has ended. */
typedef struct finding {
    int32_t what;                 /* found_kind */
    int32_t access, other_access; /* msl_access_kind */
    uint32_t group[3], thread, other, position[3], other_position[3];
    const void *pc, *other_pc;
    uint64_t size, bytes; /* of the access; of the allocation or buffer it hit */
    int64_t offset;       /* into that allocation or buffer */
    int32_t space;        /* IN_THREADGROUP_MEMORY, IN_BUFFER */
    int32_t index;        /* [[threadgroup(n)]] or [[buffer(n)]]; -1: no allocation */
    int32_t is_static;    /* index counts kernel-scope threadgroup arrays */
} finding;

typedef struct checked_state {
    byte_marks marks[MCPU_MAX_THREADGROUP_MEMORY];
    uint8_t owner[MCPU_MAX_THREADGROUP_MEMORY];
    /* Barrier intervals: a threadgroup_barrier(mem_threadgroup) starts one, so does each
     * threadgroup; a mark of an interval before first_epoch is from another threadgroup. */
    uint32_t epoch, first_epoch;
    uint32_t simd_epoch[MAX_SIMDGROUPS]; /* simdgroup_barrier(mem_threadgroup)s per SIMD-group */
    /* The interval's first read of bytes not written yet: a race if another thread writes them
     * before the interval ends (the write reports it), else uninitialised (reported then). */
    finding *unwritten_read, pending; /* NULL or &pending */
} checked_state;

/* One dispatch. */
typedef struct job {
    mcpu_kernel_fn fn;
    const msl_launch *launch;
    uint64_t n_groups;
    _Atomic uint64_t next_group;
    atomic_int failed; /* the first failure writes st; everyone then stops taking threadgroups */
    mcpu_status *st;
    uint32_t helpers_wanted, helpers_joined, helpers_active; /* under pool.mu */
    struct job *next;                                        /* pool.jobs list */
    /* the watchdog's, under pool.mu */
    struct job *next_active; /* pool.active list */
    uint64_t interrupts;     /* SIGINTs counted when it started */
    double time_limit, started;
    int32_t seen;
    /* checked mode, lockstep (MCPU_CHECKED, MCPU_LOCKSTEP) */
    int32_t checked, lockstep;
    const guarded *guard;
    finding found; /* written by the failing thread, read once the dispatch has ended */
} job;

typedef enum { READY, WAITING, DONE } gstate;

/* One GPU thread. */
typedef struct gthread {
    msl_thread t; /* first member: the api hands kernels &t */
    struct worker *w;
    mcpu_fiber fiber;
    gstate state;
    /* where the thread waits, while WAITING, and the barrier's mem_flags */
    int32_t kind;
    uint32_t flags;
    uint32_t line;
    const char *what, *file;
} gthread;

/* A SIMD-group or the threadgroup, as a barrier scope. */
typedef struct scope {
    uint32_t arrived, live;
    const gthread *first; /* the first arrival: a threadgroup barrier's others must wait at the same point */
    /* SIMD-group scopes: lanes waiting at a threadgroup barrier, and whether the lanes waiting at
     * SIMD-group syncs may be at different points (divergent control flow) */
    uint32_t at_barrier, mixed;
    uint32_t lockstep_round; /* lockstep: the lanes still to make the access of this step */
} scope;

/* A lockstep dispatch's, per thread (by index in the threadgroup): the code address of the
 * threadgroup-memory access it is stopped at (NULL: none since a sync point released it), and
 * while it is READY its place in the ready queue. Apart from gthread, so that dispatches
 * without lockstep pay for no more than a test of worker.lockstep when they queue a thread. */
typedef struct lockstep_state {
    const void *pc[MAX_THREADS];
    uint16_t slot[MAX_THREADS];
} lockstep_state;

/* What an OS thread needs to run threadgroups: borrowed from the pool for one dispatch, so fibers,
 * stacks and memory are reused and their number stays bounded however many threads dispatch. */
typedef struct worker {
    mcpu_fiber home; /* the OS thread's own stack: threadgroups start and end here */
    job *job;
    volatile sig_atomic_t in_kernel;       /* a fiber runs kernel code: its faults are the kernel's */
    sigjmp_buf escape;                     /* in run_threadgroup: where a fault or a stop lands */
    volatile int fault_signal, fault_code; /* 0: stopped (SIGINT, watchdog) */
    void *volatile fault_address;
    void *volatile fault_pc;
    mcpu_stack_region stacks;
    uint32_t n_stacks;       /* slots taken */
    pthread_t thread;        /* the thread using it, while in_use */
    int32_t in_use, trimmed; /* under pool.mu */
    struct worker *next;     /* pool.workers list */
    gthread *running;
    uint32_t n_threads, n_simdgroups, n_done;
    scope group, simd[MAX_SIMDGROUPS];
    gthread *ready[MAX_THREADS]; /* ring buffer: each thread is queued at most once */
    uint32_t ready_head, ready_count;
    msl_group tg;
    void *tg_args[MSL_MAX_THREADGROUP_ARGS];
    unsigned char *tg_memory; /* MCPU_MAX_THREADGROUP_MEMORY bytes: arguments, then static arrays */
    uint64_t tg_args_bytes, tg_used;
    struct {
        const void *key;
        void *ptr;
        uint64_t size;
    } statics[MAX_STATIC_SITES];
    uint32_t n_statics;
    msl_simd_exchange xchg[MAX_SIMDGROUPS];
    checked_state *checked;   /* for a checked dispatch */
    lockstep_state *lockstep; /* for a lockstep dispatch */
    gthread threads[MAX_THREADS];
} worker;

/* ---- failures.c ---- */

typedef struct text {
    char buf[MCPU_STATUS_MESSAGE_BYTES];
    size_t len;
} text;

void job_fail(job *j, int32_t code, const char *message); /* the first failure of a dispatch wins */
void vadd(text *m, const char *fmt, va_list ap);
void add(text *m, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* ---- runtime.c ---- */

worker *worker_new(void);
/* Runs threadgroups of j on w until none is left or j failed. */
void work(worker *w, job *j);
/* The worker this thread runs threadgroups on (NULL: none), which the signal hook looks at. */
void set_thread_worker(worker *w);
/* signals.c's hook (mcpu_signal_hook) for faults of kernel code and the watchdog's preemption. */
int kernel_signal(int sig, siginfo_t *info, void *context);

/* ---- checked.c ---- */

/* The kernel of a checked dispatch runs on guarded copies of the buffers: copies[i] binds
 * [[buffer(i)]]; unguard_buffers writes what the kernel changed back. */
int32_t guard_buffers(const msl_launch *l, guarded *g, void **copies, mcpu_status *st);
void unguard_buffers(guarded *g);
/* The dispatch's error message for its finding, with source lines (after the dispatch). */
void describe_finding(const job *j, mcpu_status *st);

#endif
