/* The CPU Metal device's runtime: runs a dispatch with Metal's execution model.
 *
 * Threadgroups are taken from an atomic counter by the calling thread and by helper threads of a
 * lazily created pool. Each OS thread runs one threadgroup at a time on a "worker" (fibers,
 * stacks, threadgroup memory) borrowed from a bounded process-wide set, every GPU thread as a
 * fiber. A fiber runs until it reaches a sync point (api->sync) or returns; then the worker
 * switches straight to the next runnable fiber of a ready queue. The last thread to arrive at a
 * barrier releases the others (queues them) and carries on without a switch, so a barrier costs
 * one fiber switch per thread.
 *
 * Guards (README, "Security and robustness"): while a fiber runs kernel code (worker.in_kernel),
 * SIGSEGV, SIGBUS, SIGILL and SIGFPE of that code jump back to the worker's home context (on a
 * per-thread alternate signal stack, so a stack overflow is caught too) and fail the dispatch
 * naming the kernel; an x86-64 integer division fault is completed with an unspecified value, as
 * a GPU does. A watchdog thread, awake only while dispatches run, stops a dispatch on SIGINT or
 * after the configured time limit, preempting kernel code with SIGURG. */
#if !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* posix_memalign, sysconf(_SC_NPROCESSORS_ONLN), REG_RIP, dladdr under -std=c11 */
#endif
#include "device.h"
#include "fiber.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/ucontext.h> /* ucontext_t; macOS has it from <signal.h> */
#endif

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

/* ---- checked mode's state (README, "Checked mode") ---- */

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
    volatile sig_atomic_t in_kernel; /* a fiber runs kernel code: its faults are the kernel's */
    sigjmp_buf escape;               /* in run_threadgroup: where a fault or a stop lands */
    volatile int fault_signal, fault_code; /* 0: stopped (SIGINT, watchdog) */
    void *volatile fault_address;
    void *volatile fault_pc;
    mcpu_stack_region stacks;
    uint32_t n_stacks;    /* slots taken */
    pthread_t thread;     /* the thread using it, while in_use */
    int32_t in_use, trimmed; /* under pool.mu */
    struct worker *next;  /* pool.workers list */
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
    checked_state *checked; /* for a checked dispatch */
    lockstep_state *lockstep; /* for a lockstep dispatch */
    gthread threads[MAX_THREADS];
} worker;

static _Thread_local worker *tls_worker TLS_SIGNAL_SAFE; /* the worker this thread uses, if any */

static void check_interval_end(worker *w); /* checked mode */

/* ---- failures ---- */

static void job_fail(job *j, int32_t code, const char *message) {
    if (atomic_exchange(&j->failed, 1) == 0) mcpu_fail(j->st, code, "%s", message);
}

typedef struct text {
    char buf[MCPU_STATUS_MESSAGE_BYTES];
    size_t len;
} text;

static void vadd(text *m, const char *fmt, va_list ap) {
    int k = vsnprintf(m->buf + m->len, sizeof m->buf - m->len, fmt, ap);
    if (k > 0) m->len = m->len + (size_t)k < sizeof m->buf ? m->len + (size_t)k : sizeof m->buf - 1;
}

static void add(text *m, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vadd(m, fmt, ap);
    va_end(ap);
}

static inline int same_string(const char *a, const char *b) { return a == b || strcmp(a, b) == 0; }

static inline int same_point(const gthread *a, const gthread *b) {
    return a->line == b->line && a->kind == b->kind && same_string(a->file, b->file) &&
           same_string(a->what, b->what);
}

static int same_place(const gthread *a, const gthread *b) {
    return a->state == b->state && (a->state != WAITING || same_point(a, b));
}

/* x86's general protection fault, which carries no address: a non-canonical address (no access of
 * a kernel is promised more alignment than its memory's allocation has: relax_alignment, build.c) */
static int general_protection_fault(int sig, int code) {
#ifdef SI_KERNEL
    return sig == SIGSEGV && code == SI_KERNEL;
#else
    (void)sig, (void)code;
    return 0;
#endif
}

/* "threads 0-31 at fa.metal:42 (simd_sum); thread 40 exited; ..." for threads [lo, hi). */
static void list_threads(text *m, const worker *w, uint32_t lo, uint32_t hi) {
    uint16_t place[MAX_THREADS] = {0}; /* 1 + index of the first thread at the same place */
    for (uint32_t i = lo; i < hi; i++) {
        if (place[i]) continue;
        const gthread *key = &w->threads[i];
        uint32_t count = 0;
        for (uint32_t k = i; k < hi; k++)
            if (!place[k] && same_place(key, &w->threads[k])) place[k] = (uint16_t)(i + 1), count++;
        add(m, "%s%s ", i == lo ? "" : "; ", count == 1 ? "thread" : "threads");
        for (uint32_t k = i, first = 1; k < hi; k++) {
            if (place[k] != i + 1) continue;
            uint32_t end = k;
            while (end + 1 < hi && place[end + 1] == i + 1) end++;
            add(m, "%s%u", first ? "" : ", ", k);
            if (end > k) add(m, "-%u", end);
            first = 0, k = end;
        }
        if (key->state == WAITING) add(m, " at %s:%u (%s)", key->file, key->line, key->what);
        else add(m, key->state == DONE ? " exited" : " not at a sync point");
    }
}

/* Fails the dispatch from inside a fiber and abandons the threadgroup: the worker's home context
 * resumes and the fibers are never run again. simdgroup >= 0 lists that SIMD-group's threads,
 * -1 the whole threadgroup's, -2 none. */
_Noreturn static void group_fail(worker *w, int32_t code, int simdgroup, const char *fmt, ...) {
    w->in_kernel = 0;
    text m = {.len = 0};
    const uint32_t *p = w->tg.threadgroup_position;
    add(&m, "kernel '%s': ", w->job->launch->kernel_name);
    va_list ap;
    va_start(ap, fmt);
    vadd(&m, fmt, ap);
    va_end(ap);
    add(&m, " in threadgroup (%u,%u,%u)", p[0], p[1], p[2]);
    uint32_t lo = 0, hi = w->n_threads;
    if (simdgroup >= 0) {
        add(&m, ", SIMD-group %d", simdgroup);
        lo = (uint32_t)simdgroup * MSL_SIMD_WIDTH;
        hi = lo + MSL_SIMD_WIDTH < hi ? lo + MSL_SIMD_WIDTH : hi;
    }
    if (simdgroup >= -1) {
        add(&m, ": ");
        list_threads(&m, w, lo, hi);
    }
    job_fail(w->job, code, m.buf);
    mcpu_fiber_switch(&w->running->fiber, &w->home);
    __builtin_trap(); /* an abandoned fiber is never resumed */
}

/* ---- scheduling ---- */

/* A sync point released g: its lockstep starts over. */
static void lockstep_released(worker *w, const gthread *g) { w->lockstep->pc[g->t.thread_index_in_threadgroup] = NULL; }

static void make_ready(worker *w, gthread *g) {
    g->state = READY;
    uint32_t slot = (w->ready_head + w->ready_count++) % MAX_THREADS;
    w->ready[slot] = g;
    if (w->lockstep) {
        lockstep_released(w, g);
        w->lockstep->slot[g->t.thread_index_in_threadgroup] = (uint16_t)slot;
    }
}

static gthread *take_ready(worker *w) {
    gthread *g = w->ready[w->ready_head];
    w->ready_head = (w->ready_head + 1) % MAX_THREADS;
    w->ready_count--;
    return g;
}

/* Switches from g (which waits or has exited) to the next runnable fiber. */
static void run_next(worker *w, gthread *g) {
    if (w->ready_count == 0) {
        /* Nothing can run. Every stall is reported or settled where it arises (settle_simd), so
         * this is a runtime bug: fail the dispatch rather than hang. */
        group_fail(w, MCPU_ERR_RUNTIME, -1, "deadlock: no thread can run");
    }
    gthread *next = take_ready(w);
    w->running = next;
    mcpu_fiber_switch(&g->fiber, &next->fiber);
}

