/* What a plan is made of and the helpers every planner builds it with: a dispatch's source,
 * function, macros, function constants, geometry and cost. No planning decisions here. */
#ifndef FA_PLAN_BUILD_H
#define FA_PLAN_BUILD_H

#include "fa_validate.h"
#include "../metal/fa_params.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FA_BACKWARD_SOURCE "fa_backward.metal"

enum { FA_MAX_PLAN_DISPATCHES = 2 };

/* What one dispatch costs, so a timing turns into utilisation and bandwidth (explain_plan; the
 * planner fills it, fa_plan_forward.c and fa_plan_backward.c say how each figure is counted). Masks are not looked into: keys an
 * attn_mask hides count as visible. */
typedef struct fa_dispatch_cost {
    int64_t threadgroup_bytes; /* kernel-scope threadgroup memory of one threadgroup */
    int32_t registers;         /* 32-bit registers per thread the configuration budgets for its arrays */
    double flops;              /* 2 x multiply-adds the kernel issues, padding of dims, rows and tiles included */
    double tiles;              /* key tiles the threadgroups visit (forward); scores computed (simple, decode) */
    double useful_flops;       /* 2 (E + Ev) per visible (query, key) pair: SDPA's own work */
    int64_t min_bytes_read;    /* device bytes the dispatch must read at least (each input element once) */
    int64_t min_bytes_written; /* device bytes it writes */
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
    double issue_slots; /* SIMD-group instructions it issues, as modelled (decode only; 0: not modelled) */
} fa_plan_dispatch;

/* A dispatch's grid (threadgroups) and 1-D threadgroup size. */
void fa_plan_set_geometry(fa_plan_dispatch *d, uint32_t x, uint32_t y, uint32_t z, uint32_t threads);

/* The pipeline key of one dispatch (pointers into it). */
fa_pipeline_key fa_plan_pipeline_key(const fa_plan_dispatch *dispatch);

/* Names function `<kernel>_<type>` of `source` and instantiates the library for that element type
 * only (FA_DTYPE, metal/fa_instantiate.h): every dispatch starts here. */
void fa_plan_start_dispatch(fa_plan_dispatch *d, const char *source, const char *kernel, int32_t dtype);
/* Function constants and macros; one already set is replaced. */
void fa_plan_add_constant(fa_plan_dispatch *d, uint32_t index, int32_t kind, int64_t value);
void fa_plan_add_constant_bool(fa_plan_dispatch *d, uint32_t index, int32_t value);
void fa_plan_add_constant_int(fa_plan_dispatch *d, uint32_t index, int32_t value);
void fa_plan_add_macro_text(fa_plan_dispatch *d, const char *name, const char *value);
void fa_plan_add_macro(fa_plan_dispatch *d, const char *name, int32_t value);
/* The first n strides of t, into the kernel arguments. */
void fa_plan_copy_strides(fa_i64 *dst, const fa_tensor *t, int32_t n);

/* The tiled kernels (forward, dK/dV, dQ): FA_FC_CONTIGUOUS_TILES for the two operands a dispatch
 * streams through threadgroup memory (a, b), and its grid of ceil(rows / rows_per_block) blocks
 * per (head, batch), ordered heaviest first under the causal mask (metal/fa_schedule.h). */
enum { FA_CONTIGUOUS_MAX_ROW_STRIDE = (1 << 23) }; /* (32 tile rows + 128 threads) x 2^23 < 2^31 */
void fa_plan_set_contiguous_tiles(fa_plan_dispatch *d, const fa_tensor *a, const fa_tensor *b, int32_t device);
void fa_plan_set_block_grid(fa_plan_dispatch *d, int64_t rows, int64_t rows_per_block, uint32_t heads, uint32_t batch,
                            int32_t banded, uint32_t threads);

/* The tiled kernels' specialisation (macros FA_BD, FA_BDV, FA_BK, FA_WM; fa_plan_forward.c has the table):
 * tile widths of the E and Ev sides, keys (or queries) per tile, SIMD-groups per threadgroup. A
 * head dim above its width is blocked along D (metal/fa_head_blocks.h). */
typedef struct fa_tiles {
    int32_t bd, bdv, bk, wm;
} fa_tiles;
void fa_plan_set_tile_macros(fa_plan_dispatch *d, fa_tiles t);
/* FA_FC_EXACT_HEAD_DIMS: whether head dims e and ev are exactly the tiles' widths, so the kernel
 * folds its head-dim guards and its streamed path away (metal/fa_head_blocks.h). */
void fa_plan_set_exact_head_dims(fa_plan_dispatch *d, fa_tiles t, int64_t e, int64_t ev);

/* Fails unless a grid axis of heads x column_blocks threadgroups fits 32 bits. */
int32_t fa_plan_check_column_grid(int64_t heads, int32_t column_blocks, fa_status *st);

#ifdef __cplusplus
}
#endif
#endif
