/* Runs a prepared backward pass (fa_plan_cache.h) on the backend of the tensors' device. */
#include "fa_execute.h"

#include <string.h>

int32_t fa_backward_execute(const fa_backward_ready *ready, const fa_backward_args *args, fa_status *st) {
    /* An empty tensor may have no storage; Metal still wants its buffer bound and no kernel reads
     * it, so a present one stands in. With none of the required tensors present every tensor is
     * empty and there is nothing to compute. */
    const fa_tensor *present = NULL;
    for (int32_t i = 0; i < FA_SLOT_COUNT && present == NULL; ++i) {
        const fa_tensor *t = fa_slot_tensor(args, FA_BACKWARD, i);
        if (t != NULL && !(fa_tensor_slots[i].optional & FA_OPTIONAL_BACKWARD) && t->storage != NULL) {
            present = t;
        }
    }
    if (present == NULL) {
        return FA_OK;
    }
    /* The mask's block classes are a speed-up only: without a workspace the kernels add the mask
     * everywhere (fa_core.h). */
    fa_backward_params params = ready->params;
    const int32_t with_mask_blocks = ready->workspace_bytes > 0 && args->workspace.storage != NULL;
    int32_t rc = FA_OK;
    if (with_mask_blocks && ((rc = fa_plan_check_workspace(ready->workspace_bytes, &args->workspace, st)) != FA_OK ||
                             (rc = fa_check_slot_aliases(args, FA_BACKWARD, 1, st)) != FA_OK)) {
        return rc;
    }
    params.forward.mask_block_counts[0] = with_mask_blocks ? params.forward.mask_block_counts[0] : 0;
    fa_dispatch d;
    memset(&d, 0, sizeof d);
    fa_bind_slots(&d, args, FA_BACKWARD,
                  present); /* the optional ones untouched unless their function constants say so */
    d.bindings[FA_BACKWARD_BUFFER_PARAMS].bytes = &params;
    d.bindings[FA_BACKWARD_BUFFER_PARAMS].length = (int64_t)sizeof params;
    d.n_bindings = FA_BACKWARD_BUFFERS;
    if (ready->sequence_builder.pipeline != NULL) { /* the per-sequence params first (fa_plan_sequences.h) */
        rc = fa_sequence_build(ready->backend, &ready->sequence_builder, &params.forward,
                               (int64_t)sizeof params.forward, args, FA_BACKWARD, st);
    }
    for (uint32_t i = 0; i < FA_BACKWARD_DISPATCHES && rc == FA_OK; ++i) {
        const fa_ready_dispatch *step = &ready->dispatches[i];
        if (step->pipeline != NULL && (i != FA_BACKWARD_MASK_BLOCKS || with_mask_blocks)) {
            memcpy(d.grid, step->grid, sizeof d.grid);
            memcpy(d.threadgroup, step->threadgroup, sizeof d.threadgroup);
            rc = ready->backend->dispatch(&step->pipeline, &d, 1, st);
            d.same_bindings_as_previous = 1;
        }
    }
    return rc;
}

int32_t fa_backward(const fa_backward_args *args, fa_status *st) {
    fa_backward_ready ready;
    const int32_t rc = fa_backward_prepare(args, &ready, st);
    return rc != FA_OK ? rc : fa_backward_execute(&ready, args, st);
}