/* Queues every other live thread of a completed threadgroup barrier. */
static void release_group(worker *w, const gthread *self) {
    if (w->checked && (self->flags & MSL_MEM_THREADGROUP)) w->checked->epoch++;
    w->group.arrived = 0;
    for (uint32_t s = 0; s < w->n_simdgroups; s++) w->simd[s].at_barrier = 0;
    for (uint32_t i = 0; i < w->n_threads; i++)
        if (&w->threads[i] != self) make_ready(w, &w->threads[i]);
}

/* Completes a SIMD-group sync with the lanes in `active` (waiting at one point): publishes what
 * they read (msl_simd_exchange) and queues them (self goes on running). */
static void release_simd(worker *w, uint32_t sg, uint32_t active, gthread *self) {
    msl_simd_exchange *x = &w->xchg[sg];
    scope *s = &w->simd[sg];
    uint32_t parity = 0;
    const gthread *point = &w->threads[sg * MSL_SIMD_WIDTH + (uint32_t)__builtin_ctz(active)];
    if (w->checked && point->kind == MSL_SYNC_SIMDGROUP_BARRIER && (point->flags & MSL_MEM_THREADGROUP))
        w->checked->simd_epoch[sg]++;
    for (uint32_t lanes = active; lanes; lanes &= lanes - 1) {
        uint32_t lane = (uint32_t)__builtin_ctz(lanes);
        gthread *g = &w->threads[sg * MSL_SIMD_WIDTH + lane];
        parity |= (g->t.xchg_parity & 1u) << lane;
        if (g != self) {
            make_ready(w, g);
        } else {
            g->state = READY;
            if (w->lockstep) lockstep_released(w, g);
        }
    }
    x->sync_lanes = active, x->sync_parity = parity, x->generation++;
    s->arrived -= (uint32_t)__builtin_popcount(active);
    s->mixed = s->arrived > 0; /* the lanes left waiting may still differ */
}

/* Once every live lane of SIMD-group sg waits (at SIMD-group syncs or a threadgroup barrier),
 * completes the SIMD-group sync at the earliest point (lowest line, then file) with the lanes
 * waiting there: the active lanes, as in MSL's divergent control flow. simdgroup_barrier, which
 * Metal requires of every lane, fails the dispatch when only some are there. */
static void settle_simd(worker *w, uint32_t sg, gthread *self) {
    scope *s = &w->simd[sg];
    if (s->arrived == 0 || s->arrived + s->at_barrier < s->live) return;
    uint32_t live = w->xchg[sg].live_lanes;
    if (!s->mixed && s->at_barrier == 0) {
        release_simd(w, sg, live, self);
        return;
    }
    const gthread *lead = NULL;
    for (uint32_t lanes = live; lanes; lanes &= lanes - 1) {
        const gthread *g = &w->threads[sg * MSL_SIMD_WIDTH + (uint32_t)__builtin_ctz(lanes)];
        if (g->state != WAITING || g->kind == MSL_SYNC_THREADGROUP_BARRIER) continue;
        if (!lead || g->line < lead->line || (g->line == lead->line && strcmp(g->file, lead->file) < 0)) lead = g;
    }
    uint32_t active = 0;
    for (uint32_t lanes = live; lanes; lanes &= lanes - 1) {
        uint32_t lane = (uint32_t)__builtin_ctz(lanes);
        const gthread *g = &w->threads[sg * MSL_SIMD_WIDTH + lane];
        if (g->state == WAITING && g->kind != MSL_SYNC_THREADGROUP_BARRIER && same_point(g, lead)) active |= 1u << lane;
    }
    if (lead->kind == MSL_SYNC_SIMDGROUP_BARRIER && active != live)
        group_fail(w, MCPU_ERR_RUNTIME, (int)sg, "simdgroup_barrier in divergent control flow");
    release_simd(w, sg, active, self);
}

/* Leaves the threadgroup of a failed dispatch for good (from runtime code on a fiber). */
_Noreturn static void abandon(worker *w) {
    mcpu_fiber_switch(&w->running->fiber, &w->home);
    __builtin_trap(); /* an abandoned fiber is never resumed */
}

static void rt_sync(msl_thread *t, int32_t kind_and_flags, const char *what, const char *file, uint32_t line) {
    gthread *g = (gthread *)t;
    worker *w = g->w;
    int32_t kind = kind_and_flags & ((1 << MSL_SYNC_FLAGS_SHIFT) - 1);
    w->in_kernel = 0;
    if (atomic_load_explicit(&w->job->failed, memory_order_relaxed)) abandon(w); /* stopped, or failed elsewhere */
    g->state = WAITING;
    g->kind = kind, g->what = what, g->file = file, g->line = line;
    g->flags = (uint32_t)kind_and_flags >> MSL_SYNC_FLAGS_SHIFT;
    uint32_t sg = t->simdgroup_index_in_threadgroup;
    if (kind == MSL_SYNC_THREADGROUP_BARRIER) {
        scope *s = &w->group;
        if (s->arrived == 0) s->first = g;
        else if (!same_point(s->first, g))
            group_fail(w, MCPU_ERR_RUNTIME, -1, "threadgroup_barrier in divergent control flow");
        if (w->n_done) group_fail(w, MCPU_ERR_RUNTIME, -1, "threadgroup_barrier reached by only some threads");
        if (++s->arrived == s->live) {
            if (g->flags & MSL_MEM_THREADGROUP) check_interval_end(w);
            g->state = READY;
            if (w->lockstep) lockstep_released(w, g);
            release_group(w, g);
        } else {
            w->simd[sg].at_barrier++;
            settle_simd(w, sg, g); /* its SIMD-group's other lanes may wait at a collective */
        }
    } else {
        scope *s = &w->simd[sg];
        if (s->arrived == 0) s->first = g;
        else if (!s->mixed && !same_point(s->first, g)) s->mixed = 1;
        s->arrived++;
        settle_simd(w, sg, g);
    }
    if (g->state == WAITING) run_next(w, g);
    w->in_kernel = 1;
}

/* What every fiber runs: the kernel for one GPU thread, then leave for good. */
static void thread_main(void *arg) {
    gthread *g = arg;
    worker *w = g->w;
    w->in_kernel = 1;
    w->job->fn();
    w->in_kernel = 0;
    g->state = DONE;
    w->n_done++;
    uint32_t sg = g->t.simdgroup_index_in_threadgroup;
    scope *s = &w->simd[sg];
    s->live--;
    w->xchg[sg].live_lanes &= ~(1u << g->t.thread_index_in_simdgroup);
    if (w->group.arrived)
        group_fail(w, MCPU_ERR_RUNTIME, -1, "threadgroup_barrier reached by only some threads");
    settle_simd(w, sg, g); /* the exited lane may have been the last one running */
    if (w->n_done == w->n_threads) check_interval_end(w);
    if (w->n_done == w->n_threads) mcpu_fiber_switch(&g->fiber, &w->home);
    else run_next(w, g);
    __builtin_trap(); /* a finished fiber is never resumed */
}

/* ---- the runtime table ---- */

static msl_thread *rt_current(void) {
    worker *w = tls_worker;
    return w && w->running ? &w->running->t : NULL;
}

