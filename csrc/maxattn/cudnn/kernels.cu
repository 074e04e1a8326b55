#include "maxattn/cudnn/kernels.h"

#include <cmath>
#include <cstdint>

namespace maxattn::cudnn {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ bool RowVisible(const RowGeometry& g, int32_t b, int64_t i) {
  const int64_t qv = g.q_seq_lengths ? g.q_seq_lengths[b] : g.q_len;
  const int64_t kv = g.kv_seq_lengths ? g.kv_seq_lengths[b] : g.kv_len;
  if (i >= qv) return false;
  const int64_t d = g.bottom_right ? kv - qv : 0;
  int64_t lo = 0;
  int64_t hi = (kv < g.kv_len ? kv : g.kv_len) - 1;
  if (g.causal && i + d < hi) hi = i + d;
  if (g.window_right >= 0 && i + d + g.window_right < hi) hi = i + d + g.window_right;
  if (g.window_left >= 0 && i + d - g.window_left > lo) lo = i + d - g.window_left;
  return lo <= hi;
}

// max that propagates NaN from either side.
__device__ __forceinline__ float NanMax(float a, float b) {
  if (a != a) return a;
  if (b != b) return b;
  return a > b ? a : b;
}

__global__ void FinalizeForwardKernel(FinalizeArgs args) {
  const RowGeometry& g = args.geometry;
  const int32_t bn = blockIdx.x;  // b * N + n
  const int32_t b = bn / g.heads;
  const int32_t n = bn % g.heads;
  const int64_t base = static_cast<int64_t>(bn) * g.q_len;
  float acc = -INFINITY;
  for (int64_t i = threadIdx.x; i < g.q_len; i += blockDim.x) {
    if (RowVisible(g, b, i)) {
      const float m = args.row_max ? args.row_max[base + i] : 0.0f;
      if (args.lse && args.sum_exp) args.lse[base + i] = m + logf(args.sum_exp[base + i]);
      if (args.max_logit) acc = NanMax(acc, m);
    } else {
      if (args.lse) args.lse[base + i] = -INFINITY;
      if (args.out) {
        uint16_t* row = static_cast<uint16_t*>(args.out) +
                        ((static_cast<int64_t>(b) * g.q_len + i) * g.heads + n) * args.head_dim_v;
        for (int32_t h = 0; h < args.head_dim_v; ++h) row[h] = 0;
      }
    }
  }
  if (!args.max_logit) return;
  for (int offset = 16; offset > 0; offset /= 2) acc = NanMax(acc, __shfl_down_sync(0xffffffffu, acc, offset));
  __shared__ float warp_max[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_max[warp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = warp_max[0];
    for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) m = NanMax(m, warp_max[w]);
    args.max_logit[bn] = m;
  }
}

__global__ void BackwardLseKernel(RowGeometry g, const float* lse, float* lse_out) {
  const int64_t total = static_cast<int64_t>(g.batch) * g.heads * g.q_len;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = idx % g.q_len;
    const int32_t b = static_cast<int32_t>(idx / (static_cast<int64_t>(g.q_len) * g.heads));
    lse_out[idx] = RowVisible(g, b, i) ? lse[idx] : 0.0f;
  }
}

__global__ void ZeroPaddedRowsKernel(uint16_t* data, int32_t rows, int64_t row_elems, const int32_t* lengths) {
  const int32_t b = blockIdx.y;
  const int64_t row = blockIdx.x;
  const int32_t len = lengths[b];
  if (row < len) return;
  uint16_t* p = data + (static_cast<int64_t>(b) * rows + row) * row_elems;
  for (int64_t e = threadIdx.x; e < row_elems; e += blockDim.x) p[e] = 0;
}

}  // namespace

bool RowGeometry::MayHaveEmptyRows() const {
  if (q_seq_lengths || kv_seq_lengths) return true;
  // Without padding a row i is empty only when its band [i+d-wl, i+d+wr] (d = 0
  // for full lengths with top-left, S-T with bottom-right) misses [0, S).
  const int64_t d = bottom_right ? static_cast<int64_t>(kv_len) - q_len : 0;
  int64_t right = -1;  // smallest right reach over rows (row 0)
  bool bounded_right = false;
  if (causal) { right = d; bounded_right = true; }
  if (window_right >= 0 && (!bounded_right || d + window_right < right)) { right = d + window_right; bounded_right = true; }
  if (bounded_right && right < 0) return true;
  if (window_left >= 0 && static_cast<int64_t>(q_len) - 1 + d - window_left > static_cast<int64_t>(kv_len) - 1) return true;
  return kv_len == 0;
}

cudaError_t LaunchFinalizeForward(const FinalizeArgs& args, cudaStream_t stream) {
  const int blocks = args.geometry.batch * args.geometry.heads;
  if (blocks == 0) return cudaSuccess;
  FinalizeForwardKernel<<<blocks, kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t LaunchBackwardLse(const RowGeometry& geometry, const float* lse, float* lse_out, cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(geometry.batch) * geometry.heads * geometry.q_len;
  if (total == 0) return cudaSuccess;
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  BackwardLseKernel<<<static_cast<unsigned>(blocks < 65535 ? blocks : 65535), kThreads, 0, stream>>>(geometry, lse,
                                                                                                   lse_out);
  return cudaGetLastError();
}

cudaError_t LaunchZeroPaddedRows(void* data, int32_t batch, int32_t rows, int64_t row_elems, const int32_t* lengths,
                                 cudaStream_t stream) {
  if (batch == 0 || rows == 0 || row_elems == 0) return cudaSuccess;
  dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(batch));
  ZeroPaddedRowsKernel<<<grid, 128, 0, stream>>>(static_cast<uint16_t*>(data), rows, row_elems, lengths);
  return cudaGetLastError();
}

}  // namespace maxattn::cudnn
