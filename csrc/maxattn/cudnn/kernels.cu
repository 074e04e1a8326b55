#include "maxattn/cudnn/kernels.h"

#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

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

// log(exp(a) + exp(b)) for finite b; a may be -inf.
__device__ __forceinline__ float LogAddExp(float a, float b) {
  const float hi = a > b ? a : b, lo = a > b ? b : a;
  return hi + log1pf(expf(lo - hi));
}

__device__ __forceinline__ float ToFloat(const uint16_t* p, int64_t i, bool is_fp16) {
  return is_fp16 ? __half2float(reinterpret_cast<const __half*>(p)[i])
                 : __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p)[i]);
}

__device__ __forceinline__ void Store(uint16_t* p, int64_t i, float x, bool is_fp16) {
  if (is_fp16) reinterpret_cast<__half*>(p)[i] = __float2half_rn(x);
  else reinterpret_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x);
}

// Block-wide reduction of one float per thread; the result is valid in thread 0.
template <typename Op>
__device__ float BlockReduce(float value, Op op) {
  for (int offset = 16; offset > 0; offset /= 2) value = op(value, __shfl_down_sync(0xffffffffu, value, offset));
  __shared__ float partial[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) partial[warp] = value;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) value = op(value, partial[w]);
  }
  return value;
}

__global__ void FinalizeForwardKernel(FinalizeArgs args) {
  const RowGeometry& g = args.geometry;
  const int32_t bn = blockIdx.x;  // b * N + n
  const int32_t b = bn / g.heads;
  const int32_t n = bn % g.heads;
  const int64_t base = static_cast<int64_t>(bn) * g.q_len;
  const float sink = args.sink ? args.sink[n] : -INFINITY;
  float acc = -INFINITY;
  for (int64_t i = threadIdx.x; i < g.q_len; i += blockDim.x) {
    const int64_t idx = base + i;
    const float m = args.row_max ? args.row_max[idx] : 0.0f;
    bool visible = RowVisible(g, b, i);
    if (visible && args.masked_below < 0.0f) {
      // NaN compares false: a NaN row stays visible and propagates.
      visible = !((args.row_max ? m : args.lse[idx]) < args.masked_below);
    }
    if (visible) {
      if (args.lse || args.row_scale) {
        float lse = args.sum_exp ? m + logf(args.sum_exp[idx]) : args.lse[idx];
        if (args.row_scale) {
          const float with_sink = LogAddExp(lse, sink);
          args.row_scale[idx] = expf(lse - with_sink);
          lse = with_sink;
        }
        if (args.lse) args.lse[idx] = lse;
      }
      if (args.max_logit) acc = NanMax(acc, m);
    } else {
      if (args.lse) args.lse[idx] = sink;
      if (args.row_scale) args.row_scale[idx] = 0.0f;
      if (args.out) {
        uint16_t* row = static_cast<uint16_t*>(args.out) +
                        ((static_cast<int64_t>(b) * g.q_len + i) * g.heads + n) * args.head_dim_v;
        for (int32_t h = 0; h < args.head_dim_v; ++h) row[h] = 0;
      }
    }
  }
  if (!args.max_logit) return;
  acc = BlockReduce(acc, [](float x, float y) { return NanMax(x, y); });
  if (threadIdx.x == 0) args.max_logit[bn] = acc;
}

// One block per (b, t) row of out: its N * Hv contiguous elements.
__global__ void ScaleRowsKernel(uint16_t* out, bool is_fp16, const float* row_scale, int32_t q_len,
                                int32_t heads, int32_t head_dim_v) {
  const int64_t bt = blockIdx.x;
  const int64_t b = bt / q_len, t = bt % q_len;
  const int64_t width = static_cast<int64_t>(heads) * head_dim_v;
  uint16_t* row = out + bt * width;
  for (int64_t e = threadIdx.x; e < width; e += blockDim.x) {
    const int64_t n = e / head_dim_v;
    const float scale = row_scale[(b * heads + n) * q_len + t];
    Store(row, e, ToFloat(row, e, is_fp16) * scale, is_fp16);
  }
}