static void *rt_threadgroup_static(msl_thread *t, const void *key, uint64_t size, uint64_t align) {
    worker *w = ((gthread *)t)->w;
    for (uint32_t i = 0; i < w->n_statics; i++)
        if (w->statics[i].key == key) return w->statics[i].ptr;
    if (w->n_statics == MAX_STATIC_SITES)
        group_fail(w, MCPU_ERR_RUNTIME, -2, "more than %d kernel-scope threadgroup arrays",
                   MAX_STATIC_SITES);
    uintptr_t base = (uintptr_t)w->tg_memory, a = align > 1 ? (uintptr_t)align : 1;
    uint64_t offset = ((base + w->tg_used + a - 1) & ~(a - 1)) - base;
    if (offset + size > MCPU_MAX_THREADGROUP_MEMORY)
        group_fail(w, MCPU_ERR_VALUE, -2,
                   "threadgroup memory exceeds %d bytes: %llu bytes of [[threadgroup(n)]] arguments"
                   " plus %llu bytes of kernel-scope threadgroup arrays (with alignment)",
                   MCPU_MAX_THREADGROUP_MEMORY, (unsigned long long)w->tg_args_bytes,
                   (unsigned long long)(offset + size - w->tg_args_bytes));
    void *p = w->tg_memory + offset;
    memset(p, GARBAGE, size);
    if (w->checked) memset(w->checked->owner + offset, OWNER_STATIC + (int)w->n_statics, size);
    w->tg_used = offset + size;
    w->statics[w->n_statics].key = key;
    w->statics[w->n_statics].size = size;
    w->statics[w->n_statics++].ptr = p;
    return p;
}

/* message without a leading "kernel '<name>': ", which group_fail adds. */
static const char *own_words(const worker *w, const char *message) {
    const char *name = w->job->launch->kernel_name;
    size_t n = strlen(name);
    if (!strncmp(message, "kernel '", 8) && !strncmp(message + 8, name, n) && !strncmp(message + 8 + n, "': ", 3))
        return message + 11 + n;
    return message;
}

static void rt_fail(msl_thread *t, const char *message, const char *file, uint32_t line) {
    worker *w = ((gthread *)t)->w;
    group_fail(w, MCPU_ERR_RUNTIME, -2, "%s (%s:%u, thread %u)", own_words(w, message), file, line,
               t->thread_index_in_threadgroup);
}

static void rt_fail_argument(msl_thread *t, const char *message, const char *file, uint32_t line) {
    worker *w = ((gthread *)t)->w;
    group_fail(w, MCPU_ERR_VALUE, -2, "%s (%s:%u)", own_words(w, message), file, line);
}

static const void *unbound_region;
static void map_unbound_region(void) {
    void *p = mmap(NULL, MSL_UNBOUND_BYTES, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    unbound_region = p == MAP_FAILED ? NULL : p;
}
static const void *rt_unbound_storage(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, map_unbound_region);
    return unbound_region;
}

/* ---- checked mode: every load and store of a checked library's kernel code (api->access) ----
 *
 * Threadgroup memory keeps marks per byte (checked_state). Ordered before an access are: accesses
 * of an earlier barrier interval (a threadgroup_barrier with mem_flags::mem_threadgroup between),
 * accesses of the same thread, atomic accesses for an atomic one, and within a SIMD-group accesses
 * before a simdgroup_barrier(mem_flags::mem_threadgroup), or in lockstep every access of the
 * SIMD-group (lockstep_stop runs them in program order). Anything else is a race if one of the two
 * writes: SIMD collectives and simdgroup_matrix operations exchange values, not memory, so they
 * order nothing (as in Metal, where only the barriers' memory flags do). */

static int ordered(const worker *w, const mark *m, uint32_t me) {
    const checked_state *c = w->checked;
    uint32_t sg = me / MSL_SIMD_WIDTH;
    return m->epoch < c->epoch ||
           ((uint32_t)(m->thread - 1) / MSL_SIMD_WIDTH == sg && (w->lockstep || m->simd_epoch < c->simd_epoch[sg]));
}

static int conflicts(const worker *w, const mark *m, const mark *now) {
    return m->thread && m->thread != now->thread && !(m->atomic && now->atomic) && !ordered(w, m, now->thread - 1u);
}

static void note_read(const checked_state *c, byte_marks *m, const mark *now) {
    uint32_t sg = (uint32_t)(now->thread - 1) / MSL_SIMD_WIDTH;
    if (!m->read.thread || m->read.epoch != c->epoch) {
        m->read_same_simd.thread = m->read_other_simd.thread = 0;
    } else if ((uint32_t)(m->read.thread - 1) / MSL_SIMD_WIDTH == sg) {
        if (m->read.thread != now->thread) m->read_same_simd = m->read;
    } else {
        m->read_other_simd = m->read;
        m->read_same_simd.thread = 0;
    }
    m->read = *now;
}

/* f's threads: the running one and f->other. */
static void name_threads(const worker *w, finding *f) {
    const gthread *g = w->running;
    memcpy(f->group, w->tg.threadgroup_position, sizeof f->group);
    f->thread = g->t.thread_index_in_threadgroup;
    memcpy(f->position, g->t.thread_position_in_threadgroup, sizeof f->position);
    if (f->other != NO_THREAD)
        memcpy(f->other_position, w->threads[f->other].t.thread_position_in_threadgroup, sizeof f->other_position);
}

/* Fails the dispatch with f (its threads named), from a fiber. */
_Noreturn static void report_finding(worker *w, const finding *f) {
    w->in_kernel = 0;
    job *j = w->job;
    if (atomic_exchange(&j->failed, 1) == 0) {
        j->found = *f;
        mcpu_fail(j->st, MCPU_ERR_RUNTIME, "kernel '%s': checked mode found an error", j->launch->kernel_name);
    }
    abandon(w);
}

/* Which allocation threadgroup-memory byte `at` belongs to (outside all: the one before it), into f. */
static void locate_in_threadgroup(const worker *w, uint64_t at, finding *f) {
    uint64_t below = at < MCPU_MAX_THREADGROUP_MEMORY ? at : MCPU_MAX_THREADGROUP_MEMORY - 1;
    while (below > 0 && !w->checked->owner[below]) below--;
    uint8_t owner = w->checked->owner[below];
    f->space = IN_THREADGROUP_MEMORY;
    f->is_static = owner >= OWNER_STATIC;
    if (!owner) {
        f->index = -1, f->offset = (int64_t)at, f->bytes = w->tg_used;
    } else if (owner < OWNER_STATIC) {
        f->index = owner - 1;
        f->offset = (int64_t)(at - (uint64_t)((unsigned char *)w->tg_args[f->index] - w->tg_memory));
        f->bytes = w->job->launch->threadgroup_arg_lengths[f->index];
    } else {
        f->index = owner - OWNER_STATIC;
        f->offset = (int64_t)(at - (uint64_t)((unsigned char *)w->statics[f->index].ptr - w->tg_memory));
        f->bytes = w->statics[f->index].size;
    }
}

static void check_threadgroup(worker *w, uint64_t offset, uint64_t size, int32_t kind, const void *pc) {
    checked_state *c = w->checked;
    uint32_t me = w->running->t.thread_index_in_threadgroup;
    mark now = {c->epoch, c->simd_epoch[me / MSL_SIMD_WIDTH], (uint16_t)(me + 1),
                (uint16_t)((kind & MSL_ACCESS_ATOMIC) != 0), pc};
    finding f = {.access = kind, .other = NO_THREAD, .pc = pc, .size = size};
    uint64_t end = size < MCPU_MAX_THREADGROUP_MEMORY - offset ? offset + size : MCPU_MAX_THREADGROUP_MEMORY;
    for (uint64_t b = offset; b < end; b++) {
        byte_marks *m = &c->marks[b];
        const mark *other = NULL;
        int32_t other_access = MSL_ACCESS_WRITE;
        if (!c->owner[b]) {
            f.what = FOUND_OUT_OF_BOUNDS;
        } else if ((kind & MSL_ACCESS_READ) && (!m->write.thread || m->write.epoch < c->first_epoch)) {
            if (!c->unwritten_read) { /* reported at the interval's end unless a race shows first */
                f.what = FOUND_UNINITIALISED;
                locate_in_threadgroup(w, offset, &f);
                name_threads(w, &f);
                c->unwritten_read = &c->pending;
                c->pending = f;
                f.what = FOUND_NOTHING;
            }
            note_read(c, m, &now);
            if (kind & MSL_ACCESS_WRITE) m->write = now;
        } else if (conflicts(w, &m->write, &now)) {
            other = &m->write;
        } else if (kind & MSL_ACCESS_WRITE) {
            const mark *reads[3] = {&m->read, &m->read_same_simd, &m->read_other_simd};
            for (int r = 0; r < 3 && !other; r++)
                if (conflicts(w, reads[r], &now)) other = reads[r], other_access = MSL_ACCESS_READ;
            if (!other) {
                m->write = now;
                m->read.thread = m->read_same_simd.thread = m->read_other_simd.thread = 0;
            }
        } else {
            note_read(c, m, &now);
        }
        if (other) {
            f.what = FOUND_RACE;
            f.other = other->thread - 1u;
            f.other_pc = other->pc;
            f.other_access = other_access | (other->atomic ? MSL_ACCESS_ATOMIC : 0);
        }
        if (f.what) {
            locate_in_threadgroup(w, offset, &f);
            name_threads(w, &f);
            report_finding(w, &f);
        }
    }
    if (end - offset < size) { /* runs past the end of threadgroup memory */
        f.what = FOUND_OUT_OF_BOUNDS;
        locate_in_threadgroup(w, offset, &f);
        name_threads(w, &f);
        report_finding(w, &f);
    }
}

