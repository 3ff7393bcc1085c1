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

typedef struct fa_plan {
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
    int32_t empty; /* nothing to launch (L == 0 or an empty batch): the output is empty too */
    fa_params params;
} fa_plan;

/* Validate every descriptor of args and plan the launch. */
int32_t fa_plan_forward(const fa_forward_args *args, fa_plan *plan, fa_status *st);

/* The pipeline key a plan asks for (pointers into plan). */
fa_pipeline_key fa_plan_pipeline_key(const fa_plan *plan);

/* Every (source, function, macros) the planner can emit, for the strict MSL check: calls visit
 * once per specialisation and stops early when visit returns non-zero. */
typedef int32_t (*fa_plan_visitor)(const fa_pipeline_key *key, void *ctx);
int32_t fa_plan_each_specialisation(fa_plan_visitor visit, void *ctx);

#ifdef __cplusplus
}
#endif
#endif
