/* Validation of the contract's descriptors: every element inside its storage, dtypes and ranks,
 * outputs that alias nothing, and the names and shapes messages print. No planning here. */
#ifndef FA_VALIDATE_H
#define FA_VALIDATE_H

#include "fa_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

const char *fa_dtype_name(int32_t dtype);                          /* "float32", ... for messages */
int64_t fa_dtype_bytes(int32_t dtype);                             /* bytes per element */
const char *fa_kernel_type_name(int32_t dtype);                    /* the MSL type kernels are instantiated for */
void fa_describe_shape(const fa_tensor *t, char *out, size_t len); /* "(2, 8, 128, 64)" */

/* A descriptor is usable when its rank and dtype are as expected (float32 when float32_only) and
 * every element it addresses lies inside its storage. */
int32_t fa_check_tensor(const fa_tensor *t, const char *name, int32_t ndim, int32_t float32_only, fa_status *st);
/* The first n_outputs of n_views validated views are written: none may overlap itself, another
 * output or an input (threads run in no order). Fails with FA_ERR_VALUE naming the pair. */
int32_t fa_check_no_alias(const fa_tensor *const *views, const char *const *names, int32_t n_views, int32_t n_outputs,
                          fa_status *st);

/* The alias check of a direction's slots (fa_tensor_slots): its outputs against each other and
 * its inputs (the workspace only with_workspace). */
int32_t fa_check_slot_aliases(const void *args, int32_t direction, int32_t with_workspace, fa_status *st);

/* A call that launches kernels has no empty tensor in any slot it binds: an empty tensor may have
 * no storage, and there is nothing for a kernel to read or write in it (callers return empty
 * results themselves). Fails with FA_ERR_VALUE naming the slot and its shape. */
int32_t fa_check_no_empty_slot(const void *args, int32_t direction, fa_status *st);

/* Checks that a plan needing workspace_bytes has a valid float32 workspace of at least that. */
int32_t fa_plan_check_workspace(int64_t workspace_bytes, const fa_tensor *workspace, fa_status *st);

#ifdef __cplusplus
}
#endif
#endif