/* At the end of a barrier interval (or of the threadgroup): a read of bytes nobody wrote. */
static void check_interval_end(worker *w) {
    if (w->checked && w->checked->unwritten_read) report_finding(w, w->checked->unwritten_read);
}

/* An access inside the guarded region: within some bound buffer, or out of bounds of the nearest. */
static void check_buffer(worker *w, uintptr_t a, uint64_t size, int32_t kind, const void *pc) {
    const guarded *g = w->job->guard;
    uint32_t nearest = 0;
    uint64_t distance = UINT64_MAX;
    for (uint32_t i = 0; i < g->n; i++) {
        uintptr_t start = g->start[i];
        uint64_t len = g->length[i];
        if (a >= start && size <= len && a - start <= len - size) return;
        uint64_t d = a < start ? start - a : a - start >= len ? a - start - len : 0;
        if (d < distance) nearest = i, distance = d;
    }
    finding f = {.what = FOUND_OUT_OF_BOUNDS, .access = kind, .other = NO_THREAD, .pc = pc, .size = size,
                 .bytes = g->length[nearest], .offset = (int64_t)(a - g->start[nearest]), .space = IN_BUFFER,
                 .index = (int32_t)g->index[nearest]};
    name_threads(w, &f);
    report_finding(w, &f);
}

/* ---- lockstep (README, "Lockstep"): a SIMD-group's lanes take their threadgroup-memory
 * accesses in step, as on a GPU that issues each instruction for all active lanes at once ----
 *
 * Each lane stops before every threadgroup-memory access, at its code address. A step is made by
 * the lanes at the lowest address among those stopped (lockstep_round): each makes its access,
 * then runs to its next stop, and the next step starts once all of them have. Lanes a sync point
 * just released (not stopped yet) first run to their first stop. So lanes in uniform control flow
 * make every access together, whatever the code's layout; in divergent flow, for structured code,
 * whose machine code follows the source's order, lanes that skip an `if` wait after it for those
 * inside, and lanes that leave a loop wait for those still in it: the hardware's reconvergence.
 * Lanes at a sync point or done take no part (a SIMD-group sync completes as without lockstep). */

/* Another READY lane of g's SIMD-group in `among` (a lane mask), else one not stopped yet, else NULL. */
static gthread *lockstep_next(worker *w, const gthread *g, uint32_t among) {
    uint32_t sg = g->t.simdgroup_index_in_threadgroup, me = g->t.thread_index_in_simdgroup;
    gthread *lanes = &w->threads[sg * MSL_SIMD_WIDTH];
    for (uint32_t live = w->xchg[sg].live_lanes & ~(1u << me); live; live &= live - 1) {
        gthread *l = &lanes[__builtin_ctz(live)];
        if (l->state == READY && ((among >> __builtin_ctz(live) & 1u) || !w->lockstep->pc[l->t.thread_index_in_threadgroup]))
            return l;
    }
    return NULL;
}

/* The lanes stopped at the lowest address: the next step. */
static uint32_t lockstep_step_lanes(worker *w, uint32_t sg) {
    gthread *lanes = &w->threads[sg * MSL_SIMD_WIDTH];
    uintptr_t lowest = UINTPTR_MAX;
    uint32_t round = 0;
    for (uint32_t live = w->xchg[sg].live_lanes; live; live &= live - 1) {
        uint32_t lane = (uint32_t)__builtin_ctz(live);
        uintptr_t pc = (uintptr_t)w->lockstep->pc[sg * MSL_SIMD_WIDTH + lane];
        if (lanes[lane].state != READY || pc > lowest) continue;
        if (pc < lowest) lowest = pc, round = 0;
        round |= 1u << lane;
    }
    return round;
}

static void lockstep_stop(worker *w, const void *pc) {
    gthread *g = w->running;
    uint32_t sg = g->t.simdgroup_index_in_threadgroup, me = 1u << g->t.thread_index_in_simdgroup;
    scope *s = &w->simd[sg];
    lockstep_state *ls = w->lockstep;
    ls->pc[g->t.thread_index_in_threadgroup] = pc;
    for (;;) {
        if (s->lockstep_round & me) { /* g's turn in this step */
            s->lockstep_round &= ~me;
            return;
        }
        gthread *next = lockstep_next(w, g, s->lockstep_round);
        if (!next) {
            s->lockstep_round = lockstep_step_lanes(w, sg);
            continue;
        }
        uint16_t slot = ls->slot[next->t.thread_index_in_threadgroup]; /* g takes next's place in the queue */
        ls->slot[g->t.thread_index_in_threadgroup] = slot;
        w->ready[slot] = g;
        w->running = next;
        mcpu_fiber_switch(&g->fiber, &next->fiber);
    }
}

static void rt_access(const void *address, uint64_t size, int32_t kind, const void *pc) {
    worker *w = tls_worker;
    if (!w || !w->in_kernel) return; /* not kernel code of a dispatch */
    uintptr_t a = (uintptr_t)address, in_group = a - (uintptr_t)w->tg_memory;
    if (in_group < MCPU_MAX_THREADGROUP_MEMORY && w->lockstep) { /* runtime code, as in rt_sync */
        w->in_kernel = 0;
        if (atomic_load_explicit(&w->job->failed, memory_order_relaxed)) abandon(w); /* stopped, or failed elsewhere */
        lockstep_stop(w, pc);
        w->in_kernel = 1;
    }
    if (!w->checked) return;
    const guarded *g = w->job->guard;
    if (in_group < MCPU_MAX_THREADGROUP_MEMORY) check_threadgroup(w, in_group, size, kind, pc);
    else if (g && a - (uintptr_t)g->region < g->bytes) check_buffer(w, a, size, kind, pc);
}

/* Copies the buffers of known length into a fresh region: each group of overlapping bindings on
 * its own pages (at its original offset in the page, keeping alignment) between guard pages.
 * copies[i] is what binds [[buffer(i)]]. */
