// One element type per library. The planner compiles each library for the dtype a call runs
// (macro FA_DTYPE: float, half or bfloat), so tiles sized for 2-byte elements never instantiate a
// float kernel past the 32 KiB of threadgroup memory, and a first call compiles one kernel, not
// three. Host names stay "<kernel>_<dtype>", e.g. fa_forward_half.
#ifndef FA_INSTANTIATE_H
#define FA_INSTANTIATE_H

#ifndef FA_DTYPE
#error "FA_DTYPE (float, half or bfloat) names the element type this library is compiled for"
#endif

#define FA_STRINGIFY_(x) #x
#define FA_STRINGIFY(x) FA_STRINGIFY_(x)
#define FA_HOST_NAME(kernel) kernel "_" FA_STRINGIFY(FA_DTYPE)

#endif
