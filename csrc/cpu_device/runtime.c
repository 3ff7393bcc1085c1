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
 * Guards (docs/security.md): while a fiber runs kernel code (worker.in_kernel),
 * SIGSEGV, SIGBUS, SIGILL and SIGFPE of that code jump back to the worker's home context (on a
 * per-thread alternate signal stack, so a stack overflow is caught too) and fail the dispatch
 * naming the kernel; an x86-64 integer division fault is completed with an unspecified value, as
 * a GPU does. A watchdog thread, awake only while dispatches run, stops a dispatch on SIGINT or
 * after the configured time limit, preempting kernel code with SIGURG. */
#if !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* posix_memalign, sysconf(_SC_NPROCESSORS_ONLN), REG_RIP, dladdr under -std=c11 */
#endif
#include "runtime.h"

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


static _Thread_local worker *tls_worker TLS_SIGNAL_SAFE; /* the worker this thread uses, if any */

void set_thread_worker(worker *w) { tls_worker = w; }

static void check_interval_end(worker *w); /* checked mode */

/* ---- failures ---- */

static inline int same_string(const char *a, const char *b) { return a == b || strcmp(a, b) == 0; }

static inline int same_point(const gthread *a, const gthread *b) {
    return a->line == b->line && a->kind == b->kind && same_string(a->file, b->file) && same_string(a->what, b->what);
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
    if (w->group.arrived) group_fail(w, MCPU_ERR_RUNTIME, -1, "threadgroup_barrier reached by only some threads");
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
        group_fail(w, MCPU_ERR_RUNTIME, -2, "more than %d kernel-scope threadgroup arrays", MAX_STATIC_SITES);
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
    finding f = {.what = FOUND_OUT_OF_BOUNDS,
                 .access = kind,
                 .other = NO_THREAD,
                 .pc = pc,
                 .size = size,
                 .bytes = g->length[nearest],
                 .offset = (int64_t)(a - g->start[nearest]),
                 .space = IN_BUFFER,
                 .index = (int32_t)g->index[nearest]};
    name_threads(w, &f);
    report_finding(w, &f);
}

/* ---- lockstep (docs/cpu-device.md, "Lockstep"): a SIMD-group's lanes take their threadgroup-memory
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
        if (l->state == READY &&
            ((among >> __builtin_ctz(live) & 1u) || !w->lockstep->pc[l->t.thread_index_in_threadgroup]))
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

const msl_runtime_api *mcpu_runtime_api(void) {
    static const msl_runtime_api api = {MSL_ABI_VERSION,  rt_current,         rt_sync,  rt_threadgroup_static, rt_fail,
                                        rt_fail_argument, rt_unbound_storage, rt_access};
    return &api;
}

/* ---- faults of kernel code and preemption (signals.c installs the handlers) ---- */

/* The signals.c hook: a fault of kernel code, or the watchdog's preemption, on this thread's
 * running fiber jumps back to its worker; everything else is passed on. */
int kernel_signal(int sig, siginfo_t *info, void *context) {
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

/* ---- running threadgroups ---- */

worker *worker_new(void) {
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
        add(&m,
            "stack overflow: the thread's %zu KiB fiber stack is exhausted (deep recursion or large local "
            "arrays)",
            (size_t)MCPU_FIBER_STACK_BYTES / 1024); /* at least; fiber.c staggers the tops */
    else if (general_protection_fault(sig, w->fault_code))
        add(&m, "invalid memory access (SIGSEGV, a general protection fault), e.g. a wild pointer (an address "
                "outside the address space)");
    else if (sig == SIGSEGV || sig == SIGBUS)
        add(&m, "invalid memory access (%s) at address %p, e.g. an out-of-bounds index into a buffer",
            sig == SIGSEGV ? "SIGSEGV" : "SIGBUS", w->fault_address);
    else if (sig == SIGFPE) add(&m, "arithmetic fault (SIGFPE)");
    else add(&m, "illegal instruction (SIGILL), e.g. a trap the compiler put where behaviour is undefined");
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
    if (sigsetjmp(w->escape, 0) == 0)                    /* a fault or a stop in kernel code comes back here */
        mcpu_fiber_switch(&w->home, &w->running->fiber); /* back when all threads exited or one failed */
    else if (w->fault_signal) report_fault(w);
    w->in_kernel = 0;
    w->running = NULL;
}

void work(worker *w, job *j) {
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