enum { GUARD_BYTES = 256u << 20 };
static int32_t guard_buffers(const msl_launch *l, guarded *g, void **copies, mcpu_status *st) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    uint32_t order[MSL_MAX_BUFFERS], n = 0, group_of[MSL_MAX_BUFFERS];
    uintptr_t lo[MSL_MAX_BUFFERS], hi[MSL_MAX_BUFFERS];
    size_t at[MSL_MAX_BUFFERS], span[MSL_MAX_BUFFERS];
    memset(g, 0, sizeof *g);
    for (uint32_t i = 0; i < l->n_buffers; i++) {
        copies[i] = l->buffers[i];
        uint64_t len = l->buffer_lengths ? l->buffer_lengths[i] : UINT64_MAX;
        if (!l->buffers[i] || len == UINT64_MAX) continue;
        if (len > UINTPTR_MAX - (uintptr_t)l->buffers[i])
            return mcpu_fail(st, MCPU_ERR_VALUE, "kernel '%s': buffer %u of %llu bytes wraps around the address space",
                           l->kernel_name, i, (unsigned long long)len);
        uint32_t k = n++; /* insertion by address */
        for (; k > 0 && (uintptr_t)l->buffers[order[k - 1]] > (uintptr_t)l->buffers[i]; k--) order[k] = order[k - 1];
        order[k] = i;
    }
    size_t total = GUARD_BYTES;
    for (uint32_t k = 0; k < n; k++) {
        uint32_t i = order[k];
        uintptr_t a = (uintptr_t)l->buffers[i], e = a + l->buffer_lengths[i];
        if (g->n_groups && a < hi[g->n_groups - 1]) {
            hi[g->n_groups - 1] = e > hi[g->n_groups - 1] ? e : hi[g->n_groups - 1];
        } else {
            lo[g->n_groups] = a, hi[g->n_groups] = e;
            g->n_groups++;
        }
        group_of[k] = g->n_groups - 1;
    }
    for (uint32_t k = 0; k < g->n_groups; k++) {
        size_t bytes = (size_t)(hi[k] - lo[k]) + lo[k] % page;
        span[k] = bytes == 0 ? page : (bytes + page - 1) / page * page;
        at[k] = total;
        if (span[k] > SIZE_MAX / 2 - total - GUARD_BYTES)
            return mcpu_fail(st, MCPU_ERR_VALUE, "kernel '%s': buffers too large for checked mode", l->kernel_name);
        total += span[k] + GUARD_BYTES;
    }
    if (n == 0) return MCPU_OK;
    void *region = mmap(NULL, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (region == MAP_FAILED)
        return mcpu_fail(st, MCPU_ERR_RUNTIME, "kernel '%s': no address space for checked mode's guarded buffers",
                       l->kernel_name);
    g->region = region, g->bytes = total;
    for (uint32_t k = 0; k < g->n_groups; k++) {
        unsigned char *copy = g->region + at[k] + lo[k] % page;
        if (mprotect(g->region + at[k], span[k], PROT_READ | PROT_WRITE)) {
            munmap(g->region, g->bytes);
            g->region = NULL;
            return mcpu_fail(st, MCPU_ERR_RUNTIME, "kernel '%s': no memory for checked mode's copy of %llu bytes",
                           l->kernel_name, (unsigned long long)(hi[k] - lo[k]));
        }
        memcpy(copy, (const void *)lo[k], (size_t)(hi[k] - lo[k]));
        g->group[k].original = (unsigned char *)lo[k];
        g->group[k].copy = copy;
        g->group[k].bytes = hi[k] - lo[k];
    }
    for (uint32_t k = 0; k < n; k++) {
        uint32_t i = order[k];
        unsigned char *copy = g->group[group_of[k]].copy + ((uintptr_t)l->buffers[i] - lo[group_of[k]]);
        copies[i] = copy;
        g->index[k] = i, g->start[k] = (uintptr_t)copy, g->length[k] = l->buffer_lengths[i];
    }
    g->n = n;
    return MCPU_OK;
}

/* Writes what the kernel changed back to the buffers, and frees the region. */
static void unguard_buffers(guarded *g) {
    if (!g->region) return;
    for (uint32_t k = 0; k < g->n_groups; k++)
        if (memcmp(g->group[k].original, g->group[k].copy, (size_t)g->group[k].bytes))
            memcpy(g->group[k].original, g->group[k].copy, (size_t)g->group[k].bytes);
    munmap(g->region, g->bytes);
    g->region = NULL;
}

static const char *access_words(int32_t kind, int32_t past) {
    static const char *const words[2][4] = {{"reads", "writes", "atomically reads", "atomically writes"},
                                            {"read", "wrote", "atomically read", "atomically wrote"}};
    return words[past][((kind & MSL_ACCESS_WRITE) ? 1 : 0) + ((kind & MSL_ACCESS_ATOMIC) ? 2 : 0)];
}

/* The dispatch's error message for its finding, with source lines (after the dispatch). */
static void describe_finding(const job *j, mcpu_status *st) {
    const finding *f = &j->found;
    char here[512], there[512], where[96];
    mcpu_source_place(f->pc, here, sizeof here);
    if (f->space == IN_BUFFER) snprintf(where, sizeof where, "[[buffer(%d)]]", f->index);
    else if (f->index < 0) snprintf(where, sizeof where, "threadgroup memory");
    else if (f->is_static) snprintf(where, sizeof where, "kernel-scope threadgroup array #%d", f->index + 1);
    else snprintf(where, sizeof where, "[[threadgroup(%d)]]", f->index);
    const uint32_t *g = f->group, *p = f->position, *q = f->other_position;
    text m = {.len = 0};
    add(&m, "kernel '%s': ", j->launch->kernel_name);
    if (f->what == FOUND_RACE) {
        mcpu_source_place(f->other_pc, there, sizeof there);
        int same_simd = f->thread / MSL_SIMD_WIDTH == f->other / MSL_SIMD_WIDTH;
        add(&m,
            "threadgroup memory data race in threadgroup (%u,%u,%u): thread %u (%u,%u,%u) %s %llu bytes at byte %lld "
            "of %s at %s; thread %u (%u,%u,%u) %s them at %s, with no threadgroup_barrier(mem_flags::mem_threadgroup)%s "
            "between",
            g[0], g[1], g[2], f->thread, p[0], p[1], p[2], access_words(f->access, 0), (unsigned long long)f->size,
            (long long)f->offset, where, here, f->other, q[0], q[1], q[2], access_words(f->other_access, 1), there,
            same_simd ? " or simdgroup_barrier(mem_flags::mem_threadgroup) (same SIMD-group)" : "");
    } else if (f->what == FOUND_UNINITIALISED) {
        add(&m,
            "read of threadgroup memory never written in this threadgroup: thread %u (%u,%u,%u) of threadgroup "
            "(%u,%u,%u) %s %llu bytes at byte %lld of %s (%llu bytes) at %s",
            f->thread, p[0], p[1], p[2], g[0], g[1], g[2], access_words(f->access, 0), (unsigned long long)f->size,
            (long long)f->offset, where, (unsigned long long)f->bytes, here);
    } else {
        add(&m,
            "out-of-bounds access: thread %u (%u,%u,%u) of threadgroup (%u,%u,%u) %s %llu bytes at byte offset %lld "
            "of %s, which has %llu bytes%s, at %s",
            f->thread, p[0], p[1], p[2], g[0], g[1], g[2], access_words(f->access, 0), (unsigned long long)f->size,
            (long long)f->offset, where, (unsigned long long)f->bytes,
            f->space == IN_THREADGROUP_MEMORY && f->index < 0 ? " allocated" : "", here);
    }
    mcpu_fail(st, MCPU_ERR_RUNTIME, "%s", m.buf);
}

static _Atomic uint64_t checked_dispatches;
uint64_t mcpu_checked_dispatches(void) { return atomic_load(&checked_dispatches); }

const msl_runtime_api *mcpu_runtime_api(void) {
    static const msl_runtime_api api = {MSL_ABI_VERSION, rt_current, rt_sync, rt_threadgroup_static,
                                        rt_fail, rt_fail_argument, rt_unbound_storage, rt_access};
    return &api;
}

/* ---- faults of kernel code and preemption (signals.c installs the handlers) ---- */

/* The signals.c hook: a fault of kernel code, or the watchdog's preemption, on this thread's
 * running fiber jumps back to its worker; everything else is passed on. */
