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
    if (rc != FA_OK || plan.empty) {
        return rc;
    }
    const fa_backend *backend = args->device == FA_DEVICE_MPS ? fa_metal_backend(st) : fa_cpu_backend();
    if (backend == NULL) {
        return st->code;
    }
    const fa_pipeline_key key = fa_plan_pipeline_key(&plan);
    fa_pipeline *pipeline = backend->get_pipeline(&key, st);
    if (pipeline == NULL) {
        return st->code;
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
    d.n_bindings = 6;
    memcpy(d.threadgroup_bytes, plan.threadgroup_bytes, sizeof d.threadgroup_bytes);
    d.n_threadgroup_args = plan.n_threadgroup_args;
    memcpy(d.grid, plan.grid, sizeof d.grid);
    memcpy(d.threadgroup, plan.threadgroup, sizeof d.threadgroup);
    return backend->dispatch(pipeline, &d, st);
}
