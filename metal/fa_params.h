// Kernel arguments shared by the C core (which fills them) and the Metal kernels (which read them
// as `constant fa_params&`). Plain fixed-size fields only, so C and MSL agree on the layout.
#ifndef FA_PARAMS_H
#define FA_PARAMS_H

#ifdef __METAL_VERSION__
typedef long fa_i64;
typedef int fa_i32;
#else
#include <stdint.h>
typedef int64_t fa_i64;
typedef int32_t fa_i32;
#endif

// The simple kernel's geometry (fa_simple.metal).
#define FA_SIMPLE_ROWS_PER_GROUP 4 // query rows (SIMD-groups) per threadgroup
#define FA_SIMPLE_MAX_PER_LANE 8   // columns per lane: head dims up to 256

// Function-constant indices (specialisation at pipeline creation).
#define FA_FC_CAUSAL 0    // bool: top-left causal mask tril(ones(L, S))
#define FA_FC_WRITE_LSE 1 // bool: write the per-row log-sum-exp

typedef struct fa_params {
    fa_i32 batch;      // B
    fa_i32 q_heads;    // Hq
    fa_i32 kv_heads;   // Hkv
    fa_i32 gqa_factor; // Hq / Hkv: query head h reads kv head h / gqa_factor
    fa_i32 q_len;      // L
    fa_i32 kv_len;     // S
    fa_i32 head_dim;   // E (q and k)
    fa_i32 v_head_dim; // Ev (v and out)
    // Strides in elements, in (batch, head, row, column) order. 64-bit: views of large tensors
    // overflow 32-bit offsets.
    fa_i64 q_strides[4];
    fa_i64 k_strides[4];
    fa_i64 v_strides[4];
    fa_i64 o_strides[4];
    fa_i64 lse_strides[3]; // (batch, head, row) of the float32 log-sum-exp
    float scale_log2;      // scale * log2(e): scores live in base 2 so softmax uses exp2
    float pad0;
} fa_params;

#ifdef __METAL_VERSION__
// The kernels' view of the function constants above.
constant bool fa_causal [[function_constant(FA_FC_CAUSAL)]];
constant bool fa_write_lse [[function_constant(FA_FC_WRITE_LSE)]];
#endif

#endif
