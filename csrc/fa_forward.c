/* Runs a prepared forward pass (fa_plan_cache.h) on the backend of the tensors' device. */
#include "fa_execute.h"

#include <string.h>

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
    fa_dispatch d;
    memset(&d, 0, sizeof d);
    const fa_tensor *present = args->out.storage != NULL ? &args->out : &args->lse;
    fa_bind_slots(&d, args, FA_FORWARD, present); /* each untouched unless its function constant says so */
    d.bindings[FA_FORWARD_BUFFER_PARAMS].bytes = &params;
    d.bindings[FA_FORWARD_BUFFER_PARAMS].length = (int64_t)sizeof params;
    d.n_bindings = FA_FORWARD_BUFFERS;
    if (ready->sequence_builder.pipeline != NULL) { /* the per-sequence params first (fa_plan_sequences.h) */
        rc = fa_sequence_build(ready->backend, &ready->sequence_builder, &params, (int64_t)sizeof params, args,
                               FA_FORWARD, st);
    }
    for (uint32_t i = without_mask_blocks; i < ready->n_dispatches && rc == FA_OK; ++i) {
        const fa_ready_dispatch *step = &ready->dispatches[i];
        memcpy(d.threadgroup_bytes, step->threadgroup_bytes, sizeof d.threadgroup_bytes);
        d.n_threadgroup_args = step->n_threadgroup_args;
        memcpy(d.grid, step->grid, sizeof d.grid);
        memcpy(d.threadgroup, step->threadgroup, sizeof d.threadgroup);
        d.same_bindings_as_previous = i > (uint32_t)without_mask_blocks;
        rc = ready->backend->dispatch(step->pipeline, &d, st);
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