static int kernel_signal(int sig, siginfo_t *info, void *context) {
    worker *w = tls_worker;
    if (!w || !w->in_kernel) return 0;
    if (sig == SIGURG && atomic_load(&w->job->failed)) { /* the watchdog stops this dispatch */
        w->in_kernel = 0;
        w->fault_signal = 0;
        siglongjmp(w->escape, 1);
    }
    if (sig != SIGURG && info->si_code > 0) { /* raised by the kernel's own instruction */
        if (sig == SIGFPE && mcpu_complete_division(context)) return 1;
        w->in_kernel = 0;
        w->fault_signal = sig;
        w->fault_code = info->si_code;
        w->fault_address = info->si_addr;
        w->fault_pc = mcpu_context_pc(context);
        siglongjmp(w->escape, 1);
    }
    return 0;
}

enum { SIGNAL_STACK_BYTES = 64 * 1024 };
static pthread_key_t pool_key(void);
static _Thread_local int32_t tls_signal_stack TLS_SIGNAL_SAFE;

/* An alternate signal stack for this thread (unless it has one, e.g. faulthandler's), so that a
 * fiber's stack overflow can be handled. Freed when the thread exits (pool.key). */
static void signal_stack_for_this_thread(void) {
    if (tls_signal_stack) return;
    tls_signal_stack = 1;
    stack_t cur;
    if (sigaltstack(NULL, &cur) || !(cur.ss_flags & SS_DISABLE)) return;
    void *p = mmap(NULL, SIGNAL_STACK_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return;
    stack_t ss = {.ss_sp = p, .ss_flags = 0, .ss_size = SIGNAL_STACK_BYTES};
    if (sigaltstack(&ss, NULL)) munmap(p, SIGNAL_STACK_BYTES);
    else pthread_setspecific(pool_key(), p);
}

static void signal_stack_free(void *stack) {
    stack_t cur, off = {.ss_sp = NULL, .ss_flags = SS_DISABLE, .ss_size = 0};
    if (!sigaltstack(NULL, &cur) && cur.ss_sp == stack && !(cur.ss_flags & SS_ONSTACK) && !sigaltstack(&off, NULL))
        munmap(stack, SIGNAL_STACK_BYTES);
}

/* ---- running threadgroups ---- */

static worker *worker_new(void) {
    worker *w = NULL;
    if (posix_memalign((void **)&w, 64, sizeof *w) != 0) return NULL;
    memset(w, 0, sizeof *w);
    if (posix_memalign((void **)&w->tg_memory, 4096, MCPU_MAX_THREADGROUP_MEMORY) != 0 ||
        mcpu_stack_region_reserve(&w->stacks, MAX_THREADS, MCPU_FIBER_STACK_BYTES, MCPU_FIBER_GUARD_BYTES)) {
        free(w->tg_memory);
        free(w);
        return NULL;
    }
    return w;
}

/* Sets up what stays the same for every threadgroup of the dispatch. */
static int worker_prepare(worker *w, job *j) {
    const msl_launch *l = j->launch;
    const uint32_t *tptg = l->threads_per_threadgroup;
    w->job = j;
    w->n_threads = tptg[0] * tptg[1] * tptg[2];
    w->n_simdgroups = (w->n_threads + MSL_SIMD_WIDTH - 1) / MSL_SIMD_WIDTH;
    w->tg.threadgroup_args = w->tg_args;
    w->tg_args_bytes = 0;
    for (uint32_t a = 0; a < l->n_threadgroup_args; a++) { /* 16-byte aligned, as in Metal */
        w->tg_args[a] = w->tg_memory + w->tg_args_bytes;
        if (w->checked) memset(w->checked->owner + w->tg_args_bytes, 1 + (int)a, l->threadgroup_arg_lengths[a]);
        w->tg_args_bytes += (l->threadgroup_arg_lengths[a] + 15) & ~(uint64_t)15;
    }
    w->tg_used = w->tg_args_bytes;
    for (; w->n_stacks < w->n_threads; w->n_stacks++)
        if (mcpu_stack_region_take(&w->stacks, w->n_stacks, &w->threads[w->n_stacks].fiber) != 0) return -1;
    for (uint32_t i = 0; i < w->n_threads; i++) {
        gthread *g = &w->threads[i];
        msl_thread *t = &g->t;
        g->w = w;
        t->thread_position_in_threadgroup[0] = i % tptg[0];
        t->thread_position_in_threadgroup[1] = i / tptg[0] % tptg[1];
        t->thread_position_in_threadgroup[2] = i / tptg[0] / tptg[1];
        memcpy(t->threads_per_threadgroup, tptg, sizeof t->threads_per_threadgroup);
        memcpy(t->threadgroups_per_grid, l->threadgroups_per_grid, sizeof t->threadgroups_per_grid);
        t->thread_index_in_threadgroup = i;
        t->thread_index_in_simdgroup = i % MSL_SIMD_WIDTH;
        t->simdgroup_index_in_threadgroup = i / MSL_SIMD_WIDTH;
        t->threads_per_simdgroup = MSL_SIMD_WIDTH;
        t->simdgroups_per_threadgroup = w->n_simdgroups;
        t->simd_exchange = &w->xchg[i / MSL_SIMD_WIDTH];
        t->launch = l;
        t->group = &w->tg;
    }
    return 0;
}

/* Fails the dispatch for a fault of kernel code on w's running fiber (after the escape). */
static void report_fault(worker *w) {
    const gthread *g = w->running;
    const uint32_t *p = w->tg.threadgroup_position, *tp = g->t.thread_position_in_threadgroup;
    int sig = w->fault_signal;
    text m = {.len = 0};
    add(&m, "kernel '%s': ", w->job->launch->kernel_name);
    long slot = mcpu_stack_region_guard_slot(&w->stacks, w->fault_address);
    if (slot >= 0)
        add(&m, "stack overflow: the thread's %zu KiB fiber stack is exhausted (deep recursion or large local "
                "arrays)", (size_t)MCPU_FIBER_STACK_BYTES / 1024); /* at least; fiber.c staggers the tops */
    else if (general_protection_fault(sig, w->fault_code))
        add(&m, "invalid memory access (SIGSEGV, a general protection fault), e.g. a wild pointer (an address "
                "outside the address space)");
    else if (sig == SIGSEGV || sig == SIGBUS)
        add(&m, "invalid memory access (%s) at address %p, e.g. an out-of-bounds index into a buffer",
            sig == SIGSEGV ? "SIGSEGV" : "SIGBUS", w->fault_address);
    else if (sig == SIGFPE)
        add(&m, "arithmetic fault (SIGFPE)");
    else
        add(&m, "illegal instruction (SIGILL), e.g. a trap the compiler put where behaviour is undefined");
    add(&m, " in threadgroup (%u,%u,%u), thread (%u,%u,%u) of it (index %u)", p[0], p[1], p[2], tp[0], tp[1], tp[2],
        g->t.thread_index_in_threadgroup);
    Dl_info info;
    if (w->fault_pc && dladdr(w->fault_pc, &info) && info.dli_sname)
        add(&m, ", in %s+0x%lx", info.dli_sname, (unsigned long)((char *)w->fault_pc - (char *)info.dli_saddr));
    if (w->job->checked) { /* its line tables name the faulting line */
        char place[512];
        mcpu_source_place((const char *)w->fault_pc + 1, place, sizeof place);
        add(&m, " at %s", place);
    }
    if (g->file) add(&m, ", after its sync point at %s:%u (%s)", g->file, g->line, g->what);
    else add(&m, ", before any sync point");
    job_fail(w->job, MCPU_ERR_RUNTIME, m.buf);
}

static void run_threadgroup(worker *w, uint64_t index) {
    const msl_launch *l = w->job->launch;
    const uint32_t *tgpg = l->threadgroups_per_grid, *tptg = l->threads_per_threadgroup;
    uint32_t *pos = w->tg.threadgroup_position;
    pos[0] = (uint32_t)(index % tgpg[0]);
    pos[1] = (uint32_t)(index / tgpg[0] % tgpg[1]);
    pos[2] = (uint32_t)(index / tgpg[0] / tgpg[1]);
    memset(w->tg_memory, GARBAGE, w->tg_args_bytes); /* fresh garbage: no leftovers to rely on */
    if (w->checked) { /* a new barrier interval; the last threadgroup's arrays are gone */
        w->checked->first_epoch = ++w->checked->epoch;
        w->checked->unwritten_read = NULL;
        memset(w->checked->owner + w->tg_args_bytes, 0, w->tg_used - w->tg_args_bytes);
    }
    w->tg_used = w->tg_args_bytes;
    w->n_statics = 0;
    w->n_done = 0;
    w->ready_head = w->ready_count = 0;
    w->group = (scope){0, w->n_threads, NULL, 0, 0};
    for (uint32_t s = 0; s < w->n_simdgroups; s++) {
        uint32_t live = w->n_threads - s * MSL_SIMD_WIDTH;
        live = live < MSL_SIMD_WIDTH ? live : MSL_SIMD_WIDTH;
        w->simd[s] = (scope){0, live, NULL, 0, 0};
        w->xchg[s].generation = w->xchg[s].reduced[0] = w->xchg[s].reduced[1] = 0;
        w->xchg[s].live_lanes = live == 32 ? ~0u : (1u << live) - 1; /* absent lanes never live */
    }
    for (uint32_t i = 0; i < w->n_threads; i++) {
        gthread *g = &w->threads[i];
        for (int d = 0; d < 3; d++) {
            g->t.threadgroup_position_in_grid[d] = pos[d];
            g->t.thread_position_in_grid[d] = pos[d] * tptg[d] + g->t.thread_position_in_threadgroup[d];
        }
        g->t.xchg_parity = 0;
        g->file = NULL;
        mcpu_fiber_init(&g->fiber, thread_main, g);
        make_ready(w, g);
    }
    w->running = take_ready(w);
    if (sigsetjmp(w->escape, 0) == 0) /* a fault or a stop in kernel code comes back here */
        mcpu_fiber_switch(&w->home, &w->running->fiber); /* back when all threads exited or one failed */
    else if (w->fault_signal)
        report_fault(w);
    w->in_kernel = 0;
    w->running = NULL;
}

static void work(worker *w, job *j) {
    if (j->checked && !(w->checked = calloc(1, sizeof *w->checked))) return; /* the others do the work */
    if (j->lockstep && !(w->lockstep = calloc(1, sizeof *w->lockstep))) {
        free(w->checked);
        w->checked = NULL;
        return;
    }
    if (worker_prepare(w, j) == 0) { /* else no stacks for this worker: the others do the work */
        while (!atomic_load_explicit(&j->failed, memory_order_relaxed)) {
            uint64_t index = atomic_fetch_add_explicit(&j->next_group, 1, memory_order_relaxed);
            if (index >= j->n_groups) break;
            run_threadgroup(w, index);
        }
    }
    free(w->checked);
    free(w->lockstep);
    w->checked = NULL;
    w->lockstep = NULL;
}

/* ---- the pool: workers, helper threads that join dispatches, the watchdog ---- */

/* Workers: twice the cores, at least MIN_WORKERS, but their fiber stacks (two mappings each: guard
 * and stack) may take at most half of vm.max_map_count (a default of 16 where it is not known). */
enum { TRIM_AFTER_IDLE_SECONDS = 1, MIN_WORKERS = 4, DEFAULT_MAX_WORKERS = 16 };

static struct {
    pthread_once_t once;
    pthread_key_t key; /* a thread's signal stack, freed when the thread exits */
    pthread_mutex_t mu;
    pthread_cond_t work, idle; /* a job wants helpers; a job's last helper left */
    pthread_cond_t worker_free, watch; /* a worker was returned; the watchdog has a job to watch */
    job *jobs;                 /* dispatches open to helpers */
    job *active;               /* every running dispatch */
    worker *workers;           /* every worker */
    uint32_t n_workers, max_workers;
    uint32_t n_helpers;        /* helper threads started (0 again after fork) */
    int32_t watchdog_started, watchdog_waiting;
} pool = {PTHREAD_ONCE_INIT, 0, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, NULL, NULL, 0, 0, 0, 0, 0};

/* The dispatch time limit in seconds (0: none): $FLASHATTN_MPS_CPU_WATCHDOG until set. */
static _Atomic double time_limit;
static const char *time_limit_error; /* a bad $FLASHATTN_MPS_CPU_WATCHDOG, reported by every dispatch */
static pthread_once_t time_limit_once = PTHREAD_ONCE_INIT;

static void time_limit_from_environment(void) {
    const char *env = getenv("FLASHATTN_MPS_CPU_WATCHDOG");
    char *end;
    double v = env && *env ? strtod(env, &end) : 0;
    if (env && *env && (*end || !(v >= 0) || v > 1e9)) time_limit_error = env;
    else atomic_store(&time_limit, v);
}

int32_t mcpu_set_watchdog(double seconds, mcpu_status *st) {
    pthread_once(&time_limit_once, time_limit_from_environment);
    if (!(seconds >= 0) || seconds > 1e9)
        return mcpu_fail(st, MCPU_ERR_VALUE, "watchdog: seconds must be a number in 0..1e9 (0 turns it off), got %g",
                       seconds);
    atomic_store(&time_limit, seconds);
    time_limit_error = NULL;
    return MCPU_OK;
}

double mcpu_watchdog(void) {
    pthread_once(&time_limit_once, time_limit_from_environment);
    return atomic_load(&time_limit);
}

static double now_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void pool_after_fork_in_child(void) { /* only the forking thread exists in the child */
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.work, NULL);
    pthread_cond_init(&pool.idle, NULL);
    pthread_cond_init(&pool.worker_free, NULL);
    pthread_cond_init(&pool.watch, NULL);
    pool.jobs = pool.active = NULL;
    for (worker *w = pool.workers; w; w = w->next) w->in_use = 0;
    pool.n_helpers = 0;
    pool.watchdog_started = pool.watchdog_waiting = 0;
}

