// Entry file of the decode kernel and its split-K merge (bodies in fa_decode.h and
// fa_decode_merge.h). The planner specialises it with macros FA_DTYPE (fa_instantiate.h),
// FA_DECODE_COLS and FA_DECODE_ROWS (see fa_plan_forward.c for how it picks them) and function constants
// FA_FC_BAND, FA_FC_WRITE_LSE, FA_FC_MASK_KIND.
#include "fa_decode.h"
#include "fa_decode_merge.h"
#include "fa_instantiate.h"

template
    [[host_name(FA_HOST_NAME("fa_decode"))]] [[kernel]] decltype(fa_decode<FA_DTYPE, FA_DECODE_COLS, FA_DECODE_ROWS>)
        fa_decode<FA_DTYPE, FA_DECODE_COLS, FA_DECODE_ROWS>;
template [[host_name(FA_HOST_NAME("fa_decode_merge"))]] [[kernel]] decltype(fa_decode_merge<FA_DTYPE, FA_DECODE_COLS>)
    fa_decode_merge<FA_DTYPE, FA_DECODE_COLS>;
template [[host_name(
    FA_HOST_NAME("fa_sequence_table"))]] [[kernel]] decltype(fa_sequence_table<FA_DTYPE>) fa_sequence_table<FA_DTYPE>;
