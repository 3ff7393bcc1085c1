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

enum { MCPU_FIBER_STACK_BYTES = 256 * 1024, MCPU_FIBER_GUARD_BYTES = 64 * 1024 };

typedef struct mcpu_fiber {
#ifdef MCPU_FIBER_ASM
    void *sp; /* saved stack pointer; the callee-saved registers sit on the stack below it */
#else
    ucontext_t uc;
#endif
    void *stack; /* usable stack (above its guard); NULL for an OS thread's own stack */
    size_t stack_size;
    void (*entry)(void *);
    void *arg;
    void *asan_fake_stack; /* AddressSanitizer bookkeeping, unused otherwise */
} mcpu_fiber;

/* The fiber stacks of one worker: one reserved mapping of `count` slots, each an inaccessible
 * guard below a stack, so an overflow (with the kernels' stack-clash probes: a frame of any size)
 * faults in the guard instead of landing in a neighbour's stack. Only the slots taken are made
 * accessible, and only touched pages take memory. Slots lie a multiple of the page apart, so
 * their tops, where every fiber's hot frames are, would all fall into the same few cache sets:
 * each stack's top is staggered by its slot (fiber.c), above the stack_bytes every one has. */
typedef struct mcpu_stack_region {
    char *base;
    size_t count, stack_bytes, guard_bytes; /* both multiples of the page size */
} mcpu_stack_region;

/* Reserves the region (no memory yet). Returns 0 on success. */
int mcpu_stack_region_reserve(mcpu_stack_region *r, size_t count, size_t stack_bytes, size_t guard_bytes);
/* Makes slot i's stack accessible and gives it to f. Returns 0 on success. */
int mcpu_stack_region_take(mcpu_stack_region *r, size_t i, mcpu_fiber *f);
/* Returns every page of the region to the OS (stacks keep their addresses; contents are lost). */
void mcpu_stack_region_trim(mcpu_stack_region *r);
/* The slot whose guard holds addr, or -1. */
long mcpu_stack_region_guard_slot(const mcpu_stack_region *r, const void *addr);

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