static pthread_key_t pool_key(void) { return pool.key; }

static uint32_t worker_budget(void) {
    long maps = 0;
    FILE *f = fopen("/proc/sys/vm/max_map_count", "r");
    if (f) {
        if (fscanf(f, "%ld", &maps) != 1) maps = 0;
        fclose(f);
    }
    long n = maps / 2 / (2 * MAX_THREADS);
    return maps <= 0 ? DEFAULT_MAX_WORKERS : n < 1 ? 1 : (uint32_t)n;
}

static void pool_once(void) {
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    uint32_t n = cpus > 0 ? 2 * (uint32_t)cpus : MIN_WORKERS, budget = worker_budget();
    n = n < MIN_WORKERS ? MIN_WORKERS : n;
    pool.max_workers = n < budget ? n : budget;
    pthread_key_create(&pool.key, signal_stack_free);
    pthread_atfork(NULL, NULL, pool_after_fork_in_child);
    mcpu_signals_set_hook(kernel_signal);
    mcpu_signals_ensure();
}

/* A free worker for this thread (under pool.mu): an idle one, a new one while fewer than
 * max_workers exist, else (wait) the next one returned, or NULL. */
static worker *acquire_worker(int32_t wait) {
    for (;;) {
        for (worker *w = pool.workers; w; w = w->next)
            if (!w->in_use) {
                w->in_use = 1;
                w->thread = pthread_self();
                return w;
            }
        if (pool.n_workers < pool.max_workers) {
            worker *w = worker_new();
            if (!w) return NULL;
            w->next = pool.workers;
            pool.workers = w;
            pool.n_workers++;
            continue;
        }
        if (!wait) return NULL;
        pthread_cond_wait(&pool.worker_free, &pool.mu);
    }
}

static void release_worker(worker *w) { /* under pool.mu */
    w->in_use = 0;
    w->trimmed = 0;
    pthread_cond_signal(&pool.worker_free);
}

/* Stops job j (under pool.mu) and preempts its kernel code. */
static void stop_job(job *j) {
    for (worker *w = pool.workers; w; w = w->next)
        if (w->in_use && w->job == j && w->in_kernel) pthread_kill(w->thread, SIGURG);
}

