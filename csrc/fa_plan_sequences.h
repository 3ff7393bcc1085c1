/* The sequences planner: packed sequences and KV caches (fa_sequence_args in fa_core.h; the
 * kernels' side in metal/fa_sequence.h): validation, the grid's view of a call, and the table
 * kernel's dispatch. */
#ifndef FA_PLAN_SEQUENCES_H
#define FA_PLAN_SEQUENCES_H

#include "fa_plan_build.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Whether a call has a sequence table (a 0-D descriptor with storage is refused, never "absent"). */
int32_t fa_sequences_present(const fa_sequence_args *s);
/* Whether the keys are read through a block table (paged KV). */
int32_t fa_sequence_paged(const fa_sequence_args *s);

/* Validates the sequence arguments of a forward call whose q, k, v, out, lse descriptors are
 * checked, and writes *grid: the call as the grid sees it, every q-side view (B, Hq, max_q_len, .)
 * and every key-side view (B, Hkv, max_kv_len, .), B the table's sequences; strides unchanged. */
int32_t fa_sequence_grid_args(const fa_forward_args *a, fa_forward_args *grid, fa_status *st);

/* The table and scratch lie inside their storage and the scratch is large and aligned enough
 * (pointer-dependent: checked on every call, cached plan or not). */
int32_t fa_sequence_check_storage(const fa_sequence_args *s, int32_t device, fa_status *st);

/* The kernel arguments the table kernel starts from: the views' extents and the band's options
 * (real: the call's own descriptors). */
void fa_sequence_set_params(const fa_forward_args *real, fa_params *p);

/* The table kernel's dispatch, in the library of `like` (source and macros; so it costs no compile
 * of its own), for element type dtype. */
void fa_sequence_set_builder(fa_plan_dispatch *builder, const fa_plan_dispatch *like, const char *source, int32_t dtype,
                             uint32_t sequences);

#ifdef __cplusplus
}
#endif
#endif
