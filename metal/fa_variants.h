// Score variants shared by every attention kernel (forward, decode, simple, backward), each
// selected by a function constant so kernels without it pay nothing once Metal folds the branch.
// Applied in flash-attn's order to the scaled score, in the base-2 domain the kernels use
// (s2 = log2(e) * scale * q.k), before any mask or band:
//   softcap: s2 <- c2 * tanh(s2 / c2), c2 = log2(e) * softcap (p.softcap_log2), i.e. the natural
//            score s becomes softcap * tanh(s / softcap); the backward multiplies each score's
//            gradient by the derivative 1 - tanh^2 = 1 - (capped / c2)^2.
#ifndef FA_VARIANTS_H
#define FA_VARIANTS_H

#include <metal_stdlib>
#include "fa_params.h"

constant bool fa_softcap [[function_constant(FA_FC_SOFTCAP)]];

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

// The softcap over NB score fragments of a tile (the tiled kernels), in place.
template <int NB, typename F>
inline void fa_softcap_frags(constant fa_params &p, thread F *frags) {
  if (!fa_softcap) {
    return;
  }
  for (int j = 0; j < NB; ++j) {
    for (int e = 0; e < 2; ++e) {
      frags[j].thread_elements()[e] = fa_softcap_score(p, frags[j].thread_elements()[e]);
    }
  }
}

#endif