/* Watches running dispatches every 50 ms: SIGINT or the time limit stops them. Trims the stacks
 * of workers idle for a second. Sleeps while nothing runs. */
static void *watchdog_main(void *unused) {
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL); /* signals go to the threads they concern */
    pthread_mutex_lock(&pool.mu);
    double idle_since = now_seconds();
    for (;;) {
        if (!pool.active) {
            int32_t untrimmed = 0;
            for (worker *w = pool.workers; w; w = w->next) untrimmed |= !w->in_use && !w->trimmed;
            double idle = now_seconds() - idle_since;
            if (untrimmed && idle >= TRIM_AFTER_IDLE_SECONDS) { /* give touched stack pages back */
                for (worker *w = pool.workers; w; w = w->next)
                    if (!w->in_use && !w->trimmed) mcpu_stack_region_trim(&w->stacks), w->trimmed = 1;
                continue;
            }
            if (untrimmed) { /* dispatches starting meanwhile are seen within the second */
                struct timespec t;
                clock_gettime(CLOCK_REALTIME, &t);
                t.tv_sec += TRIM_AFTER_IDLE_SECONDS;
                pthread_cond_timedwait(&pool.watch, &pool.mu, &t);
            } else {
                pool.watchdog_waiting = 1; /* the next dispatch wakes it */
                pthread_cond_wait(&pool.watch, &pool.mu);
                pool.watchdog_waiting = 0;
            }
            continue;
        }
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        t.tv_nsec += 50000000;
        if (t.tv_nsec >= 1000000000) t.tv_sec++, t.tv_nsec -= 1000000000;
        pthread_cond_timedwait(&pool.watch, &pool.mu, &t);
        mcpu_signals_reinstall(); /* someone may have replaced ours since */
        uint64_t seen_interrupts = mcpu_interrupts();
        double now = now_seconds();
        idle_since = now;
        for (job *j = pool.active; j; j = j->next_active) {
            if (!j->seen) j->seen = 1, j->started = now;
            const char *name = j->launch->kernel_name;
            if (seen_interrupts != j->interrupts) {
                text m = {.len = 0};
                add(&m, "kernel '%s': interrupted (SIGINT) after %.3g s", name, now - j->started);
                job_fail(j, MCPU_ERR_RUNTIME, m.buf);
            } else if (j->time_limit > 0 && now - j->started > j->time_limit) {
                text m = {.len = 0};
                add(&m,
                    "kernel '%s': stopped by the CPU Metal device's watchdog after %.3g s (the limit is %g s; "
                    "set it with flashattn_mps.metal_cpu.set_watchdog(seconds) or FLASHATTN_MPS_CPU_WATCHDOG, "
                    "0 for none)",
                    name, now - j->started, j->time_limit);
                job_fail(j, MCPU_ERR_RUNTIME, m.buf);
            }
            if (atomic_load(&j->failed)) stop_job(j);
        }
    }
    return NULL;
}

static job *open_job(void) {
    for (job *j = pool.jobs; j; j = j->next)
        if (j->helpers_joined < j->helpers_wanted && !atomic_load(&j->failed) &&
            atomic_load(&j->next_group) < j->n_groups)
            return j;
    return NULL;
}

static void *helper_main(void *unused) {
    signal_stack_for_this_thread();
    pthread_mutex_lock(&pool.mu);
    for (;;) {
        job *j;
        while (!(j = open_job())) pthread_cond_wait(&pool.work, &pool.mu);
        j->helpers_joined++;
        worker *w = acquire_worker(0);
        if (!w) continue; /* every worker is busy: the job's other threads do its work */
        j->helpers_active++;
        pthread_mutex_unlock(&pool.mu);
        tls_worker = w;
        work(w, j);
        tls_worker = NULL;
        pthread_mutex_lock(&pool.mu);
        release_worker(w);
        if (--j->helpers_active == 0) pthread_cond_broadcast(&pool.idle);
    }
    return NULL;
}

static void start_threads(void) { /* under pool.mu */
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    for (long i = pool.n_helpers; i + 1 < cpus; i++) { /* the calling thread is the last worker */
        pthread_t th;
        if (pthread_create(&th, NULL, helper_main, NULL) != 0) break;
        pthread_detach(th);
        pool.n_helpers++;
    }
    pthread_t th;
    if (!pool.watchdog_started && pthread_create(&th, NULL, watchdog_main, NULL) == 0) {
        pthread_detach(th);
        pool.watchdog_started = 1;
    }
}

int32_t mcpu_run(mcpu_kernel_fn fn, const msl_launch *launch, uint32_t mode, mcpu_status *st) {
    const uint32_t *g = launch->threadgroups_per_grid;
    const int32_t checked = (mode & MCPU_CHECKED) != 0;
    guarded guard = {0};
    msl_launch on_copies;
    void *copies[MSL_MAX_BUFFERS];
    if (checked) { /* the kernel runs on guarded copies of the buffers */
        atomic_fetch_add(&checked_dispatches, 1);
        if (guard_buffers(launch, &guard, copies, st)) return st->code;
        on_copies = *launch;
        on_copies.buffers = copies;
        launch = &on_copies;
    }
    job j = {.fn = fn, .launch = launch, .n_groups = (uint64_t)g[0] * g[1] * g[2], .st = st, .checked = checked,
             .lockstep = (mode & MCPU_LOCKSTEP) != 0, .guard = checked ? &guard : NULL};
    atomic_init(&j.next_group, 0);
    atomic_init(&j.failed, 0);
    pthread_once(&pool.once, pool_once);
    j.time_limit = mcpu_watchdog();
    if (time_limit_error)
        return mcpu_fail(st, MCPU_ERR_VALUE, "FLASHATTN_MPS_CPU_WATCHDOG='%s': expected seconds >= 0 (0: no limit)",
                       time_limit_error);
    signal_stack_for_this_thread();
    pthread_mutex_lock(&pool.mu);
    worker *w = acquire_worker(1);
    if (!w) {
        pthread_mutex_unlock(&pool.mu);
        return mcpu_fail(st, MCPU_ERR_RUNTIME, "kernel '%s': out of memory for a worker", launch->kernel_name);
    }
    j.interrupts = mcpu_interrupts();
    j.next_active = pool.active;
    pool.active = &j;
    if (pool.watchdog_waiting) pthread_cond_signal(&pool.watch), pool.watchdog_waiting = 0;
    if (!pool.watchdog_started || (j.n_groups > 1 && pool.n_helpers == 0)) start_threads();
    if (j.n_groups > 1) {
        j.helpers_wanted = j.n_groups - 1 < pool.n_helpers ? (uint32_t)j.n_groups - 1 : pool.n_helpers;
        j.next = pool.jobs;
        pool.jobs = &j;
        pthread_cond_broadcast(&pool.work);
    }
    pthread_mutex_unlock(&pool.mu);
    tls_worker = w;
    work(w, &j);
    tls_worker = NULL;
    pthread_mutex_lock(&pool.mu);
    if (j.n_groups > 1) {
        job **p = &pool.jobs;
        while (*p != &j) p = &(*p)->next;
        *p = j.next;
        while (j.helpers_active) pthread_cond_wait(&pool.idle, &pool.mu);
    }
    job **a = &pool.active;
    while (*a != &j) a = &(*a)->next_active;
    *a = j.next_active;
    release_worker(w);
    pthread_mutex_unlock(&pool.mu);
    if (atomic_load(&j.next_group) < j.n_groups) /* nobody could take them */
        job_fail(&j, MCPU_ERR_RUNTIME, "cannot map fiber stacks (out of memory or vm.max_map_count)");
    if (checked) {
        unguard_buffers(&guard);
        if (j.found.what) describe_finding(&j, st);
    }
    return atomic_load(&j.failed) ? st->code : MCPU_OK;
}
