/* The runtime's pool: workers, helper threads that join dispatches, the watchdog, the dispatch
 * time limit, and mcpu_run, which runs one launch on them. */
#if !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* sysconf(_SC_NPROCESSORS_ONLN), MAP_ANONYMOUS under -std=c11 */
#endif
#include "runtime.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static _Atomic uint64_t checked_dispatches;
uint64_t mcpu_checked_dispatches(void) { return atomic_load(&checked_dispatches); }

/* ---- the pool: workers, helper threads that join dispatches, the watchdog ---- */

/* Workers: twice the cores, at least MIN_WORKERS, but their fiber stacks (two mappings each: guard
 * and stack) may take at most half of vm.max_map_count (a default of 16 where it is not known). */
enum { TRIM_AFTER_IDLE_SECONDS = 1, MIN_WORKERS = 4, DEFAULT_MAX_WORKERS = 16 };

static struct {
    pthread_once_t once;
    pthread_key_t key; /* a thread's signal stack, freed when the thread exits */
    pthread_mutex_t mu;
    pthread_cond_t work, idle;         /* a job wants helpers; a job's last helper left */
    pthread_cond_t worker_free, watch; /* a worker was returned; the watchdog has a job to watch */
    job *jobs;                         /* dispatches open to helpers */
    job *active;                       /* every running dispatch */
    worker *workers;                   /* every worker */
    uint32_t n_workers, max_workers;
    uint32_t n_helpers; /* helper threads started (0 again after fork) */
    int32_t watchdog_started, watchdog_waiting;
} pool = {PTHREAD_ONCE_INIT,
          0,
          PTHREAD_MUTEX_INITIALIZER,
          PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER,
          NULL,
          NULL,
          NULL,
          0,
          0,
          0,
          0,
          0};

enum { SIGNAL_STACK_BYTES = 64 * 1024 };
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
    else pthread_setspecific(pool.key, p);
}

static void signal_stack_free(void *stack) {
    stack_t cur, off = {.ss_sp = NULL, .ss_flags = SS_DISABLE, .ss_size = 0};
    if (!sigaltstack(NULL, &cur) && cur.ss_sp == stack && !(cur.ss_flags & SS_ONSTACK) && !sigaltstack(&off, NULL))
        munmap(stack, SIGNAL_STACK_BYTES);
}

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
        set_thread_worker(w);
        work(w, j);
        set_thread_worker(NULL);
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
    job j = {.fn = fn,
             .launch = launch,
             .n_groups = (uint64_t)g[0] * g[1] * g[2],
             .st = st,
             .checked = checked,
             .lockstep = (mode & MCPU_LOCKSTEP) != 0,
             .guard = checked ? &guard : NULL};
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
    set_thread_worker(w);
    work(w, &j);
    set_thread_worker(NULL);
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
