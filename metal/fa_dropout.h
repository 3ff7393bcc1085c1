// Dropout of the attention probabilities, shared by every attention kernel (forward, decode, simple,
// backward) and selected by function constant FA_FC_DROPOUT (fa_params.h).
//
// The keep decision of element (batch b, query head h, query row i, key j) is a pure function of
// (seed, offset, b, h, i, j): a counter-based generator, Philox 4x32-10 (Salmon et al., SC'11; the
// generator torch and flash-attn use on GPUs), so the backward regenerates the forward's mask
// without storing it, whatever kernel, tiling or split-K either ran. The seed (Philox key) and the
// 64-bit offset are four random 32-bit words the Python layer draws from torch's generator per call
// (device buffer `rng`: seed low, high, offset low, high), read by the kernels so that no host
// synchronisation is needed to learn them.
//
// One Philox call yields four words for a 2 x 2 block of the score matrix:
//   counter = (j / 2, i / 2, low and high halves of (b * 2^32 + h) + offset), key = seed,
//   word 2 (i % 2) + (j % 2) belongs to (i, j).
// A probability is dropped when its word is below p.dropout_drop_below = round(p * 2^32); kept ones
// are multiplied by p.dropout_scale = 1 / (1 - p) (SDPA's and flash-attn's scaling). Softmax
// statistics (and so lse) are those of the undropped probabilities. Backward: with M the keep
// mask scaled by 1 / (1 - p), O = (P o M) V, so dV = (P o M)^T dO, dP = (dO V^T) o M and
// dS = P o (dP - D), where D = rowsum(dP o P) = rowsum(dO o O) still holds for the dropped O.
#ifndef FA_DROPOUT_H
#define FA_DROPOUT_H

#include <metal_stdlib>
#include "fa_params.h"

constant int fa_dropout_mode [[function_constant(FA_FC_DROPOUT)]];

// Whether probabilities are dropped in what a kernel accumulates (FA_DROPOUT_APPLY).
inline bool fa_dropout_applies() { return fa_dropout_mode == FA_DROPOUT_APPLY; }

// A call's generator state: the Philox key and the counter offset (see the top of this file).
struct fa_dropout_rng {
  uint2 seed;
  uint2 offset;
};

// The call's state from the kernel's rng buffer; not read unless dropout is on.
inline fa_dropout_rng fa_dropout_state(const device uint *rng) {
  fa_dropout_rng r;
  const bool on = fa_dropout_mode != FA_DROPOUT_NONE;
  r.seed = on ? uint2(rng[0], rng[1]) : uint2(0u);
  r.offset = on ? uint2(rng[2], rng[3]) : uint2(0u);
  return r;
}

// Philox 4x32 with 10 rounds (Random123's philox4x32_10).
inline uint4 fa_philox4x32_10(uint4 counter, uint2 key) {
  for (int round = 0; round < 10; ++round) {
    const uint hi0 = metal::mulhi(0xD2511F53u, counter.x);
    const uint lo0 = 0xD2511F53u * counter.x;
    const uint hi1 = metal::mulhi(0xCD9E8D57u, counter.z);
    const uint lo1 = 0xCD9E8D57u * counter.z;
    counter = uint4(hi1 ^ counter.y ^ key.x, lo1, hi0 ^ counter.w ^ key.y, lo0);
    key += uint2(0x9E3779B9u, 0xBB67AE85u);
  }
  return counter;
}

// The four words of the 2 x 2 block holding (i, j) of (b, h).
inline uint4 fa_dropout_block(fa_dropout_rng r, long b, long h, int i, int j) {
  const uint head_lo = uint(h) + r.offset.x;
  const uint head_hi = uint(b) + r.offset.y + (head_lo < r.offset.x ? 1u : 0u); // carry of the 64-bit add
  return fa_philox4x32_10(uint4(uint(j) >> 1, uint(i) >> 1, head_lo, head_hi), r.seed);
}

// The word of (i, j) within its block.
inline uint fa_dropout_word_of(uint4 block, int i, int j) { return block[2 * (i & 1) + (j & 1)]; }

// What a probability with this word is multiplied by: 0 (dropped) or 1 / (1 - p).
inline float fa_dropout_factor_of(constant fa_params &p, uint word) {
  return word < p.dropout_drop_below ? 0.0f : p.dropout_scale;
}

// The factor of one element; 1 without dropout.
inline float fa_dropout_factor(constant fa_params &p, fa_dropout_rng r, long b, long h, int i, int j) {
  if (!fa_dropout_applies()) {
    return 1.0f;
  }
  return fa_dropout_factor_of(p, fa_dropout_word_of(fa_dropout_block(r, b, h, i, j), i, j));
}

// The factors of two neighbours along one axis, (i, j) and (i, j + 1) (along_keys) or (i, j) and
// (i + 1, j): one Philox call when the pair shares a block, two when it straddles blocks.
inline float2
fa_dropout_factor_pair(constant fa_params &p, fa_dropout_rng r, long b, long h, int i, int j, bool along_keys) {
  if (!fa_dropout_applies()) {
    return float2(1.0f);
  }
  const int i1 = along_keys ? i : i + 1;
  const int j1 = along_keys ? j + 1 : j;
  const uint4 first = fa_dropout_block(r, b, h, i, j);
  const bool shared = along_keys ? (j & 1) == 0 : (i & 1) == 0;
  const uint4 second = shared ? first : fa_dropout_block(r, b, h, i1, j1);
  return float2(fa_dropout_factor_of(p, fa_dropout_word_of(first, i, j)),
                fa_dropout_factor_of(p, fa_dropout_word_of(second, i1, j1)));
}

// Dropout over NB fragments of a query-side tile (forward, dQ), in place: the lane's row is `row`,
// its elements e of fragment f are keys key0 + 8 f + e (fa_fragments.h's layout).
template <int NB, typename F>
inline void
fa_dropout_frags(constant fa_params &p, fa_dropout_rng r, thread F *frags, long b, long h, int row, int key0) {
  if (!fa_dropout_applies()) {
    return;
  }
  for (int f = 0; f < NB; ++f) {
    const float2 factor = fa_dropout_factor_pair(p, r, b, h, row, key0 + 8 * f, true);
    frags[f].thread_elements()[0] *= factor.x;
    frags[f].thread_elements()[1] *= factor.y;
  }
}

// The probability pass (FA_DROPOUT_PROBS, the simple kernel): probability `prob` of (i, j) as
// flash-attn's return_attn_probs shows it, negated where dropout drops it.
inline float
fa_dropout_signed_probability(constant fa_params &p, fa_dropout_rng r, long b, long h, int i, int j, float prob) {
  const uint word = fa_dropout_word_of(fa_dropout_block(r, b, h, i, j), i, j);
  return word < p.dropout_drop_below ? -prob : prob;
}

#endif
