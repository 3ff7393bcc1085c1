/* The CPU Metal device's runtime: runs a dispatch with Metal's execution model.
 *
 * Threadgroups are taken from an atomic counter by the calling thread and by helper threads of a
 * lazily created pool. Each OS thread (a "worker") runs one threadgroup at a time, every GPU
 * thread of it as a fiber. A fiber runs until it reaches a sync point (api->sync) or returns; then
 * the worker switches straight to the next runnable fiber of a ready queue. The last thread to
 * arrive at a barrier releases the others (queues them) and carries on without a switch, so a
 * barrier costs one fiber switch per thread. */
#if !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* posix_memalign, sysconf(_SC_NPROCESSORS_ONLN), pthread_atfork under -std=c11 */
#endif
#include "cpu_device.h"
#include "fiber.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum {
    MAX_THREADS = MSL_MAX_THREADS_PER_THREADGROUP,
    MAX_SIMDGROUPS = MSL_MAX_THREADS_PER_THREADGROUP / MSL_SIMD_WIDTH,
    MAX_STATIC_SITES = 64,
    GARBAGE = 0xFF /* uninitialised threadgroup memory reads as NaN (float, half) or -1 */
};

/* One dispatch. */
typedef struct job {
    mcpu_kernel_fn fn;
    const msl_launch *launch;
    uint64_t n_groups;
    _Atomic uint64_t next_group;
    atomic_int failed; /* the first failure writes st; everyone then stops taking threadgroups */
    fa_status *st;
    uint32_t helpers_wanted, helpers_joined, helpers_active; /* under pool.mu */
    struct job *next;                                        /* pool.jobs list */
} job;

typedef enum { READY, WAITING, DONE } gstate;

/* One GPU thread. */
typedef struct gthread {
    msl_thread t; /* first member: the api hands kernels &t */
    struct worker *w;
    mcpu_fiber fiber;
    gstate state;
    /* where the thread waits, while WAITING */
    int32_t kind;
    uint32_t line;
    const char *what, *file;
} gthread;

/* A SIMD-group or the threadgroup, as a barrier scope. */
typedef struct scope {
    uint32_t arrived, live;
    const gthread *first; /* the first arrival: everyone else must wait at the same point */
} scope;

/* Per OS thread state, kept for the thread's life so fibers, stacks and memory are reused. */
typedef struct worker {
    mcpu_fiber home; /* the OS thread's own stack: threadgroups start and end here */
    job *job;
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
    } statics[MAX_STATIC_SITES];
    uint32_t n_statics;
    msl_simd_exchange xchg[MAX_SIMDGROUPS];
    gthread threads[MAX_THREADS];
} worker;

static _Thread_local worker *tls_worker;

/* ---- failures ---- */

static void job_fail(job *j, int32_t code, const char *message) {
    if (atomic_exchange(&j->failed, 1) == 0) fa_fail(j->st, code, "%s", message);
}

