/* Fibers: cooperative execution contexts that run on one OS thread and switch only when told to.
 * The runtime runs every GPU thread of a threadgroup as one fiber. A fiber never migrates to
 * another OS thread. */
#ifndef MCPU_FIBER_H
#define MCPU_FIBER_H

#include <stddef.h>

/* -DMCPU_FIBER_UCONTEXT forces the portable fallback (to test it, or for tools that need it). */
#if ((defined(__x86_64__) && !defined(_WIN32)) || defined(__aarch64__)) && !defined(MCPU_FIBER_UCONTEXT)
#define MCPU_FIBER_ASM 1
#else
#include <ucontext.h>
#endif

#ifdef __cplusplus
extern "C" {
#endif

enum { MCPU_FIBER_STACK_BYTES = 256 * 1024 };

typedef struct mcpu_fiber {
#ifdef MCPU_FIBER_ASM
    void *sp; /* saved stack pointer; the callee-saved registers sit on the stack below it */
#else
    ucontext_t uc;
#endif
    void *stack;       /* usable stack (above the guard page); NULL for an OS thread's own stack */
    size_t stack_size;
    void (*entry)(void *);
    void *arg;
    void *asan_fake_stack; /* AddressSanitizer bookkeeping, unused otherwise */
} mcpu_fiber;

/* Maps a stack of `bytes` (rounded up to pages) plus a guard page below it. Returns 0 on success. */
int mcpu_fiber_stack_alloc(mcpu_fiber *f, size_t bytes);
void mcpu_fiber_stack_free(mcpu_fiber *f);

/* Prepares f (with a stack) to run entry(arg) at the next switch into it. entry must never return:
 * it ends by switching away for the last time. Re-initialising a fiber reuses its stack. */
void mcpu_fiber_init(mcpu_fiber *f, void (*entry)(void *), void *arg);

/* Saves the running context into `from` and resumes `to`. `from` may be a zero-initialised
 * mcpu_fiber standing for the OS thread's own stack. */
void mcpu_fiber_switch(mcpu_fiber *from, mcpu_fiber *to);

#ifdef __cplusplus
}
#endif
#endif
