// Small CUDA kernels around the cuDNN SDPA graphs: the softmax statistics
// epilogue (lse = Max + log(Sum_exp), the [B, N] row-max reduction, rows with
// no visible key) and zeroing of padded gradient rows.
#ifndef MAXATTN_CUDNN_KERNELS_H_
#define MAXATTN_CUDNN_KERNELS_H_

#include <cstdint>

#include <cuda_runtime_api.h>

namespace maxattn::cudnn {

// Which (b, i) query rows see at least one key. Mirrors visible() of
// attention.h for padding, causal mask and window (segment ids and dense
// masks are not handled by this backend).
struct RowGeometry {
  int32_t batch = 0, heads = 0, q_len = 0, kv_len = 0;  // B, N, T, S
  const int32_t* q_seq_lengths = nullptr;               // [B] or null
  const int32_t* kv_seq_lengths = nullptr;              // [B] or null
  bool causal = false;
  bool bottom_right = false;
  int64_t window_left = -1;
  int64_t window_right = -1;

  // True when some row may see no key at all (so outputs need fixing up).
  bool MayHaveEmptyRows() const;
};

struct FinalizeArgs {
  RowGeometry geometry;
  const float* row_max = nullptr;  // [B, N, T] cuDNN Max, or null
  const float* sum_exp = nullptr;  // [B, N, T] cuDNN Sum_exp, or null (lse already holds Stats)
  float* lse = nullptr;            // [B, N, T]: written from Max/Sum_exp, or fixed for empty rows; or null
  float* max_logit = nullptr;      // [B, N]: max over visible rows of row_max; or null
  void* out = nullptr;             // [B, T, N, Hv] 2-byte elements: empty rows zeroed; or null
  int32_t head_dim_v = 0;
};

// One block per (b, n).
cudaError_t LaunchFinalizeForward(const FinalizeArgs& args, cudaStream_t stream);

// lse_out = lse with rows that see no key set to 0 (cuDNN's backward would
// compute exp(-inf - -inf) there). [B, N, T].
cudaError_t LaunchBackwardLse(const RowGeometry& geometry, const float* lse, float* lse_out,
                              cudaStream_t stream);

// Zeroes rows l >= lengths[b] of a [batch, rows, row_elems] buffer of 2-byte elements.
cudaError_t LaunchZeroPaddedRows(void* data, int32_t batch, int32_t rows, int64_t row_elems,
                                 const int32_t* lengths, cudaStream_t stream);

}  // namespace maxattn::cudnn

#endif  // MAXATTN_CUDNN_KERNELS_H_