typedef struct text {
    char buf[FA_STATUS_MESSAGE_BYTES];
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

static int same_string(const char *a, const char *b) { return a == b || strcmp(a, b) == 0; }

static int same_point(const gthread *a, const gthread *b) {
    return a->line == b->line && a->kind == b->kind && same_string(a->file, b->file) &&
           same_string(a->what, b->what);
}

static int same_place(const gthread *a, const gthread *b) {
    return a->state == b->state && (a->state != WAITING || same_point(a, b));
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

static void make_ready(worker *w, gthread *g) {
    g->state = READY;
    w->ready[(w->ready_head + w->ready_count++) % MAX_THREADS] = g;
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
        /* Nothing can run. Every other stall is reported where it arises, so this is a SIMD-group
         * waiting at a collective for lanes that wait at threadgroup_barrier. */
        uint32_t s = 0;
        while (s + 1 < w->n_simdgroups && w->simd[s].arrived == 0) s++;
        group_fail(w, FA_ERR_RUNTIME, -1,
                   "deadlock: SIMD collective in divergent control flow (SIMD-group %u)", s);
    }
    gthread *next = take_ready(w);
    w->running = next;
    mcpu_fiber_switch(&g->fiber, &next->fiber);
}

/* Queues every other live member of a completed scope. */
static void release(worker *w, scope *s, const gthread *self) {
    s->arrived = 0;
    if (s == &w->group) {
        for (uint32_t i = 0; i < w->n_threads; i++)
            if (&w->threads[i] != self) make_ready(w, &w->threads[i]);
        return;
    }
    uint32_t sg = (uint32_t)(s - w->simd);
    w->xchg[sg].sync_lanes = w->xchg[sg].live_lanes;
    for (uint32_t lanes = w->xchg[sg].live_lanes; lanes; lanes &= lanes - 1) {
        gthread *g = &w->threads[sg * MSL_SIMD_WIDTH + (uint32_t)__builtin_ctz(lanes)];
        if (g != self) make_ready(w, g);
    }
}

static void rt_sync(msl_thread *t, int32_t kind, const char *what, const char *file, uint32_t line) {
    gthread *g = (gthread *)t;
    worker *w = g->w;
    g->state = WAITING;
    g->kind = kind, g->what = what, g->file = file, g->line = line;
    int tg_scope = kind == MSL_SYNC_THREADGROUP_BARRIER;
    scope *s = tg_scope ? &w->group : &w->simd[t->simdgroup_index_in_threadgroup];
    if (s->arrived == 0) {
        s->first = g;
    } else if (!same_point(s->first, g)) {
        if (tg_scope) group_fail(w, FA_ERR_RUNTIME, -1, "threadgroup_barrier in divergent control flow");
        group_fail(w, FA_ERR_RUNTIME, (int)t->simdgroup_index_in_threadgroup,
                   "SIMD collective in divergent control flow");
    }
    if (tg_scope && w->n_done)
        group_fail(w, FA_ERR_RUNTIME, -1, "threadgroup_barrier reached by only some threads");
    if (++s->arrived < s->live) {
        run_next(w, g);
        return;
    }
    g->state = READY;
    release(w, s, g);
}

/* What every fiber runs: the kernel for one GPU thread, then leave for good. */
static void thread_main(void *arg) {
    gthread *g = arg;
    worker *w = g->w;
    w->job->fn();
    g->state = DONE;
    w->n_done++;
    uint32_t sg = g->t.simdgroup_index_in_threadgroup;
    scope *s = &w->simd[sg];
    s->live--;
    w->xchg[sg].live_lanes &= ~(1u << g->t.thread_index_in_simdgroup);
    if (w->group.arrived)
        group_fail(w, FA_ERR_RUNTIME, -1, "threadgroup_barrier reached by only some threads");
    if (s->arrived && s->arrived == s->live) release(w, s, g); /* the exited lane was the last */
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
        group_fail(w, FA_ERR_RUNTIME, -2, "more than %d kernel-scope threadgroup arrays",
                   MAX_STATIC_SITES);
    uintptr_t base = (uintptr_t)w->tg_memory, a = align > 1 ? (uintptr_t)align : 1;
    uint64_t offset = ((base + w->tg_used + a - 1) & ~(a - 1)) - base;
    if (offset + size > MCPU_MAX_THREADGROUP_MEMORY)
        group_fail(w, FA_ERR_VALUE, -2,
                   "threadgroup memory exceeds %d bytes: %llu bytes of [[threadgroup(n)]] arguments"
                   " plus %llu bytes of kernel-scope threadgroup arrays (with alignment)",
                   MCPU_MAX_THREADGROUP_MEMORY, (unsigned long long)w->tg_args_bytes,
                   (unsigned long long)(offset + size - w->tg_args_bytes));
    void *p = w->tg_memory + offset;
    memset(p, GARBAGE, size);
    w->tg_used = offset + size;
    w->statics[w->n_statics].key = key;
    w->statics[w->n_statics++].ptr = p;
    return p;
}

static void rt_fail(msl_thread *t, const char *message, const char *file, uint32_t line) {
    group_fail(((gthread *)t)->w, FA_ERR_RUNTIME, -2, "%s (%s:%u, thread %u)", message, file, line,
               t->thread_index_in_threadgroup);
}

static void rt_fail_argument(msl_thread *t, const char *message, const char *file, uint32_t line) {
    group_fail(((gthread *)t)->w, FA_ERR_VALUE, -2, "%s (%s:%u)", message, file, line);
}

const msl_runtime_api *mcpu_runtime_api(void) {
    static const msl_runtime_api api = {MSL_ABI_VERSION, rt_current, rt_sync, rt_threadgroup_static,
                                        rt_fail, rt_fail_argument};
    return &api;
}

/* ---- running threadgroups ---- */

static worker *worker_new(void) {
    worker *w = NULL;
    if (posix_memalign((void **)&w, 64, sizeof *w) != 0) return NULL;
    memset(w, 0, sizeof *w);
    if (posix_memalign((void **)&w->tg_memory, 4096, MCPU_MAX_THREADGROUP_MEMORY) != 0) {
        free(w);
        return NULL;
    }
    return w;
}

static void worker_free(void *p) {
    worker *w = p;
    for (uint32_t i = 0; i < MAX_THREADS; i++) mcpu_fiber_stack_free(&w->threads[i].fiber);
    free(w->tg_memory);
    free(w);
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
        w->tg_args_bytes += (l->threadgroup_arg_lengths[a] + 15) & ~(uint64_t)15;
    }
    for (uint32_t i = 0; i < w->n_threads; i++) {
        gthread *g = &w->threads[i];
        msl_thread *t = &g->t;
        if (!g->fiber.stack && mcpu_fiber_stack_alloc(&g->fiber, MCPU_FIBER_STACK_BYTES) != 0)
            return -1;
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

static void run_threadgroup(worker *w, uint64_t index) {
    const msl_launch *l = w->job->launch;
    const uint32_t *tgpg = l->threadgroups_per_grid, *tptg = l->threads_per_threadgroup;
    uint32_t *pos = w->tg.threadgroup_position;
    pos[0] = (uint32_t)(index % tgpg[0]);
    pos[1] = (uint32_t)(index / tgpg[0] % tgpg[1]);
    pos[2] = (uint32_t)(index / tgpg[0] / tgpg[1]);
    memset(w->tg_memory, GARBAGE, w->tg_args_bytes); /* fresh garbage: no leftovers to rely on */
    w->tg_used = w->tg_args_bytes;
    w->n_statics = 0;
    w->n_done = 0;
    w->ready_head = w->ready_count = 0;
    w->group = (scope){0, w->n_threads, NULL};
    for (uint32_t s = 0; s < w->n_simdgroups; s++) {
        uint32_t live = w->n_threads - s * MSL_SIMD_WIDTH;
        live = live < MSL_SIMD_WIDTH ? live : MSL_SIMD_WIDTH;
        w->simd[s] = (scope){0, live, NULL};
        w->xchg[s].live_lanes = live == 32 ? ~0u : (1u << live) - 1; /* absent lanes never live */
    }
    for (uint32_t i = 0; i < w->n_threads; i++) {
        gthread *g = &w->threads[i];
        for (int d = 0; d < 3; d++) {
            g->t.threadgroup_position_in_grid[d] = pos[d];
            g->t.thread_position_in_grid[d] = pos[d] * tptg[d] + g->t.thread_position_in_threadgroup[d];
        }
        g->t.xchg_parity = 0;
        mcpu_fiber_init(&g->fiber, thread_main, g);
        make_ready(w, g);
    }
    gthread *first = take_ready(w);
    w->running = first;
    mcpu_fiber_switch(&w->home, &first->fiber); /* back when all threads exited or one failed */
    w->running = NULL;
}

static void work(worker *w, job *j) {
    if (worker_prepare(w, j) != 0) return; /* no stacks for this worker: the others do the work */
    while (!atomic_load_explicit(&j->failed, memory_order_relaxed)) {
        uint64_t index = atomic_fetch_add_explicit(&j->next_group, 1, memory_order_relaxed);
        if (index >= j->n_groups) break;
        run_threadgroup(w, index);
    }
}

/* ---- the pool: helper threads that join dispatches ---- */

static struct {
    pthread_once_t once;
    pthread_key_t key; /* frees a thread's worker when the thread exits */
    pthread_mutex_t mu;
    pthread_cond_t work, idle; /* a job wants helpers; a job's last helper left */
    job *jobs;                 /* dispatches open to helpers */
    uint32_t n_helpers;        /* helper threads started (0 again after fork) */
} pool = {PTHREAD_ONCE_INIT, 0, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER, NULL, 0};

static void pool_after_fork_in_child(void) { /* only the forking thread exists in the child */
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.work, NULL);
    pthread_cond_init(&pool.idle, NULL);
    pool.jobs = NULL;
    pool.n_helpers = 0;
}

static void pool_once(void) {
    pthread_key_create(&pool.key, worker_free);
    pthread_atfork(NULL, NULL, pool_after_fork_in_child);
}

static worker *this_worker(void) {
    if (!tls_worker && (tls_worker = worker_new()) != NULL) pthread_setspecific(pool.key, tls_worker);
    return tls_worker;
}

static job *open_job(void) {
    for (job *j = pool.jobs; j; j = j->next)
        if (j->helpers_joined < j->helpers_wanted && !atomic_load(&j->failed) &&
            atomic_load(&j->next_group) < j->n_groups)
            return j;
    return NULL;
}

static void *helper_main(void *unused) {
    worker *w = this_worker();
    if (!w) return NULL;
    pthread_mutex_lock(&pool.mu);
    for (;;) {
        job *j;
        while (!(j = open_job())) pthread_cond_wait(&pool.work, &pool.mu);
        j->helpers_joined++, j->helpers_active++;
        pthread_mutex_unlock(&pool.mu);
        work(w, j);
        pthread_mutex_lock(&pool.mu);
        if (--j->helpers_active == 0) pthread_cond_broadcast(&pool.idle);
    }
    return NULL;
}

static void start_helpers(void) { /* under pool.mu */
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    for (long i = pool.n_helpers; i + 1 < cpus; i++) { /* the calling thread is the last worker */
        pthread_t th;
        if (pthread_create(&th, NULL, helper_main, NULL) != 0) break;
        pthread_detach(th);
        pool.n_helpers++;
    }
}

int32_t mcpu_run(mcpu_kernel_fn fn, const msl_launch *launch, fa_status *st) {
    const uint32_t *g = launch->threadgroups_per_grid;
    job j = {.fn = fn, .launch = launch, .n_groups = (uint64_t)g[0] * g[1] * g[2], .st = st};
    atomic_init(&j.next_group, 0);
    atomic_init(&j.failed, 0);
    pthread_once(&pool.once, pool_once);
    worker *w = this_worker();
    if (!w) return fa_fail(st, FA_ERR_RUNTIME, "kernel '%s': out of memory", launch->kernel_name);
    if (j.n_groups > 1) {
        pthread_mutex_lock(&pool.mu);
        if (pool.n_helpers == 0) start_helpers();
        j.helpers_wanted = j.n_groups - 1 < pool.n_helpers ? (uint32_t)j.n_groups - 1 : pool.n_helpers;
        j.next = pool.jobs;
        pool.jobs = &j;
        pthread_cond_broadcast(&pool.work);
        pthread_mutex_unlock(&pool.mu);
    }
    work(w, &j);
    if (j.n_groups > 1) {
        pthread_mutex_lock(&pool.mu);
        job **p = &pool.jobs;
        while (*p != &j) p = &(*p)->next;
        *p = j.next;
        while (j.helpers_active) pthread_cond_wait(&pool.idle, &pool.mu);
        pthread_mutex_unlock(&pool.mu);
    }
    if (atomic_load(&j.next_group) < j.n_groups) /* nobody could take them */
        job_fail(&j, FA_ERR_RUNTIME, "cannot map fiber stacks (out of memory or vm.max_map_count)");
    return atomic_load(&j.failed) ? st->code : FA_OK;
}

/* ---- validation ---- */

int32_t mcpu_dispatch(const mcpu_library *lib, const mcpu_dispatch_args *a, fa_status *st) {
    if (!lib || !a || !a->kernel)
        return fa_fail(st, FA_ERR_VALUE, "mcpu_dispatch: library, arguments and kernel name are required");
    mcpu_kernel_fn fn = mcpu_library_kernel(lib, a->kernel);
    if (!fn) {
        text m = {.len = 0};
        add(&m, "kernel '%s' is not in the library; it has:", a->kernel);
        for (const char *const *k = mcpu_library_kernels(lib); k && *k; k++) add(&m, " %s", *k);
        return fa_fail(st, FA_ERR_VALUE, "%s", m.buf);
    }
    static const char axis[3] = {'x', 'y', 'z'};
    uint64_t threads = 1, groups = 1;
    for (int d = 0; d < 3; d++) {
        if (a->grid[d] == 0 || a->threadgroup[d] == 0)
            return fa_fail(st, FA_ERR_VALUE, "kernel '%s': %s.%c is 0; every dimension must be >= 1",
                           a->kernel, a->grid[d] == 0 ? "grid" : "threadgroup", axis[d]);
        if ((uint64_t)a->grid[d] * a->threadgroup[d] > UINT32_MAX)
            return fa_fail(st, FA_ERR_VALUE,
                           "kernel '%s': grid.%c * threadgroup.%c = %u * %u threads do not fit a uint",
                           a->kernel, axis[d], axis[d], a->grid[d], a->threadgroup[d]);
        threads *= a->threadgroup[d];
        if (__builtin_mul_overflow(groups, a->grid[d], &groups))
            return fa_fail(st, FA_ERR_VALUE, "kernel '%s': grid %u x %u x %u has too many threadgroups",
                           a->kernel, a->grid[0], a->grid[1], a->grid[2]);
    }
    if (threads > MSL_MAX_THREADS_PER_THREADGROUP)
        return fa_fail(st, FA_ERR_VALUE,
                       "kernel '%s': threadgroup %u x %u x %u = %llu threads, more than the %u allowed",
                       a->kernel, a->threadgroup[0], a->threadgroup[1], a->threadgroup[2],
                       (unsigned long long)threads, MSL_MAX_THREADS_PER_THREADGROUP);
    if (a->n_buffers > MSL_MAX_BUFFERS || (a->n_buffers && !a->buffers))
        return fa_fail(st, FA_ERR_VALUE, "kernel '%s': n_buffers = %u (at most %u, with buffers set)",
                       a->kernel, a->n_buffers, MSL_MAX_BUFFERS);
    if (a->n_threadgroup_args > MSL_MAX_THREADGROUP_ARGS || (a->n_threadgroup_args && !a->threadgroup_arg_lengths))
        return fa_fail(st, FA_ERR_VALUE,
                       "kernel '%s': n_threadgroup_args = %u (at most %u, with threadgroup_arg_lengths set)",
                       a->kernel, a->n_threadgroup_args, MSL_MAX_THREADGROUP_ARGS);
    if (a->n_constants > MSL_MAX_FUNCTION_CONSTANTS || (a->n_constants && !a->constants))
        return fa_fail(st, FA_ERR_VALUE, "kernel '%s': n_constants = %u (at most %u, with constants set)",
                       a->kernel, a->n_constants, MSL_MAX_FUNCTION_CONSTANTS);
    uint64_t tg_bytes = 0; /* a multiple of 16, as each length is rounded up to 16 */
    for (uint32_t i = 0; i < a->n_threadgroup_args; i++) {
        uint64_t len = a->threadgroup_arg_lengths[i];
        if (len > MCPU_MAX_THREADGROUP_MEMORY - tg_bytes)
            return fa_fail(st, FA_ERR_VALUE,
                           "kernel '%s': threadgroup_arg_lengths[%u] = %llu takes threadgroup memory past "
                           "%d bytes (%llu bytes before it, lengths rounded up to 16)",
                           a->kernel, i, (unsigned long long)len, MCPU_MAX_THREADGROUP_MEMORY,
                           (unsigned long long)tg_bytes);
        tg_bytes += (len + 15) & ~(uint64_t)15;
    }
    msl_launch launch = {a->kernel, a->buffers, a->n_buffers, a->n_threadgroup_args,
                         a->threadgroup_arg_lengths, a->constants, a->n_constants,
                         {a->grid[0], a->grid[1], a->grid[2]},
                         {a->threadgroup[0], a->threadgroup[1], a->threadgroup[2]}};
    return mcpu_run(fn, &launch, st);
}
