// Online softmax in base 2 with SDPA's edge semantics, shared by every attention kernel.
//
// Scores arrive pre-multiplied by scale * log2(e), so exp2 replaces exp. Statistics are float32
// for every input dtype. Edge cases, as torch's SDPA:
//   - a score of -inf (a masked key) contributes weight 0, even when every score so far is -inf;
//   - a row whose every score is -inf has sum 0 and yields zeros (and log-sum-exp -inf);
//   - NaN in a score propagates to the whole row (metal::max ignores NaN, so the NaN enters
//     through the weight exp2(NaN - max) and then the sum);
//   - +inf gives exp2(inf - inf) = NaN, as softmax does.
#ifndef FA_SOFTMAX_H
#define FA_SOFTMAX_H

#include <metal_stdlib>

struct fa_online_softmax {
  float max; // running maximum of the base-2 scores
  float sum; // running sum of exp2(score - max)
};

// What one new score (or block of scores) does to the running state: multiply what was
// accumulated so far by `rescale`, add `weight` times the new value.
struct fa_softmax_step {
  float rescale;
  float weight;
};

inline fa_online_softmax fa_softmax_init() {
  fa_online_softmax s;
  s.max = -INFINITY;
  s.sum = 0.0f;
  return s;
}

// Factor that moves sums taken against old_max onto new_max (1 when unchanged, which also keeps
// -inf - -inf from producing NaN while every score is masked).
inline float fa_softmax_rescale(float old_max, float new_max) {
  return old_max == new_max ? 1.0f : metal::exp2(old_max - new_max);
}

// exp2(score - max) with masked scores (-inf) contributing exactly 0.
inline float fa_softmax_weight(float score, float max) { return score == -INFINITY ? 0.0f : metal::exp2(score - max); }

inline fa_softmax_step fa_softmax_push(thread fa_online_softmax &s, float score) {
  const float new_max = metal::max(s.max, score);
  fa_softmax_step step;
  step.rescale = fa_softmax_rescale(s.max, new_max);
  step.weight = fa_softmax_weight(score, new_max);
  s.sum = s.sum * step.rescale + step.weight;
  s.max = new_max;
  return step;
}

// Folds `part`, the state of the same row over other keys, into s (the merge of split-K partial
// results). The output accumulated with s is to be multiplied by `rescale`, the one accumulated
// with part by `weight`. A part without keys (max -inf, sum 0) changes nothing; NaN in part's
// sum propagates.
inline fa_softmax_step fa_softmax_merge(thread fa_online_softmax &s, fa_online_softmax part) {
  const float new_max = metal::max(s.max, part.max);
  fa_softmax_step step;
  step.rescale = fa_softmax_rescale(s.max, new_max);
  step.weight = fa_softmax_rescale(part.max, new_max);
  s.sum = s.sum * step.rescale + part.sum * step.weight;
  s.max = new_max;
  return step;
}

// 1/sum, or 0 for a row with no visible key (SDPA returns zeros there).
inline float fa_softmax_inverse_sum(fa_online_softmax s) { return s.sum == 0.0f ? 0.0f : 1.0f / s.sum; }

// A base-2 quantity in natural-log units. The one expression both the log-sum-exp and the
// backward's scores go through: a row whose sum is exactly 1 (a single visible key, or others too
// small to count) has lse = fa_softmax_natural(max), so its maximal score's exponent below is
// exactly 0 and its probability exactly 1.
inline float fa_softmax_natural(float base2) { return base2 * 0.693147180559945309f; } // ln(2)

// Natural-log log-sum-exp of the scaled scores: ln(sum_j exp(scale * q.k_j)).
inline float fa_softmax_lse(fa_online_softmax s) {
  return s.sum == 0.0f ? -INFINITY : fa_softmax_natural(s.max + metal::log2(s.sum));
}

// The backward pass recomputes each probability from the forward's log-sum-exp instead of keeping
// P: exp(score * ln(2) - lse), score in base 2 as above. Converting lse back to base 2 instead
// (exp2(score - lse * log2(e))) rounds it a second time, and a single visible key gets 1 off by
// some units in the last place of its score. The product is a statement of its own: a front end
// that fuses a * b - c within one expression (clang's default contraction) would leave the
// product's rounding error as the exponent (the Metal backend compiles in safe math mode, which
// Apple documents as changing no result; docs/mac-checklist.md checks it). A masked score (-inf) has probability 0 even in a row with no visible
// key, whose lse is -inf too; a padding row given lse = +inf gets 0.
inline float fa_softmax_probability(float score, float lse) {
  if (score == -INFINITY) {
    return 0.0f;
  }
  const float natural = fa_softmax_natural(score);
  return metal::exp(natural - lse);
}

#endif
