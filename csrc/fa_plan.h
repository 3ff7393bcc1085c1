/* Planning: validate a forward call, choose the kernel and its specialisation, tiles and grid.
 * Pure C with no backend knowledge: the result is a pipeline key plus dispatch geometry and the
 * kernel arguments (fa_params), which fa_forward.c hands to whichever backend runs it. */
#ifndef FA_PLAN_H
#define FA_PLAN_H

#include "fa_backend.h"
#include "../metal/fa_params.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { FA_MAX_PLAN_DISPATCHES = 2 };

/* What one dispatch costs, so a timing turns into utilisation and bandwidth (explain_plan; the
 * planner fills it, fa_plan.c says how each figure is counted). Masks are not looked into: keys an
 * attn_mask hides count as visible. */
typedef struct fa_dispatch_cost {
    int64_t threadgroup_bytes;  /* kernel-scope threadgroup memory of one threadgroup */
    int32_t registers;          /* 32-bit registers per thread the configuration budgets for its arrays */
    double flops;               /* 2 x multiply-adds the kernel issues, padding of dims, rows and tiles included */
    double tiles;               /* key tiles the threadgroups visit (forward); scores computed (simple, decode) */
    double useful_flops;        /* 2 (E + Ev) per visible (query, key) pair: SDPA's own work */
    int64_t min_bytes_read;     /* device bytes the dispatch must read at least (each input element once) */
    int64_t min_bytes_written;  /* device bytes it writes */
} fa_dispatch_cost;

/* One kernel launch of a plan. */
typedef struct fa_plan_dispatch {
    char source_name[48];
    char function[64];
    fa_macro macros[FA_MAX_MACROS];
    uint32_t n_macros;
    fa_constant constants[FA_MAX_CONSTANTS];
    uint32_t n_constants;
    uint32_t grid[3];
    uint32_t threadgroup[3];
    uint64_t threadgroup_bytes[FA_MAX_TG_ARGS];
    uint32_t n_threadgroup_args;
    fa_dispatch_cost cost;
} fa_plan_dispatch;

/* Dispatches run in order on one stream (a split decode: partial results, then their merge); all
 * of them bind the same buffers and the same fa_params (fa_forward.c). */
typedef struct fa_plan {
    fa_plan_dispatch dispatches[FA_MAX_PLAN_DISPATCHES];
    uint32_t n_dispatches;
    int32_t empty;           /* nothing to launch (L == 0 or an empty batch): the output is empty too */
    int32_t banded;          /* FA_FC_BAND: causal or a window limits each row's keys (params.band_lo/hi) */
    int64_t workspace_bytes; /* scratch the dispatches share (fa_forward_workspace_bytes) */
    fa_params params;
    int32_t sequences;                  /* FA_FC_SEQUENCES: a sequence table (fa_sequence.h) */
    fa_plan_dispatch sequence_builder;  /* with sequences: the table kernel, run before the dispatches */
} fa_plan;

/* Validate every descriptor of args except the workspace, and plan the launches. */
int32_t fa_plan_forward(const fa_forward_args *args, fa_plan *plan, fa_status *st);

/* Checks that a plan needing workspace_bytes has a valid float32 workspace of at least that. */
int32_t fa_plan_check_workspace(int64_t workspace_bytes, const fa_tensor *workspace, fa_status *st);

/* Pointer-dependent, so checked on every call (fa_forward_execute), cached plan or not: the outputs
 * (out, lse and, with_workspace, the validated workspace) overlap neither each other nor q, k, v,
 * mask, nor themselves. */
int32_t fa_plan_check_forward_aliases(const fa_forward_args *a, int32_t with_workspace, fa_status *st);

/* The alias check of a direction's slots (fa_tensor_slots): its outputs against each other and
 * its inputs (the workspace only with_workspace). */
int32_t fa_check_slot_aliases(const void *args, int32_t direction, int32_t with_workspace, fa_status *st);

/* The same for the backward: dq, dk, dv, delta against each other and every input (called by
 * fa_plan_backward and, for a cached plan, by fa_backward_prepare). */
int32_t fa_plan_check_backward_aliases(const fa_backward_args *a, fa_status *st);

/* The pipeline key of one dispatch (pointers into it). */
/* A dispatch's grid (threadgroups) and 1-D threadgroup size. */
void fa_plan_set_geometry(fa_plan_dispatch *d, uint32_t x, uint32_t y, uint32_t z, uint32_t threads);

fa_pipeline_key fa_plan_pipeline_key(const fa_plan_dispatch *dispatch);

/* The tiled kernels (forward, dK/dV, dQ): FA_FC_CONTIGUOUS_TILES for the two operands a dispatch
 * streams through threadgroup memory (a, b), and its grid of ceil(rows / rows_per_block) blocks
 * per (head, batch), ordered heaviest first under the causal mask (metal/fa_schedule.h). */
