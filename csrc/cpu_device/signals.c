/* The device's signal handlers: Ctrl-C (SIGINT) is counted, so that dispatches and compiler runs
 * stop; faults of kernel code and the watchdog's preemption (SIGURG) go to the runtime's hook
 * (runtime.c); everything else reaches the handler installed before, as the OS would have run it. */
#if !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* SA_ONSTACK, siginfo_t under -std=c11 */
#endif
#include "device.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>

static const int handled_signals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGINT, SIGURG};
enum { N_HANDLED = sizeof handled_signals / sizeof handled_signals[0] };
static struct sigaction previous[N_HANDLED]; /* what each handler passes other signals on to */
static _Atomic uint64_t interrupts;          /* SIGINTs seen */

static int handled_index(int sig) {
    for (int i = 0; i < N_HANDLED; i++)
        if (handled_signals[i] == sig) return i;
    return 0;
}

/* The handler that was installed before ours, as the OS would have run it. */
static void pass_on(int sig, siginfo_t *info, void *context) {
    const struct sigaction *old = &previous[handled_index(sig)];
    if (old->sa_flags & SA_SIGINFO) {
        if (old->sa_sigaction) old->sa_sigaction(sig, info, context);
    } else if (old->sa_handler == SIG_DFL) {
        if (sig == SIGURG) return; /* ignored by default */
        signal(sig, SIG_DFL);      /* a fault recurs on return and kills as it would have */
        if (sig == SIGINT || info->si_code <= 0) raise(sig);
    } else if (old->sa_handler != SIG_IGN) {
        old->sa_handler(sig);
    }
}
static _Atomic(mcpu_signal_hook) hook;

void mcpu_signals_set_hook(mcpu_signal_hook h) { atomic_store(&hook, h); }

static void on_signal(int sig, siginfo_t *info, void *context) {
    int saved_errno = errno;
    mcpu_signal_hook h = atomic_load(&hook);
    if (sig == SIGINT) {
        atomic_fetch_add(&interrupts, 1);
    } else if (h && h(sig, info, context)) {
        errno = saved_errno;
        return;
    }
    pass_on(sig, info, context);
    errno = saved_errno;
}

/* Installs on_signal where it is not (again, if someone replaced it), passing on to what was
 * there. An ignored SIGINT stays ignored. Once (mcpu_signals_ensure), then again by the runtime's
 * watchdog. */
void mcpu_signals_reinstall(void) {
    for (int i = 0; i < N_HANDLED; i++) {
        struct sigaction cur, sa;
        if (sigaction(handled_signals[i], NULL, &cur)) continue;
        if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_signal) continue;
        if (handled_signals[i] == SIGINT && !(cur.sa_flags & SA_SIGINFO) && cur.sa_handler == SIG_IGN) continue;
        previous[i] = cur;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_signal;
        sigemptyset(&sa.sa_mask);
        /* SA_NODEFER: siglongjmp leaves no signal blocked. SIGINT keeps the previous handler's
         * SA_RESTART choice (Python relies on interrupted system calls). */
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER |
                      (handled_signals[i] == SIGINT ? cur.sa_flags & SA_RESTART : SA_RESTART);
        sigaction(handled_signals[i], &sa, NULL);
    }
}

static pthread_once_t signals_once = PTHREAD_ONCE_INIT;

void mcpu_signals_ensure(void) { pthread_once(&signals_once, mcpu_signals_reinstall); }

uint64_t mcpu_interrupts(void) { return atomic_load(&interrupts); }
