/* Runs a prepared forward pass (fa_plan_cache.h) on the backend of the tensors' device. */
#include "fa_execute.h"

#include <string.h>

_Static_assert((int)FA_MAX_PLAN_DISPATCHES <= (int)FA_MAX_CHAIN, "a plan's dispatches go to the backend in one chain");

/* An empty tensor (S == 0, say) may have no storage at all; Metal still wants every buffer
 * argument bound, and the kernel reads none of its elements, so bind `fallback` in its place. */
int32_t fa_forward_execute(const fa_forward_ready *ready, const fa_forward_args *args, fa_status *st) {
    if (ready->empty) {
        return FA_OK;
    }
    int32_t rc = fa_plan_check_workspace(ready->workspace_bytes, &args->workspace, st);
    if (rc == FA_OK) {
        rc = fa_plan_check_forward_aliases(args, ready->workspace_bytes > 0, st);
    }
    if (rc != FA_OK) {
        return rc;
    }
    /* Every dispatch of the plan (a split decode and its merge) on one encoder: the same bindings,
     * each its own pipeline, grid and threadgroup memory. */
    fa_dispatch d[FA_MAX_PLAN_DISPATCHES];
    fa_pipeline *pipelines[FA_MAX_PLAN_DISPATCHES];
    memset(&d[0], 0, sizeof d[0]);
    const fa_tensor *present = args->out.storage != NULL ? &args->out : &args->lse;
    fa_bind_slots(&d[0], args, FA_FORWARD, present); /* each untouched unless its function constant says so */
    d[0].bindings[FA_FORWARD_BUFFER_PARAMS].bytes = &ready->params;
    d[0].bindings[FA_FORWARD_BUFFER_PARAMS].length = (int64_t)sizeof ready->params;
    d[0].n_bindings = FA_FORWARD_BUFFERS;
    if (ready->sequence_builder.pipeline != NULL) { /* the per-sequence params first (fa_plan_sequences.h) */
        rc = fa_sequence_build(ready->backend, &ready->sequence_builder, &ready->params, (int64_t)sizeof ready->params,
                               args, FA_FORWARD, st);
    }
    for (uint32_t i = 0; i < ready->n_dispatches; ++i) {
        const fa_ready_dispatch *step = &ready->dispatches[i];
        if (i > 0) {
            d[i] = d[0];
            d[i].same_bindings_as_previous = 1;
        }
        memcpy(d[i].threadgroup_bytes, step->threadgroup_bytes, sizeof d[i].threadgroup_bytes);
        d[i].n_threadgroup_args = step->n_threadgroup_args;
        memcpy(d[i].grid, step->grid, sizeof d[i].grid);
        memcpy(d[i].threadgroup, step->threadgroup, sizeof d[i].threadgroup);
        pipelines[i] = step->pipeline;
    }
    if (rc == FA_OK && ready->n_dispatches > 0) {
        rc = ready->backend->dispatch(pipelines, d, ready->n_dispatches, st);
    }
    return rc;
}

int32_t fa_forward(const fa_forward_args *args, fa_status *st) {
    fa_forward_ready ready;
    const int32_t rc = fa_forward_prepare(args, &ready, st);
    return rc != FA_OK ? rc : fa_forward_execute(&ready, args, st);
}

int64_t fa_forward_workspace_bytes(const fa_forward_args *args, fa_status *st) {
    fa_forward_ready ready;
    return fa_forward_prepare(args, &ready, st) == FA_OK ? ready.workspace_bytes : -1;
}
