// Entry file of the backward pass (bodies in fa_backward_delta.h, fa_backward_dkdv.h,
// fa_backward_dq.h), run in that order. The planner specialises it exactly like the forward kernel
// (macros FA_BD, FA_BDV, FA_BK, FA_WM from the forward's tile table, function constant
// FA_FC_CAUSAL); see fa_backward_plan.c.
#include "fa_backward_delta.h"
#include "fa_backward_dkdv.h"
#include "fa_backward_dq.h"

#define FA_INSTANTIATE(T)                                                                                    \
  template [[host_name("fa_backward_delta_" #T)]] [[kernel]] decltype(fa_backward_delta<T>)                  \
      fa_backward_delta<T>;                                                                                  \
  template [[host_name("fa_backward_dkdv_" #T)]] [[kernel]] decltype(fa_backward_dkdv<T, FA_BD, FA_BDV, FA_BK, FA_WM>) \
      fa_backward_dkdv<T, FA_BD, FA_BDV, FA_BK, FA_WM>;                                                     \
  template [[host_name("fa_backward_dq_" #T)]] [[kernel]] decltype(fa_backward_dq<T, FA_BD, FA_BDV, FA_BK, FA_WM>) \
      fa_backward_dq<T, FA_BD, FA_BDV, FA_BK, FA_WM>;

FA_INSTANTIATE(float)
FA_INSTANTIATE(half)
#if defined(__HAVE_BFLOAT__)
FA_INSTANTIATE(bfloat)
#endif