// One block per (b, n); one warp per row t at a time.
__global__ void SinkGradientKernel(const uint16_t* out, const uint16_t* dout, bool is_fp16, const float* lse,
                                   const float* sink, float* dsink, int32_t q_len, int32_t heads,
                                   int32_t head_dim_v) {
  const int32_t bn = blockIdx.x;
  const int64_t b = bn / heads, n = bn % heads;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  float acc = 0.0f;
  for (int64_t t = warp; t < q_len; t += warps) {
    const int64_t offset = ((b * q_len + t) * heads + n) * head_dim_v;
    float d = 0.0f;
    for (int32_t h = lane; h < head_dim_v; h += 32) {
      d += ToFloat(out, offset + h, is_fp16) * ToFloat(dout, offset + h, is_fp16);
    }
    for (int o = 16; o > 0; o /= 2) d += __shfl_xor_sync(0xffffffffu, d, o);
    if (lane == 0 && d != 0.0f) acc -= expf(sink[n] - lse[static_cast<int64_t>(bn) * q_len + t]) * d;
  }
  acc = BlockReduce(acc, [](float x, float y) { return x + y; });
  if (threadIdx.x == 0) dsink[bn] = acc;
}

__device__ __forceinline__ uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Hashes the block offset (words 2, 3) into the seed, so that every block of a
// sharded call gets an independent stream; the Philox offset starts at 0.
__global__ void DropoutSeedKernel(const uint32_t* words, int64_t* seed_and_offset) {
  const uint64_t key = (static_cast<uint64_t>(words[1]) << 32) | words[0];
  const uint64_t block = (static_cast<uint64_t>(words[3]) << 32) | words[2];
  seed_and_offset[0] = static_cast<int64_t>(SplitMix64(key ^ SplitMix64(block)) >> 1);
  seed_and_offset[1] = 0;
}

__global__ void BackwardLseKernel(const float* lse, float* lse_out, int64_t count) {
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < count;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float x = lse[idx];
    lse_out[idx] = x == -INFINITY ? 0.0f : x;
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

cudaError_t LaunchScaleRows(void* out, bool is_fp16, const float* row_scale, int32_t batch, int32_t q_len,
                            int32_t heads, int32_t head_dim_v, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(batch) * q_len;
  if (rows == 0 || heads == 0 || head_dim_v == 0) return cudaSuccess;
  ScaleRowsKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(static_cast<uint16_t*>(out), is_fp16,
                                                                        row_scale, q_len, heads, head_dim_v);
  return cudaGetLastError();
}

cudaError_t LaunchSinkGradient(const void* out, const void* dout, bool is_fp16, const float* lse,
                               const float* sink, float* dsink, int32_t batch, int32_t q_len, int32_t heads,
                               int32_t head_dim_v, cudaStream_t stream) {
  const int blocks = batch * heads;
  if (blocks == 0) return cudaSuccess;
  SinkGradientKernel<<<blocks, kThreads, 0, stream>>>(static_cast<const uint16_t*>(out),
                                                     static_cast<const uint16_t*>(dout), is_fp16, lse, sink,
                                                     dsink, q_len, heads, head_dim_v);
  return cudaGetLastError();
}

cudaError_t LaunchDropoutSeed(const uint32_t* words, int64_t* seed_and_offset, cudaStream_t stream) {
  DropoutSeedKernel<<<1, 1, 0, stream>>>(words, seed_and_offset);
  return cudaGetLastError();
}

cudaError_t LaunchBackwardLse(const float* lse, float* lse_out, int64_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  BackwardLseKernel<<<static_cast<unsigned>(blocks < 65535 ? blocks : 65535), kThreads, 0, stream>>>(lse, lse_out,
                                                                                                   count);
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
