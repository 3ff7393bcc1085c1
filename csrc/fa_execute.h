/* What executing a prepared call shares between the forward and the backward: binding the tensor
 * slots at their buffers, and running the sequence-table kernel. */
#ifndef FA_EXECUTE_H
#define FA_EXECUTE_H

#include "fa_plan_cache.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Runs the table kernel (params: the plan's) over the sequence slots of args (fa_forward_args or
 * fa_backward_args, by direction), after checking that the scratch it writes overlaps no other
 * tensor of the call; the attention kernels then read the scratch at their sequences buffer. */
int32_t fa_sequence_build(const fa_backend *backend, const fa_ready_dispatch *builder, const void *params,
                          int64_t params_bytes, const void *args, int32_t direction, fa_status *st);

/* The same check, filling *d with the table kernel's dispatch for a caller that runs it first in
 * its own chain (fa_backend.dispatch); *d has no bindings when there is no sequence to build. */
int32_t fa_sequence_prepare(const fa_ready_dispatch *builder, const void *params, int64_t params_bytes,
                            const void *args, int32_t direction, fa_dispatch *d, fa_status *st);

/* Binds every tensor slot of args that the direction's kernels take at its [[buffer(n)]] (the
 * table's), `present` standing in for an absent one. */
void fa_bind_slots(fa_dispatch *d, const void *args, int32_t direction, const fa_tensor *present);

#ifdef __cplusplus
}
#endif
#endif
