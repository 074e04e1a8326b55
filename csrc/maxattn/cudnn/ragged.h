// Packed rows as cuDNN's ragged layout: segment ids -> per-segment lengths and
// ragged offsets, built on the stream in O(B * (T + S)) with no host sync.
//
// Row b of a call with max_segments = M becomes the M sequences b * M + m of
// cuDNN's graph: the m-th run of equal non-zero ids of the query row, paired
// with the m-th run of the key row. A sequence's tensors start at its first
// token inside the caller's [B, T, heads, dim] buffers (the ragged offset, in
// elements); its statistics are token-major, [B, T, N] (what cuDNN's ragged
// workspaces are sized for), starting at its first token. Slots past a row's
// count get length 0.
//
// The ragged form means the dense segment-id rule only when the row keeps the
// promise of AttentionOptions::max_segments: at most M runs, no id in two
// runs, the same ids in the same order for queries and keys, and -- with a
// causal mask or window -- each query run aligned with its key run (the
// dense diagonal through the row is the run's own top-left diagonal). A row
// that breaks it is *poisoned*: no sequence of it runs, and its rows are
// marked so the epilogue writes NaN (out, lse and so max_logit) and the
// backward zero gradients.
#ifndef MAXATTN_CUDNN_RAGGED_H_
#define MAXATTN_CUDNN_RAGGED_H_

#include <cstdint>

#include <cuda_runtime_api.h>

#include "maxattn/cudnn/kernels.h"

namespace maxattn::cudnn {

// What a query row r = (b, t) of a ragged call is (RaggedLayout::q_rows).
enum RowCode : uint8_t {
  kRowEmpty = 0,     // padding, or a query that sees no key of its segment: out 0, lse -inf
  kRowVisible = 1,   // sees at least one key
  kRowPoisoned = 2,  // its batch row breaks the layout promise: NaN
};

struct RaggedProblem {
  // B, N, T, S, the padding lengths (tokens past them are padding) and the
  // band, as the epilogue sees them (row_code unused here). N: the statistics
  // layout [B, T, N].
  RowGeometry rows;
  int32_t max_segments = 0;                 // M
  const int32_t* q_segment_ids = nullptr;   // [B, T]
  const int32_t* kv_segment_ids = nullptr;  // [B, S]
  // Elements per token of each tensor's buffer (heads * head dim).
  int64_t q_token = 0, k_token = 0, v_token = 0, o_token = 0;
  bool wide_offsets = false;  // int64 offsets (else int32: every offset < 2^31)
};

// Device buffers of the layout, all of them written by LaunchRaggedLayout.
struct RaggedLayout {
  int32_t* seq_len_q = nullptr;   // [B * M]
  int32_t* seq_len_kv = nullptr;  // [B * M]
  // [B * M + 1] each, int32 or int64 (RaggedProblem::wide_offsets); entry
  // B * M is the buffer's end.
  void* offset_q = nullptr;
  void* offset_k = nullptr;
  void* offset_v = nullptr;
  void* offset_o = nullptr;
  void* offset_stats = nullptr;
  uint8_t* q_rows = nullptr;   // [B, T] RowCode
  uint8_t* kv_rows = nullptr;  // [B, S] 1 where the key is in a running sequence, else 0
};

// True when some offset of `p` could reach 2^31 elements.
bool NeedsWideOffsets(const RaggedProblem& p);

// Bytes of device scratch for the layout of `p` (each part 256-byte aligned),
// and the layout carved from `scratch` (of at least that size).
int64_t RaggedLayoutBytes(const RaggedProblem& p);
RaggedLayout CarveRaggedLayout(const RaggedProblem& p, void* scratch);

// One block per batch row.
cudaError_t LaunchRaggedLayout(const RaggedProblem& p, const RaggedLayout& layout, cudaStream_t stream);

// Zeroes the rows r of a [batch * rows, row_elems] buffer of 2-byte elements
// whose code[r] != keep (gradients of tokens outside every running sequence).
cudaError_t LaunchZeroRowsExcept(void* data, int64_t rows, int64_t row_elems, const uint8_t* code, uint8_t keep,
                                 cudaStream_t stream);

}  // namespace maxattn::cudnn

#endif  // MAXATTN_CUDNN_RAGGED_H_
