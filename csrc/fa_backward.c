/* Runs a prepared backward pass (fa_plan_cache.h) on the backend of the tensors' device. */
#include "fa_plan_cache.h"
#include "fa_sequence.h"

#include <string.h>

enum { BACKWARD_TENSORS = 10 };

static const char *const names_of_tensors[BACKWARD_TENSORS] = {"q",   "k",     "v",  "out", "dout",
                                                               "lse", "delta", "dq", "dk",  "dv"};

int32_t fa_backward_execute(const fa_backward_ready *ready, const fa_backward_args *args, fa_status *st) {
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
    fa_dispatch d;
    memset(&d, 0, sizeof d);
    for (uint32_t i = 0; i < BACKWARD_TENSORS; ++i) {
        d.bindings[i] = fa_tensor_binding(tensors[i], present);
    }
    d.bindings[BACKWARD_TENSORS].bytes = &ready->params;
    d.bindings[BACKWARD_TENSORS].length = (int64_t)sizeof ready->params;
    /* The optional inputs, each untouched unless its function constant says it is there:
     * [[buffer(11)]] the attn_mask (FA_FC_MASK_KIND), [[buffer(12)]] the ALiBi slopes, [[buffer(13)]]
     * and [[buffer(14)]] the sinks and their per-row gradient terms, [[buffer(15)]] the sequence
     * table (FA_FC_SEQUENCES, bound below), [[buffer(16)]] dropout's generator state. */
    d.bindings[BACKWARD_TENSORS + 1] = fa_tensor_binding(&args->mask, present);
    d.bindings[BACKWARD_TENSORS + 2] = fa_tensor_binding(&args->alibi_slopes, present);
    d.bindings[BACKWARD_TENSORS + 3] = fa_tensor_binding(&args->sinks, present);
    d.bindings[BACKWARD_TENSORS + 4] = fa_tensor_binding(&args->sink_grad, present);
    d.bindings[15] = fa_tensor_binding(present, present);
    d.bindings[16] = fa_tensor_binding(&args->rng_state, present);
    d.n_bindings = 17;
    int32_t rc = FA_OK;
    if (ready->sequence_builder.pipeline != NULL) { /* the per-sequence params first (fa_sequence.h) */
        rc = fa_sequence_build(ready->backend, &ready->sequence_builder, &ready->params.forward,
                               (int64_t)sizeof ready->params.forward, &args->sequences, tensors, names_of_tensors,
                               BACKWARD_TENSORS, st);
        d.bindings[15] = fa_sequence_binding(&args->sequences);
    }
    for (uint32_t i = 0; i < FA_BACKWARD_DISPATCHES && rc == FA_OK; ++i) {
        const fa_ready_dispatch *step = &ready->dispatches[i];
        if (step->pipeline != NULL) {
            memcpy(d.grid, step->grid, sizeof d.grid);
            memcpy(d.threadgroup, step->threadgroup, sizeof d.threadgroup);
            rc = ready->backend->dispatch(step->pipeline, &d, st);
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
