// maxattn sm90: the backward's pre-pass before the main kernel
// (bwd_kernel.h).
//
// Pre-pass, per row (b, n, i) of [B, N, t_pad], H / 8 lanes each (16-byte
// loads: out and dout must be 16-byte aligned, as XLA's buffers are):
//   dpsum    = rowsum(dO o O) - dlse       (0 for i >= T)
//   lse_log2 = lse * log2(e), or +inf where the row has no probability to
//              give: i >= T, i >= the row's valid length, lse = -inf
//   dsink    = -sum_i exp(sink - lse_i) * dpsum_i   per (b, n) (attention.h):
//              each pre-pass block writes its partial sum, and a second
//              kernel adds a (b, n)'s partials in a fixed order (the same
//              bits on every run, as the main kernel's dK and dV).
// It also zeroes the main kernel's fp32 dQ accumulator, block by block (its
// 64 rows of a (b, n)), so the zeroing is counted and launched with it.
// (The dQ post-pass depends on the kernel instance's dQ layout: bwd_kernel.h.)
#ifndef MAXATTN_SM90_BWD_PREPOST_H_
#define MAXATTN_SM90_BWD_PREPOST_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "maxattn/attention.h"

namespace maxattn::sm90 {

struct BwdPrepassArgs {
  DType dtype = DType::kBFloat16;  // of out and dout
  const void* out = nullptr;       // [B, T, N, H]
  const void* dout = nullptr;      // [B, T, N, H]
  const float* lse = nullptr;      // [B, N, T]
  const float* dlse = nullptr;     // [B, N, T] or null (zero)
  const int32_t* q_lens = nullptr;  // [B] or null
  const float* sink = nullptr;     // [N] or null
  float* lse_log2 = nullptr;       // [B, N, t_pad]
  float* dpsum = nullptr;          // [B, N, t_pad]
  float* dsink = nullptr;          // [B, N] or null
  float* dsink_partial = nullptr;  // [B, N, BwdPrepassBlocks(t_pad)] workspace, with dsink
  float* dq_accum = nullptr;       // the main kernel's fp32 dQ tiles (B * N * t_pad * H floats: bwd_config.h),
                                   // zeroed here as a flat slab; or null
  int batch = 0, q_len = 0, heads = 0, head_dim = 0, t_pad = 0;
};

// Blocks of the pre-pass per (b, n): the partial sums of dsink per (b, n).
int BwdPrepassBlocks(int t_pad);

Status LaunchBwdPrepass(const BwdPrepassArgs& args, cudaStream_t stream);

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_BWD_PREPOST_H_
