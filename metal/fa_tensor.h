// Shared pieces of the tensor-path kernels (Metal 4: metal::tensor, MetalPerformancePrimitives'
// matmul2d and cooperative tensors; the forward fa_forward_tensor.h and the backward use them).
//
// Rule of the tensor path: which lane holds which element of a cooperative tensor is the GPU
// generation's business (Apple9 and Apple10 differ, and the CPU device can scramble it). These
// helpers never assume a layout: elements are reached through the API's coordinate mapping
// (is_valid_element, get_multidimensional_index), per-row values are published to threadgroup
// memory by the first lane holding a row's reduction and read back by row index, and operands in
// memory are threadgroup tiles viewed as tensors.
//
// Scope: every product here runs at execution_simdgroup, one SIMD-group owning FA_TENSOR_ROWS rows of
// the score tile, so cooperative tensors never span SIMD-groups (what a threadgroup-scope operand
// would need from the GPU is undocumented per generation; the CPU device refuses it too).
#ifndef FA_TENSOR_H
#define FA_TENSOR_H

#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>

// Query rows (or key rows, in the backward's dK/dV) one SIMD-group's score tile holds.
#define FA_TENSOR_ROWS 16

typedef metal::dextents<int, 2> fa_tensor_extents;

// A rows x cols row-major matrix at `data` (threadgroup or device memory), `pitch` elements between
// rows, as a tensor: dimension 0 is the columns (the innermost), dimension 1 the rows. Products read
// elements beyond the extents as 0 and never write them.
template <typename P>
inline auto fa_matrix_tensor(P data, int pitch, int rows, int cols) {
  return metal::tensor(data, fa_tensor_extents(cols, rows), metal::array<int, 2>{1, pitch});
}

// C (M x N) = A (M x K) * B (K x N), A or B stored transposed, or C += A * B, at one SIMD-group's
// scope, in float with a single rounding into C's type (relaxed precision off: the result must not
// depend on the generation's choice of intermediate precision).
template <int M, int N, int K, bool TRANSPOSE_LEFT, bool TRANSPOSE_RIGHT, bool ACCUMULATE>
using fa_simdgroup_matmul =
    mpp::tensor_ops::matmul2d<mpp::tensor_ops::matmul2d_descriptor(
                                  M,
                                  N,
                                  K,
                                  TRANSPOSE_LEFT,
                                  TRANSPOSE_RIGHT,
                                  false,
                                  ACCUMULATE ? mpp::tensor_ops::matmul2d_descriptor::mode::multiply_accumulate
                                             : mpp::tensor_ops::matmul2d_descriptor::mode::multiply),
                              metal::execution_simdgroup>;

// The score product S (M x N keys) = Q (M x D) K^T, K stored as its N x D rows.
template <int M, int N, int D>
using fa_scores_matmul = fa_simdgroup_matmul<M, N, D, false, true, false>;

// Applies f(value, row, col) to every element this lane holds of a cooperative tensor, through
// the API's coordinate mapping (never a lane layout).
template <typename CT, typename F>
inline void fa_tensor_map(thread CT &ct, thread const F &f) {
  for (uint16_t i = 0; i < ct.get_capacity(); ++i) {
    if (ct.is_valid_element(i)) {
      const auto at = ct.get_multidimensional_index(i);
      ct[i] = f(ct[i], int(at[1]), int(at[0]));
    }
  }
}

// Multiplies each element by its row's factor, factors[row] (threadgroup memory).
struct fa_tensor_row_factor {
  const threadgroup float *factors;
  float operator()(float value, int row, int col) const { return value * factors[row]; }
};

// Stores the rows' reductions (a row-reduction cooperative tensor of FA_TENSOR_ROWS rows) to
// rows[row]: several lanes may hold a row's value, and the first of them in lane order writes it (one
// writer per word: no two lanes store to the same address without a barrier between), then the
// SIMD-group synchronises, so every lane may read any row's value after it. Every lane calls it.
template <typename RT>
inline void fa_tensor_publish_rows(thread RT &reduced, threadgroup float *rows) {
  float held[FA_TENSOR_ROWS];
  uint holds = 0; // bit r: this lane holds row r's value
  for (uint16_t i = 0; i < reduced.get_capacity(); ++i) {
    if (reduced.is_valid_element(i)) {
      const int row = int(reduced.get_multidimensional_index(i)[0]);
      held[row] = reduced[i];
      holds |= 1u << row;
    }
  }
  for (int row = 0; row < FA_TENSOR_ROWS; ++row) {
    const uint mine = (holds >> row) & 1u;
    if (metal::simd_prefix_exclusive_sum(mine) == 0 && mine != 0) {
      rows[row] = held[row];
    }
  }
  metal::simdgroup_barrier(metal::mem_flags::mem_threadgroup);
}

// The maximum and the sum of each
// row of `ct`, the float destination of `op` with operands A and B, published to rows[]. (MPP's
// reduce_rows and matmul2d::run take their cooperative tensors and operands by non-const reference:
// pass named, non-const objects.)
template <typename A, typename B, typename Op, typename CT>
inline void fa_tensor_row_max(thread const Op &op, thread CT &ct, threadgroup float *rows) {
  auto reduced = op.template get_row_reduction_destination_cooperative_tensor<A, B, float>();
  mpp::tensor_ops::reduce_rows(ct, reduced, mpp::tensor_ops::reduction_operation::max,
                               mpp::tensor_ops::reduction_operation_identity<float>::max_identity);
  fa_tensor_publish_rows(reduced, rows);
}

template <typename A, typename B, typename Op, typename CT>
inline void fa_tensor_row_sum(thread const Op &op, thread CT &ct, threadgroup float *rows) {
  auto reduced = op.template get_row_reduction_destination_cooperative_tensor<A, B, float>();
  mpp::tensor_ops::reduce_rows(ct, reduced, mpp::tensor_ops::reduction_operation::sum,
                               mpp::tensor_ops::reduction_operation_identity<float>::sum_identity);
  fa_tensor_publish_rows(reduced, rows);
}

#endif
