// Entry file of the tensor-path prefill forward (body in fa_forward_tensor.h), Metal 4. The planner
// specialises it with macros FA_DTYPE (half or bfloat), FA_BD, FA_BK, FA_WM (fa_plan_forward.c, "The
// tensor path") and the forward's function constants.
#include "fa_forward_tensor.h"
#include "fa_instantiate.h"

template [[host_name(
    FA_HOST_NAME("fa_forward_tensor"))]] [[kernel]] decltype(fa_forward_tensor<FA_DTYPE, FA_BD, FA_BK, FA_WM>)
    fa_forward_tensor<FA_DTYPE, FA_BD, FA_BK, FA_WM>;
template [[host_name(
    FA_HOST_NAME("fa_sequence_table"))]] [[kernel]] decltype(fa_sequence_table<FA_DTYPE>) fa_sequence_table<FA_DTYPE>;
