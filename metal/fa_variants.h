// Score variants shared by every attention kernel (forward, decode, simple, backward), each
// selected by a function constant so kernels without it pay nothing once Metal folds the branch.
// Applied in flash-attn's order to the scaled score, in the base-2 domain the kernels use
// (s2 = log2(e) * scale * q.k), before any mask or band:
//   softcap: s2 <- c2 * tanh(s2 / c2), c2 = log2(e) * softcap (p.softcap_log2), i.e. the natural
//            score s becomes softcap * tanh(s / softcap); the backward multiplies each score's
//            gradient by the derivative 1 - tanh^2 = 1 - (capped / c2)^2.
//   ALiBi:   s2 <- s2 - log2(e) * slope(b, h) * |i + p.diagonal - j| for query i and key j (the
//            slopes get no gradient, as in flash-attn).
// And one of the softmax itself:
//   sinks:   each row of query head h also counts exp(sink_h) in its softmax denominator, with no
//            value (GPT-OSS, StreamingLLM): folded once into a row's finished state
//            (fa_sink_fold), so lse includes it and a row that sees no key gives zeros and
//            lse = sink_h. The backward's probabilities exp(s - lse) need nothing more; the sink's
//            own gradient is -sum over rows of exp(sink_h - lse) * D (fa_sink_gradient_term).
#ifndef FA_VARIANTS_H
#define FA_VARIANTS_H

#include <metal_stdlib>
#include "fa_params.h"
#include "fa_softmax.h"

constant bool fa_softcap [[function_constant(FA_FC_SOFTCAP)]];
constant bool fa_alibi [[function_constant(FA_FC_ALIBI)]];
constant bool fa_sinks [[function_constant(FA_FC_SINKS)]];

// The ALiBi slope of (batch b, query head h) in the base-2 domain; 0 without ALiBi.
inline float fa_alibi_slope(constant fa_params &p, const device float *slopes, long b, long h) {
  return fa_alibi ? slopes[b * p.alibi_strides[0] + h * p.alibi_strides[1]] * M_LOG2E_F : 0.0f;
}

// The ALiBi bias of query row `row` and key `key` (0 without ALiBi).
inline float fa_alibi_bias(constant fa_params &p, float slope_log2, int row, int key) {
  return fa_alibi ? -slope_log2 * metal::abs(float(row + p.diagonal - key)) : 0.0f;
}

// A base-2 score after the softcap (unchanged without one).
inline float fa_softcap_score(constant fa_params &p, float score) {
  return fa_softcap ? p.softcap_log2 * metal::precise::tanh(score / p.softcap_log2) : score;
}

// d capped / d raw of a capped score (1 without a softcap): the chain rule's factor in the backward.
inline float fa_softcap_gradient(constant fa_params &p, float capped) {
  if (!fa_softcap) {
    return 1.0f;
  }
  const float t = capped / p.softcap_log2;
  return 1.0f - t * t;
}

// The variants over NB score fragments of a query-side tile (the forward), in place: the lane's
// row is `row` and its element e of fragment j is key key0 + 8 j + e.
template <int NB, typename F>
inline void fa_variant_frags(constant fa_params &p, thread F *frags, float slope_log2, int row, int key0) {
  if (!fa_softcap && !fa_alibi) {
    return;
  }
  for (int j = 0; j < NB; ++j) {
    for (int e = 0; e < 2; ++e) {
      const float capped = fa_softcap_score(p, frags[j].thread_elements()[e]);
      frags[j].thread_elements()[e] = capped + fa_alibi_bias(p, slope_log2, row, key0 + 8 * j + e);
    }
  }
}

// Folds query head h's sink into a row's finished state (over all its keys: after the last tile,
// or after the split-K merge, never once per split) and returns the factor the row's unnormalised
// output is to be multiplied by; without sinks, 1 and the state unchanged.
inline float fa_sink_fold(constant fa_params &p, const device float *sinks, long h, thread fa_online_softmax &s) {
  if (!fa_sinks) {
    return 1.0f;
  }
  fa_online_softmax sink;
  sink.max = sinks[h * p.sink_stride] * M_LOG2E_F;
  sink.sum = 1.0f;
  return fa_softmax_merge(s, sink).rescale;
}

// Row (b, h, i)'s term of d loss / d sink_h: -P_sink * D_i, where P_sink = exp(sink_h - lse_i) is the
// sink's probability and D_i = rowsum(dO_i * O_i) (a unit of sink moves the output by -P_sink * O_i).
// A row with D = 0 adds 0, even one whose sink is -inf (lse -inf too, P_sink NaN).
inline float fa_sink_gradient_term(constant fa_params &p, const device float *sinks, long h, float lse, float delta) {
  return delta == 0.0f ? 0.0f : -metal::exp(sinks[h * p.sink_stride] - lse) * delta;
}

#endif
