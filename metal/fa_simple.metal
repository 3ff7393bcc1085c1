// The simple kernel: one query row per SIMD-group, online softmax, any head dim up to 576.
// It is the correctness baseline and the reference point of the benchmarks, not the fast path.
//
// Lane l keeps columns l, l + 32, ... of the query row and of the output row, so one build serves
// every head dim up to 32 * FA_SIMPLE_MAX_PER_LANE = 576 (columns past E or Ev are predicated off).
// Specialisation: macro FA_DTYPE (fa_instantiate.h) and function constants FA_FC_BAND,
// FA_FC_WRITE_LSE, FA_FC_MASK_KIND and the variants' (fa_variants.h, fa_dropout.h); under
// FA_DROPOUT_PROBS it is the probability pass of flash-attn's return_attn_probs. Grid:
// (ceil(L / FA_SIMPLE_ROWS_PER_GROUP), Hq, B) threadgroups of 32 * FA_SIMPLE_ROWS_PER_GROUP threads
// (the planner reads both constants from fa_params.h).
#include <metal_stdlib>
#include "fa_dropout.h"
#include "fa_instantiate.h"
#include "fa_mask.h"
#include "fa_params.h"
#include "fa_sequence.h"
#include "fa_softmax.h"
#include "fa_variants.h"

using namespace metal;

// Row `row`'s base-2 score of key j (whose row of K is k_row) with the variants and the mask at
// mask_at: one expression for both passes of the probability pass and for the forward.
template <typename T>
inline float fa_simple_score(constant fa_params &p,
                             thread const float (&q_reg)[FA_SIMPLE_MAX_PER_LANE],
                             const device T *k_row,
                             float slope_log2,
                             int row,
                             int j,
                             const device uchar *mask,
                             long mask_at,
                             uint lane) {
  float partial = 0.0f;
  for (int c = 0; c < FA_SIMPLE_MAX_PER_LANE; ++c) {
    const int col = int(lane) + 32 * c;
    if (col < p.head_dim) {
      partial = fma(q_reg[c], float(k_row[col * p.k_strides[3]]), partial);
    }
  }
  const float varied = fa_softcap_score(p, simd_sum(partial) * p.scale_log2) + fa_alibi_bias(p, slope_log2, row, j);
  return fa_mask_score(varied, mask, mask_at);
}

