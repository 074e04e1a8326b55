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
template <class Pair>
__global__ void __launch_bounds__(kWarps * 32) BwdPrepassKernel(BwdPrepassArgs a) {
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int n = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int q_valid = a.q_lens == nullptr ? a.q_len : min(max(a.q_lens[b], 0), a.q_len);
  const int64_t stats = (static_cast<int64_t>(b) * a.heads + n) * a.t_pad;
  const float sink = a.sink != nullptr ? a.sink[n] : 0.0f;
  if (a.dq_accum != nullptr) {  // this block's rows of the (b, n) slab of the dQ accumulator
    const int first = static_cast<int>(blockIdx.x) * kRowsPerBlock;
    const int rows = min(kRowsPerBlock, a.t_pad - first);
    float4* slab = reinterpret_cast<float4*>(a.dq_accum + (stats + first) * a.head_dim);
    for (int v = static_cast<int>(threadIdx.x); v < rows * a.head_dim / 4; v += kWarps * 32) {
      slab[v] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  }
  float dsink = 0.0f;
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int i = static_cast<int>(blockIdx.x) * kRowsPerBlock + warp * kRowsPerWarp + k;
    if (i >= a.t_pad) break;
    float d = 0.0f;
    if (i < a.q_len) {
      const int64_t row = ((static_cast<int64_t>(b) * a.q_len + i) * a.heads + n) * a.head_dim;
      const Pair* o = reinterpret_cast<const Pair*>(static_cast<const char*>(a.out) + row * 2);
      const Pair* g = reinterpret_cast<const Pair*>(static_cast<const char*>(a.dout) + row * 2);
      for (int h = lane; h < a.head_dim / 2; h += 32) {
        const float2 x = PairTraits<Pair>::ToFloat2(o[h]), y = PairTraits<Pair>::ToFloat2(g[h]);
        d = fmaf(x.x, y.x, fmaf(x.y, y.y, d));
      }
    }
    for (int offset = 16; offset > 0; offset /= 2) d += __shfl_xor_sync(0xffffffffu, d, offset);
    if (lane == 0) {
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
  __shared__ float partial[kWarps];
  if (lane == 0) partial[warp] = dsink;
  __syncthreads();
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (int w = 0; w < kWarps; ++w) sum += partial[w];
    a.dsink_partial[(static_cast<int64_t>(b) * a.heads + n) * gridDim.x + blockIdx.x] = sum;
  }
}

}  // namespace

int BwdPrepassBlocks(int t_pad) { return (t_pad + kRowsPerBlock - 1) / kRowsPerBlock; }

Status LaunchBwdPrepass(const BwdPrepassArgs& args, cudaStream_t stream) {
  const int blocks = BwdPrepassBlocks(args.t_pad);
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(args.heads),
                  static_cast<unsigned>(args.batch));
  if (args.dtype == DType::kBFloat16) {
    BwdPrepassKernel<__nv_bfloat162><<<grid, kWarps * 32, 0, stream>>>(args);
  } else {
    BwdPrepassKernel<__half2><<<grid, kWarps * 32, 0, stream>>>(args);
  }
  MAXATTN_RETURN_IF_ERROR(CudaStatus(cudaGetLastError(), "backward pre-pass launch"));
  if (args.dsink == nullptr) return Status::Ok();
  // dsink[b, n] = the sum of the pre-pass blocks' partials, in a fixed order; grid (N, B), one warp each.
  RowSumKernel<32><<<dim3(static_cast<unsigned>(args.heads), static_cast<unsigned>(args.batch)), 32, 0, stream>>>(
      args.dsink_partial, blocks, args.dsink);
  return CudaStatus(cudaGetLastError(), "backward dsink sum launch");
}

}  // namespace maxattn::sm90
