// Small CUDA kernels around the cuDNN SDPA graphs: the softmax statistics
// epilogue (lse = Max + log(Sum_exp), the [B, N] row-max reduction, rows with
// no visible key, the attention-sink rescale), the sink gradient, cuDNN's
// dropout seed, and zeroing of padded gradient rows.
#ifndef MAXATTN_CUDNN_KERNELS_H_
#define MAXATTN_CUDNN_KERNELS_H_

#include <cstdint>

#include <cuda_runtime_api.h>

namespace maxattn::cudnn {

// Which (b, i) query rows see at least one key. Mirrors visible() of
// attention.h for padding, causal mask and window; a ragged call (ragged.h)
// gives the answer per row instead, in row_code. (A dense mask or segment ids
// folded into the bias are found from the statistics: FinalizeArgs.)
struct RowGeometry {
  int32_t batch = 0, heads = 0, q_len = 0, kv_len = 0;  // B, N, T, S
  const int32_t* q_seq_lengths = nullptr;               // [B] or null
  const int32_t* kv_seq_lengths = nullptr;              // [B] or null
  bool causal = false;
  bool bottom_right = false;
  int64_t window_left = -1;
  int64_t window_right = -1;
  const uint8_t* row_code = nullptr;  // [B, T] RowCode of a ragged call, or null

  // True when some row may see no key at all (so outputs need fixing up).
  bool MayHaveEmptyRows() const;
};

struct FinalizeArgs {
  RowGeometry geometry;
  // cuDNN's statistics: [B, N, T], or [B, T, N] when token_major (a ragged call).
  bool token_major = false;
  const float* row_max = nullptr;  // cuDNN Max, or null
  const float* sum_exp = nullptr;  // cuDNN Sum_exp, or null
  const float* stats = nullptr;    // cuDNN Stats when not already in lse, or null
  // [B, N, T]: written from Max/Sum_exp or stats, or (holding Stats) fixed for
  // empty rows; or null
  float* lse = nullptr;
  float* max_logit = nullptr;      // [B, N]: max over visible rows of row_max; or null
  void* out = nullptr;             // [B, T, N, Hv] 2-byte elements: empty rows zeroed; or null
  int32_t head_dim_v = 0;
  // Rows whose statistic (row_max if given, else the Stats in lse) is below
  // this are fully masked by a folded-in bias (see cudnn_attention.h); 0 = off.
  float masked_below = 0.0f;
  // Per-head sink logit [N], or null: empty rows get lse = sink[n]. With
  // row_scale, the statistics are those of the vanilla softmax and the sink is
  // applied here: lse = logaddexp(lse, sink[n]), row_scale = exp(old - new lse).
  const float* sink = nullptr;
  float* row_scale = nullptr;  // [B, N, T] or null
};

// Blocks of 1024 rows of each (b, n); with more than one per (b, n), the
// max_logit buffer is filled with float_max.cuh's sentinel first and the
// blocks combine by atomic max.
cudaError_t LaunchFinalizeForward(const FinalizeArgs& args, cudaStream_t stream);

// out[b, t, n, :] *= row_scale[b, n, t] for 2-byte `out` (bf16 or fp16);
// head_dim_v must be a multiple of 8 and `out` 16-byte aligned.
cudaError_t LaunchScaleRows(void* out, bool is_fp16, const float* row_scale, int32_t batch, int32_t q_len,
                            int32_t heads, int32_t head_dim_v, cudaStream_t stream);

// dsink[b, n] = -sum_t exp(sink[n] - lse[b, n, t]) * sum_h dout * out, the
// gradient of the sink logits per batch row (out/dout [B, T, N, Hv], 2-byte,
// Hv a multiple of 8; their extra value columns carry the lse cotangent, see
// cudnn.py). `terms` is [B, N, T] float scratch; the sum over t has a fixed
// order, so the result is deterministic.
cudaError_t LaunchSinkGradient(const void* out, const void* dout, bool is_fp16, const float* lse,
                               const float* sink, float* terms, float* dsink, int32_t batch, int32_t q_len,
                               int32_t heads, int32_t head_dim_v, cudaStream_t stream);

// cuDNN's dropout seed and offset (two int64) from the four words of
// maxattn's dropout seed (key words, batch and head offset of the block).
cudaError_t LaunchDropoutSeed(const uint32_t* words, int64_t* seed_and_offset, cudaStream_t stream);

// lse_out = lse [B, N, T] with -inf (rows that see no key) replaced by 0, so
// that cuDNN's backward never computes exp(-inf - -inf); written [B, T, N]
// when token_major (a ragged call's Stats layout).
cudaError_t LaunchBackwardLse(const float* lse, float* lse_out, int32_t batch, int32_t heads, int32_t q_len,
                              bool token_major, cudaStream_t stream);

// Zeroes rows l >= lengths[b] of a [batch, rows, row_elems] buffer of 2-byte elements.
cudaError_t LaunchZeroPaddedRows(void* data, int32_t batch, int32_t rows, int64_t row_elems,
                                 const int32_t* lengths, cudaStream_t stream);

}  // namespace maxattn::cudnn

#endif  // MAXATTN_CUDNN_KERNELS_H_
