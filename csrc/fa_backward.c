/* Runs a planned backward pass on the backend of the tensors' device. */
#include "fa_plan.h"

#include <string.h>

enum { BACKWARD_TENSORS = 10 };

static int32_t launches(const fa_plan_dispatch *step) {
    return step->grid[0] > 0 && step->grid[1] > 0 && step->grid[2] > 0;
}

int32_t fa_backward(const fa_backward_args *args, fa_status *st) {
    fa_backward_plan plan;
    int32_t rc = fa_plan_backward(args, &plan, st);
    if (rc != FA_OK) {
        return rc;
    }
    /* Bindings 0..9 in the kernels' [[buffer(n)]] order. An empty tensor may have no storage;
     * Metal still wants its buffer bound and no kernel reads it, so a present one stands in. With
     * none present every tensor is empty and there is nothing to compute. */
    const fa_tensor *tensors[BACKWARD_TENSORS] = {&args->q,   &args->k,     &args->v,  &args->out, &args->dout,
                                                  &args->lse, &args->delta, &args->dq, &args->dk,  &args->dv};
    const fa_tensor *present = NULL;
    for (uint32_t i = 0; i < BACKWARD_TENSORS && present == NULL; ++i) {
        if (tensors[i]->storage != NULL) {
            present = tensors[i];
        }
    }
    if (present == NULL) {
        return FA_OK;
    }
    const fa_backend *backend = args->device == FA_DEVICE_MPS ? fa_metal_backend(st) : fa_cpu_backend();
    if (backend == NULL) {
        return st->code;
    }
    /* Every pipeline before any dispatch, so a compile error never leaves half a pass encoded. */
    fa_pipeline *pipelines[FA_BACKWARD_DISPATCHES] = {NULL};
    for (uint32_t i = 0; i < FA_BACKWARD_DISPATCHES; ++i) {
        const fa_pipeline_key key = fa_plan_pipeline_key(&plan.dispatches[i]);
        if (launches(&plan.dispatches[i]) && (pipelines[i] = backend->get_pipeline(&key, st)) == NULL) {
            return st->code;
        }
    }

    fa_dispatch d;
    memset(&d, 0, sizeof d);
    for (uint32_t i = 0; i < BACKWARD_TENSORS; ++i) {
        const fa_tensor *bound = tensors[i]->storage != NULL ? tensors[i] : present;
        d.bindings[i].storage = bound->storage;
        d.bindings[i].byte_offset = bound->byte_offset;
    }
    d.bindings[BACKWARD_TENSORS].bytes = &plan.params;
    d.bindings[BACKWARD_TENSORS].length = (int64_t)sizeof plan.params;
    /* [[buffer(11)]]: the attn_mask, untouched unless FA_FC_MASK_KIND says there is one. */
    const fa_tensor *mask = args->mask.storage != NULL ? &args->mask : present;
    d.bindings[BACKWARD_TENSORS + 1].storage = mask->storage;
    d.bindings[BACKWARD_TENSORS + 1].byte_offset = mask->byte_offset;
    d.n_bindings = BACKWARD_TENSORS + 2;
    for (uint32_t i = 0; i < FA_BACKWARD_DISPATCHES && rc == FA_OK; ++i) {
        const fa_plan_dispatch *step = &plan.dispatches[i];
        if (launches(step)) {
            memcpy(d.grid, step->grid, sizeof d.grid);
            memcpy(d.threadgroup, step->threadgroup, sizeof d.threadgroup);
            rc = backend->dispatch(pipelines[i], &d, st);
        }
    }
    return rc;
}
