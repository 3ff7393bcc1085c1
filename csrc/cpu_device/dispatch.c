/* mcpu_dispatch: a dispatch's arguments checked against Metal's limits, then run (pool.c). */
#include "device.h"

#include <stdio.h>

int32_t mcpu_dispatch(const mcpu_library *lib, const mcpu_dispatch_args *a, mcpu_status *st) {
    if (!lib || !a || !a->kernel)
        return mcpu_fail(st, MCPU_ERR_VALUE, "mcpu_dispatch: library, arguments and kernel name are required");
    mcpu_kernel_fn fn = mcpu_library_kernel(lib, a->kernel);
    if (!fn) {
        char m[MCPU_STATUS_MESSAGE_BYTES];
        size_t len = (size_t)snprintf(m, sizeof m, "kernel '%s' is not in the library; it has:", a->kernel);
        for (const char *const *k = mcpu_library_kernels(lib); k && *k && len < sizeof m; k++)
            len += (size_t)snprintf(m + len, sizeof m - len, " %s", *k);
        return mcpu_fail(st, MCPU_ERR_VALUE, "%s", m);
    }
    static const char axis[3] = {'x', 'y', 'z'};
    uint64_t threads = 1, groups = 1;
    for (int d = 0; d < 3; d++) {
        if (a->grid[d] == 0 || a->threadgroup[d] == 0)
            return mcpu_fail(st, MCPU_ERR_VALUE, "kernel '%s': %s.%c is 0; every dimension must be >= 1", a->kernel,
                             a->grid[d] == 0 ? "grid" : "threadgroup", axis[d]);
        if ((uint64_t)a->grid[d] * a->threadgroup[d] > UINT32_MAX)
            return mcpu_fail(st, MCPU_ERR_VALUE,
                             "kernel '%s': grid.%c * threadgroup.%c = %u * %u threads do not fit a uint", a->kernel,
                             axis[d], axis[d], a->grid[d], a->threadgroup[d]);
        if (__builtin_mul_overflow(threads, a->threadgroup[d], &threads))
            return mcpu_fail(st, MCPU_ERR_VALUE,
                             "kernel '%s': threadgroup %u x %u x %u overflows 64 bits; at most %u threads are allowed",
                             a->kernel, a->threadgroup[0], a->threadgroup[1], a->threadgroup[2],
                             MSL_MAX_THREADS_PER_THREADGROUP);
        if (__builtin_mul_overflow(groups, a->grid[d], &groups))
            return mcpu_fail(st, MCPU_ERR_VALUE, "kernel '%s': grid %u x %u x %u has too many threadgroups", a->kernel,
                             a->grid[0], a->grid[1], a->grid[2]);
    }
    if (threads > MSL_MAX_THREADS_PER_THREADGROUP)
        return mcpu_fail(st, MCPU_ERR_VALUE,
                         "kernel '%s': threadgroup %u x %u x %u = %llu threads, more than the %u allowed", a->kernel,
                         a->threadgroup[0], a->threadgroup[1], a->threadgroup[2], (unsigned long long)threads,
                         MSL_MAX_THREADS_PER_THREADGROUP);
    if (a->n_buffers > MSL_MAX_BUFFERS || (a->n_buffers && !a->buffers))
        return mcpu_fail(st, MCPU_ERR_VALUE, "kernel '%s': n_buffers = %u (at most %u, with buffers set)", a->kernel,
                         a->n_buffers, MSL_MAX_BUFFERS);
    if (a->n_threadgroup_args > MSL_MAX_THREADGROUP_ARGS || (a->n_threadgroup_args && !a->threadgroup_arg_lengths))
        return mcpu_fail(st, MCPU_ERR_VALUE,
                         "kernel '%s': n_threadgroup_args = %u (at most %u, with threadgroup_arg_lengths set)",
                         a->kernel, a->n_threadgroup_args, MSL_MAX_THREADGROUP_ARGS);
    if (a->n_constants > MSL_FUNCTION_CONSTANT_INDICES || (a->n_constants && !a->constants))
        return mcpu_fail(st, MCPU_ERR_VALUE, "kernel '%s': n_constants = %u (at most %u, with constants set)",
                         a->kernel, a->n_constants, MSL_FUNCTION_CONSTANT_INDICES);
    for (uint32_t i = 0; i < a->n_constants; i++)
        if (a->constants[i].index >= MSL_FUNCTION_CONSTANT_INDICES ||
            (i && a->constants[i].index <= a->constants[i - 1].index))
            return mcpu_fail(st, MCPU_ERR_VALUE,
                             "kernel '%s': constants[%u] has index %u; indices must be 0..%u, increasing", a->kernel, i,
                             a->constants[i].index, MSL_FUNCTION_CONSTANT_INDICES - 1);
    uint64_t tg_bytes = 0; /* a multiple of 16, as each length is rounded up to 16 */
    for (uint32_t i = 0; i < a->n_threadgroup_args; i++) {
        uint64_t len = a->threadgroup_arg_lengths[i];
        if (len > MCPU_MAX_THREADGROUP_MEMORY - tg_bytes)
            return mcpu_fail(st, MCPU_ERR_VALUE,
                             "kernel '%s': threadgroup_arg_lengths[%u] = %llu takes threadgroup memory past "
                             "%d bytes (%llu bytes before it, lengths rounded up to 16)",
                             a->kernel, i, (unsigned long long)len, MCPU_MAX_THREADGROUP_MEMORY,
                             (unsigned long long)tg_bytes);
        tg_bytes += (len + 15) & ~(uint64_t)15;
    }
    msl_launch launch = {a->kernel,
                         a->buffers,
                         a->n_buffers,
                         a->n_threadgroup_args,
                         a->threadgroup_arg_lengths,
                         a->constants,
                         a->n_constants,
                         {a->grid[0], a->grid[1], a->grid[2]},
                         {a->threadgroup[0], a->threadgroup[1], a->threadgroup[2]},
                         a->buffer_lengths};
    return mcpu_run(fn, &launch, mcpu_library_mode(lib), st);
}
