/* The backward planner: validate a backward call and plan its three launches (on top of the
 * forward's plan of the same call). */
#ifndef FA_PLAN_BACKWARD_H
#define FA_PLAN_BACKWARD_H

#include "fa_plan_forward.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The backward pass: dispatches of fa_backward.metal, in this order, binding the same buffers and
 * fa_backward_params (fa_backward.c): D, the additive mask's block classes (only under one), dK/dV,
 * dQ. A dispatch whose grid is empty is skipped. */
enum {
    FA_BACKWARD_DELTA = 0,
    FA_BACKWARD_MASK_BLOCKS = 1,
    FA_BACKWARD_DKDV = 2,
    FA_BACKWARD_DQ = 3,
    FA_BACKWARD_DISPATCHES = 4
};

typedef struct fa_backward_plan {
    fa_plan_dispatch dispatches[FA_BACKWARD_DISPATCHES];
    int64_t workspace_bytes; /* the mask's block classes and maxima (metal/fa_mask_blocks.h), or 0 */
    fa_backward_params params;
    int32_t gpu_family; /* the family the tiles were chosen for (fa_gpu_family.h) */
    int32_t sequences;
    fa_plan_dispatch sequence_builder; /* as fa_plan's */
} fa_backward_plan;

extern const char fa_backward_source[];

/* Validate every descriptor of args and plan the three launches. */
int32_t fa_plan_backward(const fa_backward_args *args, fa_backward_plan *plan, fa_status *st);

/* The same for the backward: dq, dk, dv, delta against each other and every input (called by
 * fa_plan_backward and, for a cached plan, by fa_backward_prepare). */
int32_t fa_plan_check_backward_aliases(const fa_backward_args *a, fa_status *st);

#ifdef __cplusplus
}
#endif
#endif
