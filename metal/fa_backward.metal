// Entry file of the backward pass (bodies in fa_backward_delta.h, fa_backward_dkdv.h,
// fa_backward_dq.h), run in that order; under an additive mask the block classes
// (fa_mask_blocks.h) are written between D and dK/dV. The planner specialises it exactly like the forward kernel
// (macros FA_DTYPE, FA_BD, FA_BDV, FA_BK, FA_WM from the forward's tile table, function constant
// FA_FC_BAND); see fa_plan_backward.c.
#include "fa_backward_delta.h"
#include "fa_backward_dkdv.h"
#include "fa_backward_dq.h"
#include "fa_instantiate.h"
#include "fa_mask_blocks.h"

template [[host_name(
    FA_HOST_NAME("fa_backward_delta"))]] [[kernel]] decltype(fa_backward_delta<FA_DTYPE>) fa_backward_delta<FA_DTYPE>;
template [[host_name(
    FA_HOST_NAME("fa_backward_dkdv"))]] [[kernel]] decltype(fa_backward_dkdv<FA_DTYPE, FA_BD, FA_BDV, FA_BK, FA_WM>)
    fa_backward_dkdv<FA_DTYPE, FA_BD, FA_BDV, FA_BK, FA_WM>;
template [[host_name(
    FA_HOST_NAME("fa_backward_dq"))]] [[kernel]] decltype(fa_backward_dq<FA_DTYPE, FA_BD, FA_BDV, FA_BK, FA_WM>)
    fa_backward_dq<FA_DTYPE, FA_BD, FA_BDV, FA_BK, FA_WM>;
template [[host_name(FA_HOST_NAME("fa_backward_mask_blocks"))]] [[kernel]] decltype(fa_backward_mask_blocks<FA_DTYPE>)
    fa_backward_mask_blocks<FA_DTYPE>;
template [[host_name(
    FA_HOST_NAME("fa_sequence_table"))]] [[kernel]] decltype(fa_sequence_table<FA_DTYPE>) fa_sequence_table<FA_DTYPE>;
