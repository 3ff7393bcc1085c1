// Entry file of the decode kernel and its split-K merge (bodies in fa_decode.h and
// fa_decode_merge.h). The planner specialises it with macros FA_DECODE_COLS and FA_DECODE_ROWS
// (see fa_plan.c for how it picks them) and function constants FA_FC_CAUSAL, FA_FC_WRITE_LSE.
#include "fa_decode.h"
#include "fa_decode_merge.h"

#define FA_INSTANTIATE(T)                                                                                     \
  template [[host_name("fa_decode_" #T)]] [[kernel]] decltype(fa_decode<T, FA_DECODE_COLS, FA_DECODE_ROWS>)   \
      fa_decode<T, FA_DECODE_COLS, FA_DECODE_ROWS>;                                                           \
  template [[host_name("fa_decode_merge_" #T)]] [[kernel]] decltype(fa_decode_merge<T, FA_DECODE_COLS>)       \
      fa_decode_merge<T, FA_DECODE_COLS>;

FA_INSTANTIATE(float)
FA_INSTANTIATE(half)
#if defined(__HAVE_BFLOAT__)
FA_INSTANTIATE(bfloat)
#endif