enum { FA_CONTIGUOUS_MAX_ROW_STRIDE = (1 << 23) }; /* (32 tile rows + 128 threads) x 2^23 < 2^31 */
void fa_plan_set_contiguous_tiles(fa_plan_dispatch *d, const fa_tensor *a, const fa_tensor *b, int32_t device);
void fa_plan_set_block_grid(fa_plan_dispatch *d, int64_t rows, int64_t rows_per_block, uint32_t heads, uint32_t batch,
                            int32_t banded, uint32_t threads);

/* The tiled kernels' specialisation (macros FA_BD, FA_BDV, FA_BK, FA_WM; fa_plan.c has the table):
 * tile widths of the E and Ev sides, keys (or queries) per tile, SIMD-groups per threadgroup. A
 * head dim above its width is blocked along D (metal/fa_head_blocks.h). */
typedef struct fa_tiles {
    int32_t bd, bdv, bk, wm;
} fa_tiles;
/* The tiles for widths bd, bdv (of the padded-width table) and elements of element_bytes. */
fa_tiles fa_plan_tiles(int32_t bd, int32_t bdv, int32_t element_bytes);
void fa_plan_set_tile_macros(fa_plan_dispatch *d, fa_tiles t);
/* Blocks of `width` columns covering dim (at least 1), as fa_head_blocks() in the kernels. */
int32_t fa_plan_head_blocks(int64_t dim, int32_t width);
/* The padded width of the blocks that split dim evenly into the fewest of at most max_width. */
int32_t fa_plan_block_width(int64_t dim, int32_t max_width);
/* Key tiles of t.bk keys that the query blocks of 8 t.wm rows visit, per (batch, head). */
double fa_plan_key_tiles(const fa_plan *plan, fa_tiles t);
/* Threadgroup bytes of two streamed tiles of t.bk rows, t.bd and t.bdv wide (padded rows). */
int64_t fa_plan_tile_bytes(fa_tiles t, int64_t element_bytes);
/* Fails unless a grid axis of heads x column_blocks threadgroups fits 32 bits. */
int32_t fa_plan_check_column_grid(int64_t heads, int32_t column_blocks, fa_status *st);

/* Helpers the backward planner (fa_backward_plan.c) shares with the forward's. */
const char *fa_dtype_name(int32_t dtype);        /* "float32", ... for messages */
int64_t fa_dtype_bytes(int32_t dtype);          /* bytes per element */
const char *fa_kernel_type_name(int32_t dtype);  /* the MSL type kernels are instantiated for */
void fa_describe_shape(const fa_tensor *t, char *out, size_t len); /* "(2, 8, 128, 64)" */
/* Visible (query, key) pairs of one (batch, query head) under the plan's band (L x S without one). */
double fa_plan_visible_pairs(const fa_plan *plan);
/* A descriptor is usable when its rank and dtype are as expected (float32 when float32_only) and
 * every element it addresses lies inside its storage. */
int32_t fa_check_tensor(const fa_tensor *t, const char *name, int32_t ndim, int32_t float32_only, fa_status *st);
/* The first n_outputs of n_views validated views are written: none may overlap itself, another
 * output or an input (threads run in no order). Fails with FA_ERR_VALUE naming the pair. */
int32_t fa_check_no_alias(const fa_tensor *const *views, const char *const *names, int32_t n_views,
                          int32_t n_outputs, fa_status *st);

/* The backward pass: three dispatches of fa_backward.metal, in this order, binding the same
 * buffers and fa_backward_params (fa_backward.c). A dispatch whose grid is empty is skipped. */
enum { FA_BACKWARD_DELTA = 0, FA_BACKWARD_DKDV = 1, FA_BACKWARD_DQ = 2, FA_BACKWARD_DISPATCHES = 3 };

typedef struct fa_backward_plan {
    fa_plan_dispatch dispatches[FA_BACKWARD_DISPATCHES];
    fa_backward_params params;
    int32_t sequences;
    fa_plan_dispatch sequence_builder; /* as fa_plan's */
} fa_backward_plan;

extern const char fa_backward_source[];

/* Validate every descriptor of args and plan the three launches. */
int32_t fa_plan_backward(const fa_backward_args *args, fa_backward_plan *plan, fa_status *st);

/* Every (source, function, macros) the planner can emit, for the strict MSL check: calls visit
 * once per specialisation and stops early when visit returns non-zero. */
typedef int32_t (*fa_plan_visitor)(const fa_pipeline_key *key, void *ctx);
int32_t fa_plan_each_specialisation(fa_plan_visitor visit, void *ctx);

#ifdef __cplusplus
}
#endif
#endif
