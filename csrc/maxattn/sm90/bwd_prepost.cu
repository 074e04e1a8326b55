// maxattn sm90: the backward's pre-pass (bwd_prepost.h).
#include "maxattn/sm90/bwd_prepost.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <string>

#include "maxattn/block_reduce.cuh"
#include "maxattn/sm90/problem.h"

namespace maxattn::sm90 {
namespace {

constexpr int kWarps = 8;
constexpr int kRowsPerWarp = 8;
constexpr int kRowsPerBlock = kWarps * kRowsPerWarp;
constexpr float kLog2e = 1.4426950408889634f;

template <class Pair>
struct PairTraits;

template <>
struct PairTraits<__nv_bfloat162> {
  __device__ static float2 ToFloat2(__nv_bfloat162 x) { return __bfloat1622float2(x); }
};

template <>
struct PairTraits<__half2> {
  __device__ static float2 ToFloat2(__half2 x) { return __half22float2(x); }
};

// Grid (ceil(t_pad / 64), N, B); warp w of block x takes rows x*64 + w*8 ... + 7.
// A row's dO and O are read in 16-byte pieces by kHeadDim / 8 lanes, so a warp
// reads 32 / (kHeadDim / 8) rows per pass; all of a warp's loads are issued
// before the first is used (8 rows: 4 KB of dO and O per warp in flight).
template <class Pair, int kHeadDim>
__global__ void __launch_bounds__(kWarps * 32) BwdPrepassKernel(BwdPrepassArgs a) {
  constexpr int kLanesPerRow = kHeadDim / 8;
  constexpr int kRowsPerPass = 32 / kLanesPerRow;
  constexpr int kPasses = kRowsPerWarp / kRowsPerPass;
  static_assert(kLanesPerRow <= 32 && kRowsPerWarp % kRowsPerPass == 0);
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int sub = lane / kLanesPerRow, piece = lane % kLanesPerRow;
  const int n = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int first_row = static_cast<int>(blockIdx.x) * kRowsPerBlock + warp * kRowsPerWarp;
  uint4 o[kPasses], g[kPasses];
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int i = first_row + p * kRowsPerPass + sub;
    o[p] = g[p] = make_uint4(0, 0, 0, 0);
    if (i < a.q_len) {
      const int64_t piece_index = (((static_cast<int64_t>(b) * a.q_len + i) * a.heads + n) * kHeadDim) / 8 + piece;
      o[p] = static_cast<const uint4*>(a.out)[piece_index];
      g[p] = static_cast<const uint4*>(a.dout)[piece_index];
    }
  }
  const int q_valid = a.q_lens == nullptr ? a.q_len : min(max(a.q_lens[b], 0), a.q_len);
  const int64_t stats = (static_cast<int64_t>(b) * a.heads + n) * a.t_pad;
  const float sink = a.sink != nullptr ? a.sink[n] : 0.0f;
  if (a.dq_accum != nullptr) {  // this block's rows of the (b, n) slab of the dQ accumulator
    const int first = static_cast<int>(blockIdx.x) * kRowsPerBlock;
    const int rows = min(kRowsPerBlock, a.t_pad - first);
    float4* slab = reinterpret_cast<float4*>(a.dq_accum + (stats + first) * kHeadDim);
    for (int v = static_cast<int>(threadIdx.x); v < rows * kHeadDim / 4; v += kWarps * 32) {
      slab[v] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  }
  float dsink = 0.0f;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const Pair* x = reinterpret_cast<const Pair*>(&o[p]);
    const Pair* y = reinterpret_cast<const Pair*>(&g[p]);
    float d = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 u = PairTraits<Pair>::ToFloat2(x[j]), v = PairTraits<Pair>::ToFloat2(y[j]);
      d = fmaf(u.x, v.x, fmaf(u.y, v.y, d));
    }
#pragma unroll
    for (int offset = kLanesPerRow / 2; offset > 0; offset /= 2) d += __shfl_xor_sync(0xffffffffu, d, offset);
    const int i = first_row + p * kRowsPerPass + sub;
    if (piece == 0 && i < a.t_pad) {
      float lse = INFINITY;  // no probability
      if (i < a.q_len) {
        const int64_t src = (static_cast<int64_t>(b) * a.heads + n) * a.q_len + i;
        if (a.dlse != nullptr) d -= a.dlse[src];
        lse = a.lse[src];
        if (a.sink != nullptr && sink != -INFINITY) dsink -= expf(sink - lse) * d;  // a -inf sink: no weight, 0 (as cpu)
        if (i >= q_valid || lse == -INFINITY) lse = INFINITY;
        else lse *= kLog2e;
      }
      a.dpsum[stats + i] = d;
      a.lse_log2[stats + i] = lse;
    }
  }
  if (a.dsink == nullptr) return;
  // Lanes other than the rows' first hold 0; the sum's order is fixed.
  for (int offset = 16; offset > 0; offset /= 2) dsink += __shfl_xor_sync(0xffffffffu, dsink, offset);
  __shared__ float partial[kWarps];
  if (lane == 0) partial[warp] = dsink;
  __syncthreads();
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (int w = 0; w < kWarps; ++w) sum += partial[w];
    a.dsink_partial[(static_cast<int64_t>(b) * a.heads + n) * gridDim.x + blockIdx.x] = sum;
  }
}

// The backward's head dims (bwd_config.h's BwdSupportsHeadDim).
template <class Pair>
Status LaunchPrepassKernel(const BwdPrepassArgs& args, dim3 grid, cudaStream_t stream) {
  switch (args.head_dim) {
    case 64:
      BwdPrepassKernel<Pair, 64><<<grid, kWarps * 32, 0, stream>>>(args);
      break;
    case 128:
      BwdPrepassKernel<Pair, 128><<<grid, kWarps * 32, 0, stream>>>(args);
      break;
    case 256:
      BwdPrepassKernel<Pair, 256><<<grid, kWarps * 32, 0, stream>>>(args);
      break;
    default:
      return Status::Internal("sm90 backward pre-pass: no instance for head_dim " + std::to_string(args.head_dim));
  }
  return CudaStatus(cudaGetLastError(), "backward pre-pass launch");
}

}  // namespace

int BwdPrepassBlocks(int t_pad) { return (t_pad + kRowsPerBlock - 1) / kRowsPerBlock; }

Status LaunchBwdPrepass(const BwdPrepassArgs& args, cudaStream_t stream) {
  const int blocks = BwdPrepassBlocks(args.t_pad);
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(args.heads),
                  static_cast<unsigned>(args.batch));
  MAXATTN_RETURN_IF_ERROR(args.dtype == DType::kBFloat16 ? LaunchPrepassKernel<__nv_bfloat162>(args, grid, stream)
                                                          : LaunchPrepassKernel<__half2>(args, grid, stream));
  if (args.dsink == nullptr) return Status::Ok();
  // dsink[b, n] = the sum of the pre-pass blocks' partials, in a fixed order; grid (N, B), one warp each.
  RowSumKernel<32><<<dim3(static_cast<unsigned>(args.heads), static_cast<unsigned>(args.batch)), 32, 0, stream>>>(
      args.dsink_partial, blocks, args.dsink);
  return CudaStatus(cudaGetLastError(), "backward dsink sum launch");
}

}  // namespace maxattn::sm90
