/* Prepared calls: a validated plan whose pipelines are resolved, ready to bind and dispatch.
 * Plans are cached by what determines them (device, flags, scale, and every descriptor's dtype,
 * sizes and strides, never its storage), so a repeated shape costs a key comparison plus the
 * checks that depend on the storage (every element inside it) instead of validation, planning and
 * pipeline lookups. One prepare, then one execute, per attention call. */
#ifndef FA_PLAN_CACHE_H
#define FA_PLAN_CACHE_H

#include "fa_plan_backward.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fa_ready_dispatch {
    fa_pipeline *pipeline; /* NULL for a backward step with an empty grid (skipped) */
    uint32_t grid[3];
    uint32_t threadgroup[3];
    uint64_t threadgroup_bytes[FA_MAX_TG_ARGS];
    uint32_t n_threadgroup_args;
} fa_ready_dispatch;

typedef struct fa_forward_ready {
    const fa_backend *backend; /* NULL when empty */
    fa_params params;
    int64_t workspace_bytes; /* the workspace execute needs (fa_forward_workspace_bytes) */
    int32_t empty;           /* nothing to launch */
    uint32_t n_dispatches;
    fa_ready_dispatch dispatches[FA_MAX_PLAN_DISPATCHES];
    fa_ready_dispatch sequence_builder; /* pipeline NULL without a sequence table */
} fa_forward_ready;

typedef struct fa_backward_ready {
    const fa_backend *backend;
    fa_backward_params params;
    int64_t workspace_bytes; /* as fa_backward_plan's */
    fa_ready_dispatch dispatches[FA_BACKWARD_DISPATCHES];
    fa_ready_dispatch sequence_builder; /* pipeline NULL without a sequence table */
} fa_backward_ready;

/* Validate every descriptor of args but the workspace, plan (or find the plan) and resolve its
 * pipelines (compiling them on first use). */
int32_t fa_forward_prepare(const fa_forward_args *args, fa_forward_ready *ready, fa_status *st);
/* Checks args' workspace against ready and runs it (fa_forward.c). */
int32_t fa_forward_execute(const fa_forward_ready *ready, const fa_forward_args *args, fa_status *st);

int32_t fa_backward_prepare(const fa_backward_args *args, fa_backward_ready *ready, fa_status *st);
int32_t fa_backward_execute(const fa_backward_ready *ready, const fa_backward_args *args, fa_status *st);

/* How the plan cache answered so far: forward hits, forward misses, backward hits, backward misses
 * (a miss plans afresh). For tests that a changed option or tensor is never served an old plan. */
void fa_plan_cache_counts(int64_t counts[4]);

#ifdef __cplusplus
}
#endif
#endif
