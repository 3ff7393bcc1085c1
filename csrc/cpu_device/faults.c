/* Faults of kernel code, seen from a signal handler: where the faulting instruction is, and an
 * x86-64 integer division fault completed as a GPU does. Async-signal-safe. */
#if !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* REG_RIP under -std=c11 */
#endif
#include "device.h"

#include <signal.h>
#include <stdint.h>
#if defined(__linux__)
#include <sys/ucontext.h> /* ucontext_t; macOS has it from <signal.h> */
#endif

void *mcpu_context_pc(void *context) {
    ucontext_t *uc = context;
#if defined(__linux__) && defined(__x86_64__)
    return (void *)uc->uc_mcontext.gregs[REG_RIP];
#elif defined(__linux__) && defined(__aarch64__)
    return (void *)uc->uc_mcontext.pc;
#elif defined(__APPLE__) && defined(__x86_64__)
    return (void *)uc->uc_mcontext->__ss.__rip;
#elif defined(__APPLE__) && defined(__aarch64__)
    return (void *)uc->uc_mcontext->__ss.__pc;
#else
    (void)uc;
    return NULL;
#endif
}

#if defined(__x86_64__) && (defined(__linux__) || defined(__APPLE__))
#if defined(__linux__)
#define REG_OF(uc, r) ((uc)->uc_mcontext.gregs[REG_##r])
#define CTX_RIP(uc) REG_OF(uc, RIP)
#define CTX_RAX(uc) REG_OF(uc, RAX)
#define CTX_RDX(uc) REG_OF(uc, RDX)
#else
#define CTX_RIP(uc) ((uc)->uc_mcontext->__ss.__rip)
#define CTX_RAX(uc) ((uc)->uc_mcontext->__ss.__rax)
#define CTX_RDX(uc) ((uc)->uc_mcontext->__ss.__rdx)
#endif
/* Completes a faulting x86-64 DIV/IDIV (division by zero, INT_MIN / -1) as a GPU does, without a
 * trap: the quotient is the dividend (INT_MIN / -1 wraps to INT_MIN, x / 0 is unspecified in MSL),
 * the remainder 0. Returns 0 if the instruction at the fault is not one it understands. */
int mcpu_complete_division(void *context) {
    ucontext_t *uc = context;
    const uint8_t *p = (const uint8_t *)CTX_RIP(uc);
    int bytes = 4;
    if (*p == 0x66) bytes = 2, p++;
    if ((*p & 0xF0) == 0x40) bytes = (*p & 8) ? 8 : bytes, p++; /* REX */
    uint8_t op = *p++;
    if (op == 0xF6) bytes = 1;
    else if (op != 0xF7) return 0;
    uint8_t modrm = *p++, mod = modrm >> 6, reg = (modrm >> 3) & 7, rm = modrm & 7;
    if (reg != 6 && reg != 7) return 0; /* DIV, IDIV */
    if (mod != 3) {
        if (rm == 4 && mod == 0 && (*p & 7) == 5) p += 4; /* SIB without base: disp32 */
        if (rm == 4) p++;                                 /* the SIB byte */
        if (mod == 0 && rm == 5) p += 4;                  /* RIP-relative */
        p += mod == 1 ? 1 : mod == 2 ? 4 : 0;
    }
    uint64_t rax = (uint64_t)CTX_RAX(uc);
    if (bytes == 1) CTX_RAX(uc) = (long long)(rax & ~(uint64_t)0xFF00); /* AL = low byte of AX, AH = 0 */
    else if (bytes == 2) CTX_RDX(uc) = (long long)((uint64_t)CTX_RDX(uc) & ~(uint64_t)0xFFFF);
    else if (bytes == 4) CTX_RAX(uc) = (long long)(uint32_t)rax, CTX_RDX(uc) = 0;
    else CTX_RDX(uc) = 0;
    CTX_RIP(uc) = (long long)(uintptr_t)p;
    return 1;
}
#else
int mcpu_complete_division(void *context) { /* aarch64 divides by zero without a trap */
    (void)context;
    return 0;
}
#endif
