// Entry file of the FlashAttention-2 forward kernel (body in fa_forward.h). The planner specialises
// it with macros FA_BD, FA_BDV, FA_BK, FA_WM (see fa_plan.c for the table and why each entry fits)
// and function constants FA_FC_CAUSAL, FA_FC_WRITE_LSE.
#include "fa_forward.h"

#define FA_INSTANTIATE(T)                                                                           \
  template [[host_name("fa_forward_" #T)]] [[kernel]] decltype(fa_forward<T, FA_BD, FA_BDV, FA_BK, FA_WM>) \
      fa_forward<T, FA_BD, FA_BDV, FA_BK, FA_WM>;

FA_INSTANTIATE(float)
FA_INSTANTIATE(half)
#if defined(__HAVE_BFLOAT__)
FA_INSTANTIATE(bfloat)
#endif
