// The backward pre-pass: D_i = rowsum(dO_i * O_i) in float32, one row per SIMD-group.
//
// D is the softmax term of every row's score gradient, dS_ij = P_ij (dP_ij - D_i); computing it
// once here saves both gradient kernels from reading O, and lets the dK/dV kernel read it per
// query tile. Under attention sinks it also writes each row's term of the sinks' gradient.
#ifndef FA_BACKWARD_DELTA_H
#define FA_BACKWARD_DELTA_H

#include <metal_stdlib>
#include "fa_params.h"
#include "fa_sequence.h"
#include "fa_variants.h"

using namespace metal;

template <typename T>
[[kernel, max_total_threads_per_threadgroup(32 * FA_BACKWARD_DELTA_ROWS)]] void
fa_backward_delta(const device T *out [[buffer(FA_BACKWARD_BUFFER_OUT)]],
                  const device T *dout [[buffer(FA_BACKWARD_BUFFER_DOUT)]],
                  const device float *lse [[buffer(FA_BACKWARD_BUFFER_LSE)]],
                  device float *delta [[buffer(FA_BACKWARD_BUFFER_DELTA)]],
                  constant fa_backward_params &p [[buffer(FA_BACKWARD_BUFFER_PARAMS)]],
                  const device float *sinks [[buffer(FA_BACKWARD_BUFFER_SINKS)]],
                  device float *sink_grad [[buffer(FA_BACKWARD_BUFFER_SINK_GRAD)]],
                  uint3 group [[threadgroup_position_in_grid]],
                  ushort sg [[simdgroup_index_in_threadgroup]],
                  ushort lane [[thread_index_in_simdgroup]]) {
  constant fa_params &f = p.forward;
  const long b = group.z;
  const long h = group.y;
  const int row = int(group.x) * FA_BACKWARD_DELTA_ROWS + int(sg);
  if (row >= (fa_sequences ? f.seq_q_rows : f.q_len)) { // with sequences: every row of q's view
    return; // a whole SIMD-group leaves: no collective below sees a partial group
  }
  const device T *o_row = out + b * f.o_strides[0] + h * f.o_strides[1] + long(row) * f.o_strides[2];
  const device T *do_row = dout + b * p.do_strides[0] + h * p.do_strides[1] + long(row) * p.do_strides[2];
  float sum = 0.0f;
  for (int c = int(lane); c < f.v_head_dim; c += 32) {
    sum += float(do_row[c * p.do_strides[3]]) * float(o_row[c * f.o_strides[3]]);
  }
  sum = simd_sum(sum);
  if (lane == 0) {
    delta[b * p.delta_strides[0] + h * p.delta_strides[1] + long(row) * p.delta_strides[2]] = sum;
    if (fa_sinks) {
      const float row_lse = lse[b * f.lse_strides[0] + h * f.lse_strides[1] + long(row) * f.lse_strides[2]];
      sink_grad[b * p.sink_grad_strides[0] + h * p.sink_grad_strides[1] + long(row) * p.sink_grad_strides[2]] =
          fa_sink_gradient_term(f, sinks, h, row_lse, sum);
    }
  }
}

#endif