template <typename T>
[[kernel, max_total_threads_per_threadgroup(32 * FA_SIMPLE_ROWS_PER_GROUP)]] void
fa_simple(const device T *q [[buffer(FA_FORWARD_BUFFER_Q)]],
          const device T *k [[buffer(FA_FORWARD_BUFFER_K)]],
          const device T *v [[buffer(FA_FORWARD_BUFFER_V)]],
          device T *out [[buffer(FA_FORWARD_BUFFER_OUT)]],
          device float *lse [[buffer(FA_FORWARD_BUFFER_LSE)]],
          constant fa_params &params [[buffer(FA_FORWARD_BUFFER_PARAMS)]],
          device float *probs [[buffer(FA_FORWARD_BUFFER_WORKSPACE)]],
          const device uchar *mask [[buffer(FA_FORWARD_BUFFER_MASK)]],
          const device float *alibi_slopes [[buffer(FA_FORWARD_BUFFER_ALIBI)]],
          const device float *sinks [[buffer(FA_FORWARD_BUFFER_SINKS)]],
          constant fa_params *sequence_table [[buffer(FA_FORWARD_BUFFER_SEQUENCES)]],
          const device uint *rng [[buffer(FA_FORWARD_BUFFER_RNG)]],
          uint3 group [[threadgroup_position_in_grid]],
          uint simd_group [[simdgroup_index_in_threadgroup]],
          uint lane [[thread_index_in_simdgroup]]) {
  const int row = int(group.x) * FA_SIMPLE_ROWS_PER_GROUP + int(simd_group);
  const fa_i64 b = group.z;
  constant fa_params &p = fa_sequence_params(params, sequence_table, b);
  if (row >= p.q_len) {
    return; // whole SIMD-group leaves together: no collective is split
  }
  const fa_i64 h = group.y;
  const fa_i64 kv_h = h / p.gqa_factor;
  q = fa_sequence_q(q, p, b, p.q_strides);
  out = fa_sequence_q(out, p, b, p.o_strides);
  lse = fa_sequence_q(lse, p, b, p.lse_strides);
  k = fa_sequence_k(k, p, b, p.k_strides);
  v = fa_sequence_k(v, p, b, p.v_strides);

  const device T *q_row = q + b * p.q_strides[0] + h * p.q_strides[1] + row * p.q_strides[2];
  const device T *k_head = k + b * p.k_strides[0] + kv_h * p.k_strides[1];
  const device T *v_head = v + b * p.v_strides[0] + kv_h * p.v_strides[1];

  // Lane d-slices: element c of this lane is column lane + 32 * c.
  float q_reg[FA_SIMPLE_MAX_PER_LANE];
  for (int c = 0; c < FA_SIMPLE_MAX_PER_LANE; ++c) {
    const int col = int(lane) + 32 * c;
    q_reg[c] = col < p.head_dim ? float(q_row[col * p.q_strides[3]]) : 0.0f;
  }
  float acc[FA_SIMPLE_MAX_PER_LANE];
  for (int c = 0; c < FA_SIMPLE_MAX_PER_LANE; ++c) {
    acc[c] = 0.0f;
  }
  fa_online_softmax state = fa_softmax_init();
  const float slope_log2 = fa_alibi_slope(p, alibi_slopes, b, h);
  const fa_dropout_rng dropout = fa_dropout_state(rng);
  // The probability pass (FA_DROPOUT_PROBS) writes row i of the contiguous (B, Hq, L, S) float32
  // probabilities instead of attention (keys it never visits stay as the caller initialised them:
  // zeros). L and S are the grid's (the call's params): under sequences each sequence's L_b x S_b
  // probabilities are the top-left block of its (L, S) slice. It takes two passes over the keys:
  // the row's softmax, then each probability from the same scores and the row's own maximum, as
  // the forward weighs the values, so the maximal score's weight is exp2(0) whichever kernel ran
  // the forward (the scores of another kernel may differ in the last place).
  const bool probs_pass = fa_dropout_mode == FA_DROPOUT_PROBS;
  const long lse_at = b * p.lse_strides[0] + h * p.lse_strides[1] + row * p.lse_strides[2];
  device float *probs_row = probs + ((b * params.q_heads + h) * params.q_len + row) * long(params.kv_len);

  // Under the band (causal, window) row i sees keys [begin, end) only.
  const fa_range keys = fa_visible_keys(p, row, 1);
  for (int j = keys.begin; j < keys.end; ++j) {
    const long mask_at = fa_mask_offset(p, b, h, row, j);
    if (fa_mask_excludes(mask, mask_at)) {
      continue; // weight 0, and NaN in the value stays out of the row
    }
    const float score =
        fa_simple_score<T>(p, q_reg, k_head + j * p.k_strides[2], slope_log2, row, j, mask, mask_at, lane);
    const fa_softmax_step step = fa_softmax_push(state, score);
    if (probs_pass) {
      continue; // its first pass: the softmax alone
    }
    const float weight = step.weight * fa_dropout_factor(p, dropout, b, h, row, j); // the sum keeps it undropped
    const device T *v_row = v_head + j * p.v_strides[2];
    for (int c = 0; c < FA_SIMPLE_MAX_PER_LANE; ++c) {
      const int col = int(lane) + 32 * c;
      if (32 * c < p.v_head_dim) { // uniform: slices past Ev stay 0 and cost nothing
        const float v_val = col < p.v_head_dim ? float(v_row[col * p.v_strides[3]]) : 0.0f;
        acc[c] = fma(weight, v_val, acc[c] * step.rescale);
      }
    }
  }

  const float keys_max = state.max; // what acc's weights are relative to
  const float sink_rescale = fa_sink_fold(p, sinks, h, state);
  const float inv_sum = fa_softmax_inverse_sum(state) * sink_rescale;
  if (probs_pass) {
    for (int j = keys.begin; j < keys.end; ++j) {
      const long mask_at = fa_mask_offset(p, b, h, row, j);
      if (fa_mask_excludes(mask, mask_at)) {
        continue;
      }
      const float score =
          fa_simple_score<T>(p, q_reg, k_head + j * p.k_strides[2], slope_log2, row, j, mask, mask_at, lane);
      if (lane == 0) {
        const float prob = fa_softmax_weight(score, keys_max) * inv_sum;
        probs_row[j] = fa_dropout_signed_probability(p, dropout, b, h, row, j, prob);
      }
    }
    return; // out and lse are the forward's
  }
  device T *o_row = out + b * p.o_strides[0] + h * p.o_strides[1] + row * p.o_strides[2];
  for (int c = 0; c < FA_SIMPLE_MAX_PER_LANE; ++c) {
    const int col = int(lane) + 32 * c;
    if (col < p.v_head_dim) {
      o_row[col * p.o_strides[3]] = static_cast<T>(acc[c] * inv_sum);
    }
  }
  if (fa_write_lse && lane == 0) {
    lse[lse_at] = fa_softmax_lse(state);
  }
}

template [[host_name(FA_HOST_NAME("fa_simple"))]] [[kernel]] decltype(fa_simple<FA_DTYPE>) fa_simple<FA_DTYPE>;
template [[host_name(
    FA_HOST_NAME("fa_sequence_table"))]] [[kernel]] decltype(fa_sequence_table<FA_DTYPE>) fa_sequence_table<FA_DTYPE>;
