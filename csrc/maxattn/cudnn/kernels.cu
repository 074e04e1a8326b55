#include "maxattn/cudnn/kernels.h"

#include "maxattn/block_reduce.cuh"
#include "maxattn/cudnn/ragged.h"
#include "maxattn/float_max.cuh"

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

// log(exp(a) + exp(b)) for finite b; a may be -inf.
__device__ __forceinline__ float LogAddExp(float a, float b) {
  const float hi = a > b ? a : b, lo = a > b ? b : a;
  return hi + log1pf(expf(lo - hi));
}

// Each thread of the finalize kernel handles kRowsPerThread consecutive rows
// per step, loading them (as one float4 when aligned) before using any, so
// that the loads overlap instead of paying the memory latency row by row.
constexpr int kRowsPerThread = 4;

// Row i of one (b, n) is p[i * stride] (stride 1 for [B, N, T], N for token-major [B, T, N]).
__device__ __forceinline__ void LoadRows(const float* p, int64_t stride, int64_t i0, int64_t end, bool vectorized,
                                         float (&x)[kRowsPerThread]) {
  if (vectorized && stride == 1 && i0 + kRowsPerThread <= end) {
    const float4 v = *reinterpret_cast<const float4*>(p + i0);
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
    return;
  }
  for (int r = 0; r < kRowsPerThread; ++r) x[r] = i0 + r < end ? p[(i0 + r) * stride] : 0.0f;
}

// Sets every element of out[b, i, n, :] (2-byte elements) to `bits`.
__device__ __forceinline__ void FillOutRow(const FinalizeArgs& args, int32_t b, int64_t i, int32_t n, uint16_t bits) {
  const RowGeometry& g = args.geometry;
  uint16_t* row = static_cast<uint16_t*>(args.out) + ((static_cast<int64_t>(b) * g.q_len + i) * g.heads + n) *
                                                         args.head_dim_v;
  for (int32_t h = 0; h < args.head_dim_v; ++h) row[h] = bits;
}

// Block (bn, c) takes rows [c * rows_per_block, (c + 1) * rows_per_block) of
// (b, n) = (bn / N, bn % N).
__global__ void FinalizeForwardKernel(FinalizeArgs args, bool vectorized, int64_t rows_per_block) {
  const RowGeometry& g = args.geometry;
  const int32_t bn = blockIdx.x;  // b * N + n
  const int64_t row_begin = static_cast<int64_t>(blockIdx.y) * rows_per_block;
  const int64_t row_end = row_begin + rows_per_block < g.q_len ? row_begin + rows_per_block : g.q_len;
  const int32_t b = bn / g.heads;
  const int32_t n = bn % g.heads;
  const int64_t base = static_cast<int64_t>(bn) * g.q_len;  // of (b, n, 0) in [B, N, T]
  // Where cuDNN's statistics of (b, n, 0) are, and their step over rows.
  const int64_t in_base = args.token_major ? static_cast<int64_t>(b) * g.q_len * g.heads + n : base;
  const int64_t in_stride = args.token_major ? g.heads : 1;
  const float sink = args.sink ? args.sink[n] : -INFINITY;
  // The Stats (no Sum_exp): read when the lse, a probe or the sink needs them.
  const float* stats_in = args.stats ? args.stats : (args.sum_exp ? nullptr : args.lse);
  float acc = -INFINITY;
  for (int64_t i0 = row_begin + threadIdx.x * static_cast<int64_t>(kRowsPerThread); i0 < row_end;
       i0 += static_cast<int64_t>(blockDim.x) * kRowsPerThread) {
    float m[kRowsPerThread] = {}, sum_exp[kRowsPerThread] = {}, stats[kRowsPerThread] = {};
    if (args.row_max) LoadRows(args.row_max + in_base, in_stride, i0, row_end, vectorized, m);
    if (args.sum_exp) LoadRows(args.sum_exp + in_base, in_stride, i0, row_end, vectorized, sum_exp);
    if (stats_in) LoadRows(stats_in + in_base, in_stride, i0, row_end, vectorized, stats);
    for (int r = 0; r < kRowsPerThread; ++r) {
      const int64_t i = i0 + r;
      if (i >= row_end) break;
      const int64_t idx = base + i;
      const uint8_t code = g.row_code ? g.row_code[static_cast<int64_t>(b) * g.q_len + i] : kRowVisible;
      if (code == kRowPoisoned) {
        // The batch row breaks the ragged layout's promise (ragged.h): NaN everywhere.
        if (args.lse) args.lse[idx] = NAN;
        if (args.row_scale) args.row_scale[idx] = NAN;
        if (args.max_logit) acc = NAN;
        if (args.out) FillOutRow(args, b, i, n, 0x7FFF);  // a NaN in bf16 and fp16
        continue;
      }
      bool visible = g.row_code ? code == kRowVisible : RowVisible(g, b, i);
      if (visible && args.masked_below < 0.0f) {
        // NaN compares false: a NaN row stays visible and propagates.
        visible = !((args.row_max ? m[r] : stats[r]) < args.masked_below);
      }
      if (visible) {
        if ((args.lse && (args.sum_exp || args.stats)) || args.row_scale) {
          float lse = args.sum_exp ? m[r] + logf(sum_exp[r]) : stats[r];
          if (args.row_scale) {
            const float with_sink = LogAddExp(lse, sink);
            args.row_scale[idx] = expf(lse - with_sink);
            lse = with_sink;
          }
          if (args.lse) args.lse[idx] = lse;
        }
        if (args.max_logit) acc = NanMax(acc, m[r]);
      } else {
        if (args.lse) args.lse[idx] = sink;
        if (args.row_scale) args.row_scale[idx] = 0.0f;
        if (args.out) FillOutRow(args, b, i, n, 0);
      }
    }
  }
  if (!args.max_logit) return;
  acc = BlockReduce(acc, [](float x, float y) { return NanMax(x, y); }, -INFINITY);
  if (threadIdx.x != 0) return;
  // One block per (b, n) stores; several combine through the atomic (the
  // launcher filled the buffer with the sentinel first).
  if (gridDim.y == 1) args.max_logit[bn] = acc;
  else AtomicMaxFloat(args.max_logit + bn, acc);
}

