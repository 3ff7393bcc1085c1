// Entry file of the tensor-path backward's gradient kernels (bodies in fa_backward_tensor.h),
// compiled as Metal 4. The delta pre-pass and the per-sequence table run from fa_backward.metal.
// Macros FA_DTYPE, FA_BD, FA_WM: see fa_plan_backward.c.
#include "fa_backward_tensor.h"
#include "fa_instantiate.h"

template [[host_name(
    FA_HOST_NAME("fa_backward_tensor_dkdv"))]] [[kernel]] decltype(fa_backward_tensor_dkdv<FA_DTYPE, FA_BD, FA_WM>)
    fa_backward_tensor_dkdv<FA_DTYPE, FA_BD, FA_WM>;
template [[host_name(
    FA_HOST_NAME("fa_backward_tensor_dq"))]] [[kernel]] decltype(fa_backward_tensor_dq<FA_DTYPE, FA_BD, FA_WM>)
    fa_backward_tensor_dq<FA_DTYPE, FA_BD, FA_WM>;
