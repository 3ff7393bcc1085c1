// attn_mask inside the kernels, read through its strides (a broadcast mask is never expanded in
// memory). The mask's dtype is a function constant rather than a template parameter, so one
// library serves every mask type and the unmasked case pays nothing once Metal folds the branches.
#ifndef FA_MASK_H
#define FA_MASK_H

#include <metal_stdlib>
#include "fa_params.h"

// Element offset of mask[b, h, i, j].
inline long fa_mask_offset(constant fa_params &p, long b, long h, long i, long j) {
  return b * p.mask_strides[0] + h * p.mask_strides[1] + i * p.mask_strides[2] + j * p.mask_strides[3];
}

// A bool mask that excludes the key: the kernels skip it, as SDPA gives it weight 0.
inline bool fa_mask_excludes(const device uchar *mask, long offset) {
  return fa_mask_kind == FA_MASK_BOOL && mask[offset] == 0;
}

// The base-2 score after the mask: -inf where a bool mask excludes the key, plus the additive
// mask (scaled by log2(e), as scores are) otherwise.
inline float fa_mask_score(float score, const device uchar *mask, long offset) {
  const float log2e = 1.4426950408889634f;
  switch (fa_mask_kind) {
  case FA_MASK_BOOL:
    return mask[offset] != 0 ? score : -INFINITY;
  case FA_MASK_FLOAT:
    return score + ((const device float *)mask)[offset] * log2e;
  case FA_MASK_HALF:
    return score + float(((const device half *)mask)[offset]) * log2e;
#if defined(__HAVE_BFLOAT__)
  case FA_MASK_BFLOAT:
    return score + float(((const device bfloat *)mask)[offset]) * log2e;
#endif
  default:
    return score;
  }
}

#endif
