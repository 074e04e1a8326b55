// Fixed-order row sums for CUDA kernels: out[row] = the sum of
// in[row * len, (row + 1) * len), one block of kThreads per row (row =
// blockIdx.y * gridDim.x + blockIdx.x). Each thread adds its strided elements
// in order, then a fixed shuffle tree runs within each warp and the warps'
// sums are added in warp order: the order depends only on len and kThreads,
// so the result is bit-identical from run to run. The dsink sums of the cudnn
// and sm90 backends use it (a template, so both may instantiate it).
#ifndef MAXATTN_ROW_SUM_CUH_
#define MAXATTN_ROW_SUM_CUH_

#include <cstdint>

namespace maxattn {

template <int kThreads>
__global__ void __launch_bounds__(kThreads) RowSumKernel(const float* in, int64_t len, float* out) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps, one block");
  const int64_t row = static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < len; i += kThreads) sum += in[row * len + i];
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if constexpr (kThreads > 32) {
    __shared__ float warp_sums[kThreads / 32];
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
    __syncthreads();
    sum = 0.0f;
    for (int w = 0; w < kThreads / 32; ++w) sum += warp_sums[w];
  }
  if (threadIdx.x == 0) out[row] = sum;
}

}  // namespace maxattn

#endif  // MAXATTN_ROW_SUM_CUH_
