// Score variants shared by every attention kernel (forward, decode, simple, backward), each
// selected by a function constant so kernels without it pay nothing once Metal folds the branch.
// Applied in flash-attn's order to the scaled score, in the base-2 domain the kernels use
// (s2 = log2(e) * scale * q.k), before any mask or band:
//   softcap: s2 <- c2 * tanh(s2 / c2), c2 = log2(e) * softcap (p.softcap_log2), i.e. the natural
//            score s becomes softcap * tanh(s / softcap); the backward multiplies each score's
//            gradient by the derivative 1 - tanh^2 = 1 - (capped / c2)^2.
//   ALiBi:   s2 <- s2 - log2(e) * slope(b, h) * |i + p.diagonal - j| for query i and key j (the
//            slopes get no gradient, as in flash-attn).
#ifndef FA_VARIANTS_H
#define FA_VARIANTS_H

#include <metal_stdlib>
#include "fa_params.h"

constant bool fa_softcap [[function_constant(FA_FC_SOFTCAP)]];
constant bool fa_alibi [[function_constant(FA_FC_ALIBI)]];

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

#endif