// Eight 2-byte elements (16 bytes) per thread: Hv % 8 == 0 (cuDNN's rule), so
// a vector never straddles two heads' rows.
constexpr int kVector = 8;

__device__ __forceinline__ float Dot8(const uint4& a, const uint4& b, bool is_fp16) {
  const uint32_t* x = reinterpret_cast<const uint32_t*>(&a);
  const uint32_t* y = reinterpret_cast<const uint32_t*>(&b);
  float sum = 0.0f;
  for (int w = 0; w < 4; ++w) {
    float2 fx, fy;
    if (is_fp16) {
      fx = __half22float2(*reinterpret_cast<const __half2*>(&x[w]));
      fy = __half22float2(*reinterpret_cast<const __half2*>(&y[w]));
    } else {
      fx = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x[w]));
      fy = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&y[w]));
    }
    sum += fx.x * fy.x + fx.y * fy.y;
  }
  return sum;
}

__device__ __forceinline__ void Scale8(uint4& a, float scale, bool is_fp16) {
  uint32_t* x = reinterpret_cast<uint32_t*>(&a);
  for (int w = 0; w < 4; ++w) {
    if (is_fp16) {
      float2 f = __half22float2(*reinterpret_cast<const __half2*>(&x[w]));
      const __half2 h = __float22half2_rn(make_float2(f.x * scale, f.y * scale));
      x[w] = *reinterpret_cast<const uint32_t*>(&h);
    } else {
      float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x[w]));
      const __nv_bfloat162 h = __float22bfloat162_rn(make_float2(f.x * scale, f.y * scale));
      x[w] = *reinterpret_cast<const uint32_t*>(&h);
    }
  }
}

// (b, n, t) statistics index of the head row r = (b * T + t) * N + n of a [B, T, N, Hv] tensor.
__device__ __forceinline__ int64_t StatsIndex(int64_t r, int32_t q_len, int32_t heads) {
  const int64_t n = r % heads, bt = r / heads;
  return (bt / q_len * heads + n) * q_len + bt % q_len;
}

__global__ void ScaleRowsKernel(uint4* out, bool is_fp16, const float* row_scale, int64_t vectors,
                                int32_t q_len, int32_t heads, int32_t vectors_per_row) {
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < vectors;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint4 pack = out[v];
    Scale8(pack, row_scale[StatsIndex(v / vectors_per_row, q_len, heads)], is_fp16);
    out[v] = pack;
  }
}

// Per head row (one per warp): contribution[b, n, t] = -exp(sink[n] - lse) * sum_h dout * out.
__global__ void SinkRowTermsKernel(const uint4* out, const uint4* dout, bool is_fp16, const float* lse,
                                   const float* sink, float* terms, int64_t rows, int32_t q_len, int32_t heads,
                                   int32_t vectors_per_row) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps) {
    float d = 0.0f;
    for (int32_t j = lane; j < vectors_per_row; j += 32) {
      const int64_t v = r * vectors_per_row + j;
      d += Dot8(out[v], dout[v], is_fp16);
    }
    for (int o = 16; o > 0; o /= 2) d += __shfl_xor_sync(0xffffffffu, d, o);
    if (lane == 0) {
      const int64_t idx = StatsIndex(r, q_len, heads);
      // d == 0 for rows with no visible key (out = 0), where lse may be -inf.
      terms[idx] = d == 0.0f ? 0.0f : -expf(sink[r % heads] - lse[idx]) * d;
    }
  }
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

