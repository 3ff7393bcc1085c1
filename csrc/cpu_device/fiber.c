/* Fibers for the CPU Metal device: a hand-written stack switch on x86-64 (System V) and aarch64,
 * ucontext elsewhere (swapcontext makes a syscall per switch: about 25 times slower). */
#if !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* MAP_ANONYMOUS, MAP_STACK, pthread_getattr_np */
#endif
#include "fiber.h"

#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MCPU_FIBER_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define MCPU_FIBER_ASAN 1
#endif

#ifdef MCPU_FIBER_ASAN
/* ASan keeps its own idea of the current stack: tell it about every switch, or it reports
 * false stack overflows and stale poison on reused stacks. */
#include <pthread.h>
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>

static void asan_before_switch(mcpu_fiber *from, const mcpu_fiber *to) {
    const void *bottom = to->stack;
    size_t size = to->stack_size;
    if (!bottom) { /* the OS thread's own stack */
#if defined(__APPLE__)
        size = pthread_get_stacksize_np(pthread_self());
        bottom = (char *)pthread_get_stackaddr_np(pthread_self()) - size;
#else
        pthread_attr_t attr;
        void *addr = NULL;
        pthread_getattr_np(pthread_self(), &attr);
        pthread_attr_getstack(&attr, &addr, &size);
        pthread_attr_destroy(&attr);
        bottom = addr;
#endif
    }
    __sanitizer_start_switch_fiber(&from->asan_fake_stack, bottom, size);
}
#define ASAN_BEFORE_SWITCH(from, to) asan_before_switch(from, to)
#define ASAN_AFTER_SWITCH(fake) __sanitizer_finish_switch_fiber(fake, NULL, NULL)
#define ASAN_FRESH_STACK(f) __asan_unpoison_memory_region((f)->stack, (f)->stack_size)
#else
#define ASAN_BEFORE_SWITCH(from, to) ((void)0)
#define ASAN_AFTER_SWITCH(fake) ((void)0)
#define ASAN_FRESH_STACK(f) ((void)0)
#endif

/* First code a fresh fiber runs (reached from the trampoline below, or makecontext). */
static void fiber_boot(mcpu_fiber *f) {
    ASAN_AFTER_SWITCH(NULL);
    f->entry(f->arg);
    __builtin_trap(); /* entries end by switching away for good */
}

#ifdef MCPU_FIBER_ASM
/* mcpu_fiber_swap(void **save_sp, void *new_sp) pushes the callee-saved registers, stores the
 * stack pointer in *save_sp, loads new_sp and pops the registers saved there. A fresh fiber's
 * stack holds: its mcpu_fiber in the first register slot, fiber_boot in the second, and the
 * trampoline as return address, which calls fiber_boot(f).
 * Not saved: MXCSR and the x87 control word (x86-64), FPCR (aarch64). The ABIs make their control
 * bits callee-saved, but every fiber of a worker runs the same compiled kernel code, which never
 * changes rounding or exception modes, so all fibers share one floating-point environment. */
#if defined(__APPLE__)
#define FIBER_FUNC(name) ".globl _" #name "\n.private_extern _" #name "\n.p2align 4\n_" #name ":\n"
#else
#define FIBER_FUNC(name) ".globl " #name "\n.hidden " #name "\n.type " #name ",@function\n.p2align 4\n" #name ":\n"
#endif

void mcpu_fiber_swap(void **save_sp, void *new_sp);
void mcpu_fiber_trampoline(void);

#if defined(__x86_64__)
/* r15 r14 r13 r12 rbx rbp, the return address, 2 words of padding: after the ret, rsp (the stack
 * top - 16) is 16-byte aligned, as at a call instruction */
enum { FRAME_WORDS = 9 };
// clang-format off
__asm__(".text\n" FIBER_FUNC(mcpu_fiber_swap)
        "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
        "  movq %rsp, (%rdi)\n"
        "  movq %rsi, %rsp\n"
        "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
        "  ret\n"
        FIBER_FUNC(mcpu_fiber_trampoline)
        "  .cfi_startproc\n  .cfi_undefined rip\n" /* backtraces end here */
        "  movq %r13, %rdi\n"
        "  callq *%r12\n"
        "  ud2\n"
        "  .cfi_endproc\n");
// clang-format on

static void stack_frame(uintptr_t *sp, mcpu_fiber *f) {
    sp[2] = (uintptr_t)f;                     /* r13 */
    sp[3] = (uintptr_t)fiber_boot;            /* r12 */
    sp[6] = (uintptr_t)mcpu_fiber_trampoline; /* return address */
}
#else /* aarch64 */
enum { FRAME_WORDS = 20 }; /* x19-x28, x29 (fp), x30 (lr), d8-d15 */
// clang-format off
__asm__(".text\n" FIBER_FUNC(mcpu_fiber_swap)
        "  sub sp, sp, #160\n"
        "  stp x19, x20, [sp, #0]\n  stp x21, x22, [sp, #16]\n  stp x23, x24, [sp, #32]\n"
        "  stp x25, x26, [sp, #48]\n  stp x27, x28, [sp, #64]\n  stp x29, x30, [sp, #80]\n"
        "  stp d8, d9, [sp, #96]\n  stp d10, d11, [sp, #112]\n"
        "  stp d12, d13, [sp, #128]\n  stp d14, d15, [sp, #144]\n"
        "  mov x2, sp\n"
        "  str x2, [x0]\n"
        "  mov sp, x1\n"
        "  ldp x19, x20, [sp, #0]\n  ldp x21, x22, [sp, #16]\n  ldp x23, x24, [sp, #32]\n"
        "  ldp x25, x26, [sp, #48]\n  ldp x27, x28, [sp, #64]\n  ldp x29, x30, [sp, #80]\n"
        "  ldp d8, d9, [sp, #96]\n  ldp d10, d11, [sp, #112]\n"
        "  ldp d12, d13, [sp, #128]\n  ldp d14, d15, [sp, #144]\n"
        "  add sp, sp, #160\n"
        "  ret\n"
        FIBER_FUNC(mcpu_fiber_trampoline)
        "  .cfi_startproc\n  .cfi_undefined x30\n"
        "  mov x0, x19\n"
        "  blr x20\n"
        "  brk #0\n"
        "  .cfi_endproc\n");
