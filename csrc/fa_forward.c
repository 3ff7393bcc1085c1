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
    /* The mask's block classes are the only workspace of a prefill plan, and a speed-up only: a
     * caller without a workspace runs the forward alone, which then adds the mask everywhere. */
    fa_params params = ready->params;
    const int32_t without_mask_blocks = params.mask_block_counts[0] != 0 && args->workspace.storage == NULL;
    const int64_t workspace_bytes = without_mask_blocks ? 0 : ready->workspace_bytes;
    int32_t rc = fa_plan_check_workspace(workspace_bytes, &args->workspace, st);
    if (rc == FA_OK) {
        rc = fa_plan_check_forward_aliases(args, workspace_bytes > 0, st);
    }
    if (rc != FA_OK) {
        return rc;
    }
    params.mask_block_counts[0] = without_mask_blocks ? 0 : params.mask_block_counts[0];
    /* The sequence table (fa_plan_sequences.h), then every dispatch of the plan (the mask's block
     * classes, a split decode and its merge), in one chain: on Metal one encoder. The plan's
     * dispatches share their bindings, each with its own pipeline, grid and threadgroup memory. */
    fa_dispatch d[1 + FA_MAX_PLAN_DISPATCHES];
    fa_pipeline *pipelines[1 + FA_MAX_PLAN_DISPATCHES];
    uint32_t n = 0;
    if (ready->sequence_builder.pipeline != NULL) {
        rc =
            fa_sequence_prepare(&ready->sequence_builder, &params, (int64_t)sizeof params, args, FA_FORWARD, &d[n], st);
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
    plan_dispatches->bindings[FA_FORWARD_BUFFER_PARAMS].bytes = &params;
    plan_dispatches->bindings[FA_FORWARD_BUFFER_PARAMS].length = (int64_t)sizeof params;
    plan_dispatches->n_bindings = FA_FORWARD_BUFFERS;
    for (uint32_t i = (uint32_t)without_mask_blocks, j = 0; i < ready->n_dispatches; ++i, ++j) {
        const fa_ready_dispatch *step = &ready->dispatches[i];
        fa_dispatch *dj = &plan_dispatches[j];
        if (j > 0) {
            *dj = plan_dispatches[0];
            dj->same_bindings_as_previous = 1;
        }
        memcpy(dj->threadgroup_bytes, step->threadgroup_bytes, sizeof dj->threadgroup_bytes);
        dj->n_threadgroup_args = step->n_threadgroup_args;
        memcpy(dj->grid, step->grid, sizeof dj->grid);
        memcpy(dj->threadgroup, step->threadgroup, sizeof dj->threadgroup);
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