__global__ void BackwardLseKernel(const float* lse, float* lse_out, int64_t count, int32_t heads, int32_t q_len,
                                  bool token_major) {
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < count;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float x = lse[idx];
    int64_t to = idx;
    if (token_major) {  // idx = (b * N + n) * T + t  ->  (b * T + t) * N + n
      const int64_t t = idx % q_len, bn = idx / q_len;
      to = (bn / heads * q_len + t) * heads + bn % heads;
    }
    lse_out[to] = x == -INFINITY ? 0.0f : x;
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
  if (row_code || q_seq_lengths || kv_seq_lengths) return true;
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
  const int64_t q_len = args.geometry.q_len;
  auto aligned = [](const float* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  // Rows per block: one step of kFinalizeThreads threads. A multiple of
  // kRowsPerThread, so every block's first row keeps the float4 alignment.
  constexpr int kFinalizeThreads = 256;
  constexpr int64_t kRowsPerBlock = int64_t{kFinalizeThreads} * kRowsPerThread;
  const bool vectorized = q_len % kRowsPerThread == 0 && aligned(args.row_max) && aligned(args.sum_exp) &&
                          aligned(args.stats) && aligned(args.lse);
  const int64_t chunks = q_len == 0 ? 1 : (q_len + kRowsPerBlock - 1) / kRowsPerBlock;
  if (chunks > 65535) return cudaErrorInvalidValue;
  if (chunks > 1 && args.max_logit) {
    const cudaError_t err =
        cudaMemsetAsync(args.max_logit, kAtomicMaxEmptyByte, static_cast<size_t>(blocks) * sizeof(float), stream);
    if (err != cudaSuccess) return err;
  }
  // A single chunk: enough threads for its rows, in whole warps.
  const int64_t wanted = (q_len + kRowsPerThread - 1) / kRowsPerThread;
  const int threads = chunks > 1 ? kFinalizeThreads : static_cast<int>((wanted + 31) / 32 * 32);
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(chunks));
  FinalizeForwardKernel<<<grid, threads > 0 ? threads : 32, 0, stream>>>(args, vectorized, kRowsPerBlock);
  return cudaGetLastError();
}

namespace {

unsigned GridFor(int64_t items, int64_t per_block) {
  const int64_t blocks = (items + per_block - 1) / per_block;
  return static_cast<unsigned>(blocks < (int64_t{1} << 20) ? blocks : (int64_t{1} << 20));
}

}  // namespace

cudaError_t LaunchScaleRows(void* out, bool is_fp16, const float* row_scale, int32_t batch, int32_t q_len,
                            int32_t heads, int32_t head_dim_v, cudaStream_t stream) {
  const int64_t vectors = static_cast<int64_t>(batch) * q_len * heads * (head_dim_v / kVector);
  if (vectors == 0) return cudaSuccess;
  if (head_dim_v % kVector != 0) return cudaErrorInvalidValue;
  ScaleRowsKernel<<<GridFor(vectors, kThreads), kThreads, 0, stream>>>(
      static_cast<uint4*>(out), is_fp16, row_scale, vectors, q_len, heads, head_dim_v / kVector);
  return cudaGetLastError();
}

cudaError_t LaunchSinkGradient(const void* out, const void* dout, bool is_fp16, const float* lse,
                               const float* sink, float* terms, float* dsink, int32_t batch, int32_t q_len,
                               int32_t heads, int32_t head_dim_v, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(batch) * q_len * heads;
  if (rows == 0) return cudaSuccess;
  if (head_dim_v % kVector != 0) return cudaErrorInvalidValue;
  SinkRowTermsKernel<<<GridFor(rows, kThreads / 32), kThreads, 0, stream>>>(
      static_cast<const uint4*>(out), static_cast<const uint4*>(dout), is_fp16, lse, sink, terms, rows, q_len,
      heads, head_dim_v / kVector);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  // dsink[b, n] = sum over t of terms[b, n, t], in a fixed order.
  RowSumKernel<kThreads><<<batch * heads, kThreads, 0, stream>>>(terms, q_len, dsink);
  return cudaGetLastError();
}

cudaError_t LaunchDropoutSeed(const uint32_t* words, int64_t* seed_and_offset, cudaStream_t stream) {
  DropoutSeedKernel<<<1, 1, 0, stream>>>(words, seed_and_offset);
  return cudaGetLastError();
}

cudaError_t LaunchBackwardLse(const float* lse, float* lse_out, int32_t batch, int32_t heads, int32_t q_len,
                              bool token_major, cudaStream_t stream) {
  const int64_t count = static_cast<int64_t>(batch) * heads * q_len;
  if (count == 0) return cudaSuccess;
  BackwardLseKernel<<<GridFor(count, kThreads), kThreads, 0, stream>>>(lse, lse_out, count, heads, q_len,
                                                                       token_major);
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
