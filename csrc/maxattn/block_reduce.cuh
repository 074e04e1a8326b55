// Block-wide reductions for CUDA kernels.
//
// BlockReduce: one float per thread (blockDim.x a multiple of 32, at most
// 1024); the result is valid in thread 0. Two shuffle rounds: within each
// warp, then across the warps' partials in warp 0 (lanes past the last warp
// hold `identity`). The order of the operations depends only on blockDim.x.
//
// RowSumKernel: out[row] = the sum of in[row * len, (row + 1) * len), one
// block of kThreads per row (row = blockIdx.y * gridDim.x + blockIdx.x): each
// thread adds its strided elements in order, then BlockReduce. The order
// depends only on len and kThreads, so the result is bit-identical from run
// to run. The dsink sums of the cudnn and sm90 backends use it (a template,
// so both may instantiate it).
#ifndef MAXATTN_BLOCK_REDUCE_CUH_
#define MAXATTN_BLOCK_REDUCE_CUH_

#include <cstdint>

namespace maxattn {

template <typename Op>
__device__ float BlockReduce(float value, Op op, float identity) {
  for (int offset = 16; offset > 0; offset /= 2) value = op(value, __shfl_down_sync(0xffffffffu, value, offset));
  __shared__ float partial[32];  // one per warp, up to 1024 threads
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  if (lane == 0) partial[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < warps ? partial[lane] : identity;
    for (int offset = 16; offset > 0; offset /= 2) value = op(value, __shfl_down_sync(0xffffffffu, value, offset));
  }
  return value;
}

template <int kThreads>
__global__ void __launch_bounds__(kThreads) RowSumKernel(const float* in, int64_t len, float* out) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps, one block");
  const int64_t row = static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < len; i += kThreads) sum += in[row * len + i];
  sum = BlockReduce(sum, [](float x, float y) { return x + y; }, 0.0f);
  if (threadIdx.x == 0) out[row] = sum;
}

}  // namespace maxattn

#endif  // MAXATTN_BLOCK_REDUCE_CUH_