// clang-format on

static void stack_frame(uintptr_t *sp, mcpu_fiber *f) {
    sp[0] = (uintptr_t)f;                      /* x19 */
    sp[1] = (uintptr_t)fiber_boot;             /* x20 */
    sp[11] = (uintptr_t)mcpu_fiber_trampoline; /* x30 */
}
#endif

void mcpu_fiber_init(mcpu_fiber *f, void (*entry)(void *), void *arg) {
    f->entry = entry;
    f->arg = arg;
    ASAN_FRESH_STACK(f);
    uintptr_t top = ((uintptr_t)f->stack + f->stack_size) & ~(uintptr_t)15;
    uintptr_t *sp = (uintptr_t *)top - FRAME_WORDS;
    for (int i = 0; i < FRAME_WORDS; i++) sp[i] = 0; /* zero frame pointer: backtraces stop */
    stack_frame(sp, f);
    f->sp = sp;
}

void mcpu_fiber_switch(mcpu_fiber *from, mcpu_fiber *to) {
    ASAN_BEFORE_SWITCH(from, to);
    mcpu_fiber_swap(&from->sp, to->sp);
    ASAN_AFTER_SWITCH(from->asan_fake_stack);
}

#else /* portable fallback */
static void fiber_boot_ucontext(unsigned hi, unsigned lo) {
    fiber_boot((mcpu_fiber *)(((uintptr_t)hi << 16 << 16) | lo)); /* makecontext passes ints */
}

void mcpu_fiber_init(mcpu_fiber *f, void (*entry)(void *), void *arg) {
    f->entry = entry;
    f->arg = arg;
    ASAN_FRESH_STACK(f);
    getcontext(&f->uc);
    f->uc.uc_stack.ss_sp = f->stack;
    f->uc.uc_stack.ss_size = f->stack_size;
    f->uc.uc_link = NULL;
    uintptr_t p = (uintptr_t)f;
    makecontext(&f->uc, (void (*)(void))fiber_boot_ucontext, 2, (unsigned)(p >> 16 >> 16), (unsigned)p);
}

void mcpu_fiber_switch(mcpu_fiber *from, mcpu_fiber *to) {
    ASAN_BEFORE_SWITCH(from, to);
    swapcontext(&from->uc, &to->uc);
    ASAN_AFTER_SWITCH(from->asan_fake_stack);
}
#endif

static size_t page_round(size_t bytes) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return (bytes + page - 1) / page * page;
}

/* Slot i's stack top sits (i % STAGGER_SLOTS) * STAGGER_BYTES below its slot's end: a worker's
 * 1024 tops spread evenly over 128 KiB, so over every set of a cache whose way is that large or
 * smaller (an L2 of 1 MiB, 8-way: 2048 sets of 64 bytes; any L1). Unstaggered, they shared 2 of
 * its sets: 16 fibers' frames fitted where 1024 switch in turn. */
enum { STAGGER_BYTES = 128, STAGGER_SLOTS = 1024 };

int mcpu_stack_region_reserve(mcpu_stack_region *r, size_t count, size_t stack_bytes, size_t guard_bytes) {
    r->stack_bytes = page_round(stack_bytes + (size_t)STAGGER_BYTES * (STAGGER_SLOTS - 1));
    r->guard_bytes = page_round(guard_bytes ? guard_bytes : 1);
    r->count = count;
    int flags = MAP_PRIVATE | MAP_ANONYMOUS;
#ifdef MAP_NORESERVE /* 1024 slots of 320 KiB are much address space, little memory */
    flags |= MAP_NORESERVE;
#endif
    void *base = mmap(NULL, count * (r->stack_bytes + r->guard_bytes), PROT_NONE, flags, -1, 0);
    r->base = base == MAP_FAILED ? NULL : base;
    return r->base ? 0 : -1;
}

int mcpu_stack_region_take(mcpu_stack_region *r, size_t i, mcpu_fiber *f) {
    char *stack = r->base + i * (r->stack_bytes + r->guard_bytes) + r->guard_bytes;
    if (i >= r->count || mprotect(stack, r->stack_bytes, PROT_READ | PROT_WRITE) != 0) return -1;
    f->stack = stack;
    f->stack_size = r->stack_bytes - (i % STAGGER_SLOTS) * STAGGER_BYTES;
    return 0;
}

void mcpu_stack_region_trim(mcpu_stack_region *r) {
    if (!r->base) return;
#if defined(MADV_DONTNEED) && defined(__linux__)
    madvise(r->base, r->count * (r->stack_bytes + r->guard_bytes), MADV_DONTNEED);
#elif defined(MADV_FREE)
    madvise(r->base, r->count * (r->stack_bytes + r->guard_bytes), MADV_FREE);
#endif
}

long mcpu_stack_region_guard_slot(const mcpu_stack_region *r, const void *addr) {
    uintptr_t a = (uintptr_t)addr, base = (uintptr_t)r->base, slot = r->stack_bytes + r->guard_bytes;
    if (!r->base || a < base || a >= base + r->count * slot || (a - base) % slot >= r->guard_bytes) return -1;
    return (long)((a - base) / slot);
}
