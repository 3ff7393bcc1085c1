// Entry file of the FlashAttention-2 forward kernel (body in fa_forward.h). The planner specialises
// it with macros FA_DTYPE (fa_instantiate.h), FA_BD, FA_BDV, FA_BK, FA_WM (see fa_plan_forward.c for the
// table and why each entry fits) and function constants FA_FC_BAND, FA_FC_WRITE_LSE. Under an additive mask the
// block-class pre-pass (fa_mask_blocks.h) runs first, from the same library.
#include "fa_forward.h"
#include "fa_instantiate.h"

template
    [[host_name(FA_HOST_NAME("fa_forward"))]] [[kernel]] decltype(fa_forward<FA_DTYPE, FA_BD, FA_BDV, FA_BK, FA_WM>)
        fa_forward<FA_DTYPE, FA_BD, FA_BDV, FA_BK, FA_WM>;
// The host name stays whole on one line, where tools look for it.
// clang-format off
template [[host_name(FA_HOST_NAME("fa_forward_mask_blocks"))]] [[kernel]] decltype(fa_forward_mask_blocks<FA_DTYPE>)
    fa_forward_mask_blocks<FA_DTYPE>;
// clang-format on
template [[host_name(
    FA_HOST_NAME("fa_sequence_table"))]] [[kernel]] decltype(fa_sequence_table<FA_DTYPE>) fa_sequence_table<FA_DTYPE>;
