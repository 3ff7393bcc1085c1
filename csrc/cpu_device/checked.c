/* Checked mode around a dispatch (docs/cpu-device.md, "Checked mode"): the kernel runs on guarded copies of the
 * buffers, and what the accesses found (runtime.c) becomes a message with source lines. */
#if !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* MAP_ANONYMOUS under -std=c11 */
#endif
#include "runtime.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* Copies the buffers of known length into a fresh region: each group of overlapping bindings on
 * its own pages (at its original offset in the page, keeping alignment) between guard pages.
 * copies[i] is what binds [[buffer(i)]]. */
enum { GUARD_BYTES = 256u << 20 };
int32_t guard_buffers(const msl_launch *l, guarded *g, void **copies, mcpu_status *st) {
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
void unguard_buffers(guarded *g) {
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
void describe_finding(const job *j, mcpu_status *st) {
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
            "of %s at %s; thread %u (%u,%u,%u) %s them at %s, with no "
            "threadgroup_barrier(mem_flags::mem_threadgroup)%s "
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
