/* Runs a prepared forward pass (fa_plan_cache.h) on the backend of the tensors' device. */
#include "fa_execute.h"

#include <string.h>

_Static_assert(1 + (int)FA_MAX_PLAN_DISPATCHES <= (int)FA_MAX_CHAIN,
               "the sequence table and a plan's dispatches go to the backend in one chain");

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
    /* The sequence table (fa_plan_sequences.h), then every dispatch of the plan (a split decode and
     * its merge), in one chain: on Metal one encoder. The plan's dispatches share their bindings,
     * each with its own pipeline, grid and threadgroup memory. */
    fa_dispatch d[1 + FA_MAX_PLAN_DISPATCHES];
    fa_pipeline *pipelines[1 + FA_MAX_PLAN_DISPATCHES];
    uint32_t n = 0;
    if (ready->sequence_builder.pipeline != NULL) {
        rc = fa_sequence_prepare(&ready->sequence_builder, &ready->params, (int64_t)sizeof ready->params, args,
                                 FA_FORWARD, &d[n], st);
        if (rc != FA_OK) {
            return rc;
        }
        if (d[n].n_bindings > 0) {
            pipelines[n++] = ready->sequence_builder.pipeline;
        }
    }
    fa_dispatch *plan_dispatches = &d[n];
    memset(plan_dispatches, 0, sizeof *plan_dispatches);
    const fa_tensor *present = args->out.storage != NULL ? &args->out : &args->lse;
    fa_bind_slots(plan_dispatches, args, FA_FORWARD, present); /* each untouched unless its function constant says so */
    plan_dispatches->bindings[FA_FORWARD_BUFFER_PARAMS].bytes = &ready->params;
    plan_dispatches->bindings[FA_FORWARD_BUFFER_PARAMS].length = (int64_t)sizeof ready->params;
    plan_dispatches->n_bindings = FA_FORWARD_BUFFERS;
    for (uint32_t i = 0; i < ready->n_dispatches; ++i) {
        const fa_ready_dispatch *step = &ready->dispatches[i];
        fa_dispatch *di = &plan_dispatches[i];
        if (i > 0) {
            *di = plan_dispatches[0];
            di->same_bindings_as_previous = 1;
        }
        memcpy(di->threadgroup_bytes, step->threadgroup_bytes, sizeof di->threadgroup_bytes);
        di->n_threadgroup_args = step->n_threadgroup_args;
        memcpy(di->grid, step->grid, sizeof di->grid);
        memcpy(di->threadgroup, step->threadgroup, sizeof di->threadgroup);
        pipelines[n++] = step->pipeline;
    }
    if (n > 0) {
        rc = ready->backend->dispatch(pipelines, d, n, st);
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
