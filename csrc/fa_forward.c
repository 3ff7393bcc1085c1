/* Runs a planned forward pass on the backend of the tensors' device. */
#include "fa_plan.h"

#include <string.h>

/* An empty tensor (S == 0, say) may have no storage at all; Metal still wants every buffer
 * argument bound, and the kernel reads none of its elements, so bind `fallback` in its place. */
static fa_binding tensor_binding(const fa_tensor *t, const fa_tensor *fallback) {
    const fa_tensor *bound = t->storage != NULL ? t : fallback;
    fa_binding b = {bound->storage, bound->byte_offset, NULL, 0};
    return b;
}

int32_t fa_forward(const fa_forward_args *args, fa_status *st) {
    fa_plan plan;
    int32_t rc = fa_plan_forward(args, &plan, st);
    if (rc != FA_OK || plan.empty || (rc = fa_plan_check_workspace(&plan, args, st)) != FA_OK) {
        return rc;
    }
    const fa_backend *backend = args->device == FA_DEVICE_MPS ? fa_metal_backend(st) : fa_cpu_backend();
    if (backend == NULL) {
        return st->code;
    }
    /* Every pipeline before any dispatch, so a compile error never leaves half a plan encoded. */
    fa_pipeline *pipelines[FA_MAX_PLAN_DISPATCHES];
    for (uint32_t i = 0; i < plan.n_dispatches; ++i) {
        const fa_pipeline_key key = fa_plan_pipeline_key(&plan.dispatches[i]);
        if ((pipelines[i] = backend->get_pipeline(&key, st)) == NULL) {
            return st->code;
        }
    }

    fa_dispatch d;
    memset(&d, 0, sizeof d);
    const fa_tensor *present = args->out.storage != NULL ? &args->out : &args->lse;
    d.bindings[0] = tensor_binding(&args->q, present);
    d.bindings[1] = tensor_binding(&args->k, present);
    d.bindings[2] = tensor_binding(&args->v, present);
    d.bindings[3] = tensor_binding(&args->out, present);
    d.bindings[4] = tensor_binding(&args->lse, present); /* untouched unless FA_FC_WRITE_LSE */
    d.bindings[5].bytes = &plan.params;
    d.bindings[5].length = (int64_t)sizeof plan.params;
    d.bindings[6] = tensor_binding(&args->workspace, present); /* untouched unless the plan splits */
    d.bindings[7] = tensor_binding(&args->mask, present);      /* untouched unless FA_FC_MASK_KIND */
    d.n_bindings = 8;
    for (uint32_t i = 0; i < plan.n_dispatches && rc == FA_OK; ++i) {
        const fa_plan_dispatch *step = &plan.dispatches[i];
        memcpy(d.threadgroup_bytes, step->threadgroup_bytes, sizeof d.threadgroup_bytes);
        d.n_threadgroup_args = step->n_threadgroup_args;
        memcpy(d.grid, step->grid, sizeof d.grid);
        memcpy(d.threadgroup, step->threadgroup, sizeof d.threadgroup);
        rc = backend->dispatch(pipelines[i], &d, st);
    }
    return rc;
}

int64_t fa_forward_workspace_bytes(const fa_forward_args *args, fa_status *st) {
    fa_plan plan;
    return fa_plan_forward(args, &plan, st) == FA_OK ? plan.workspace_bytes : -1;
}
