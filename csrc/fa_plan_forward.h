/* The forward planner: validate a forward call, choose the kernel and its specialisation, tiles and
 * grid. Pure C with no backend knowledge: the result is a pipeline key plus dispatch geometry and
 * the kernel arguments (fa_params), which fa_forward.c hands to whichever backend runs it. */
#ifndef FA_PLAN_FORWARD_H
#define FA_PLAN_FORWARD_H

#include "fa_gpu_family.h"
#include "fa_plan_build.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Dispatches run in order on one stream (a split decode: partial results, then their merge); all
 * of them bind the same buffers and the same fa_params (fa_forward.c). */
typedef struct fa_plan {
    fa_plan_dispatch dispatches[FA_MAX_PLAN_DISPATCHES];
    uint32_t n_dispatches;
    int32_t empty;           /* nothing to launch (L == 0 or an empty batch): the output is empty too */
    int32_t banded;          /* FA_FC_BAND: causal or a window limits each row's keys (params.band_lo/hi) */
    int64_t workspace_bytes; /* scratch the dispatches share (fa_forward_workspace_bytes) */
    fa_params params;
    int32_t gpu_family;                /* the family the tiles were chosen for (fa_gpu_family.h) */
    int32_t sequences;                 /* FA_FC_SEQUENCES: a sequence table (fa_plan_sequences.h) */
    fa_plan_dispatch sequence_builder; /* with sequences: the table kernel, run before the dispatches */
} fa_plan;

/* Validate every descriptor of args except the workspace, and plan the launches. */
int32_t fa_plan_forward(const fa_forward_args *args, fa_plan *plan, fa_status *st);

/* Pointer-dependent, so checked on every call (fa_forward_execute), cached plan or not: the outputs
 * (out, lse and, with_workspace, the validated workspace) overlap neither each other nor q, k, v,
 * mask, nor themselves. */
int32_t fa_plan_check_forward_aliases(const fa_forward_args *a, int32_t with_workspace, fa_status *st);

/* 32-bit registers per lane of one 8x8 operand fragment (Q, K, V, dO and the tiles they multiply,
 * metal/fa_fragments.h) for dtype on gpu: 1 for half, and bfloat where gpu has bfloat fragments;
 * 2 for float. */
int32_t fa_plan_operand_registers(int32_t dtype, const fa_gpu_profile *gpu);
/* Macro FA_BFLOAT_FRAGMENTS for a tiled kernel of dtype on gpu: set only where it applies, so other
 * libraries keep their keys. */
void fa_plan_set_operand_fragments(fa_plan_dispatch *d, int32_t dtype, const fa_gpu_profile *gpu);
/* The tiles for widths bd, bdv (of the padded-width table) and elements of element_bytes, on gpu. */
fa_tiles fa_plan_tiles(int32_t bd, int32_t bdv, int32_t element_bytes, const fa_gpu_profile *gpu);
/* Blocks of `width` columns covering dim (at least 1), as fa_head_blocks() in the kernels. */
int32_t fa_plan_head_blocks(int64_t dim, int32_t width);
/* The padded width of the blocks that split dim evenly into the fewest of at most max_width. */
int32_t fa_plan_block_width(int64_t dim, int32_t max_width);
/* Key tiles of t.bk keys that the query blocks of 8 t.wm rows visit, per (batch, head). */
double fa_plan_key_tiles(const fa_plan *plan, fa_tiles t);
/* Threadgroup bytes of two streamed tiles of t.bk rows, t.bd and t.bdv wide (padded rows). */
int64_t fa_plan_tile_bytes(fa_tiles t, int64_t element_bytes);

/* Visible (query, key) pairs of one (batch, query head) under the plan's band (L x S without one). */
double fa_plan_visible_pairs(const fa_plan *plan);

/* The tensor path's one padded width of both head dims, 64, 96 or 128 (E, Ev <= 128): the forward's
 * and the backward's (fa_plan_forward.c, fa_plan_backward.c). */
int32_t fa_plan_tensor_width(int64_t e, int64_t ev);

/* What keeps a call off the tensor path, forward and backward alike, as the option to change (for
 * kernel='tensor''s error), or NULL when it can run; tensor_family is fa_device_tensor_family's. */
const char *fa_plan_tensor_refusal(const fa_forward_args *a, int32_t tensor_family);

/* Whether AUTO takes the tensor path: nothing refused, planning for Apple10 on a device whose
 * tensor operations are Apple10's (the rule's reasons: "The tensor path" in fa_plan_forward.c). */
int32_t fa_plan_tensor_by_default(int32_t gpu_family, int32_t tensor_family, const char *refused);

/* A dispatch of the tensor backward's kernel `step` ("dkdv" or "dq") for `dtype` at `width`: its
 * source, function and macros (fa_plan_backward.c). */
void fa_plan_backward_tensor_dispatch(fa_plan_dispatch *d, const char *step, int32_t dtype, int32_t width);

/* Every (source, function, macros) the planner can emit, for the strict MSL check: calls visit
 * once per specialisation and stops early when visit returns non-zero. */
typedef int32_t (*fa_plan_visitor)(const fa_pipeline_key *key, void *ctx);
int32_t fa_plan_each_specialisation(fa_plan_visitor visit, void *ctx);

#ifdef __cplusplus
}
#endif
#endif
