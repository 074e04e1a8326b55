// maxattn sm90: host-side helpers shared by the forward and the backward
// launchers (sm90_attention.cu, sm90_backward.cu): the CUDA status wrapper, the
// device check, the ProblemArgs every kernel reads (kernel_config.h), built
// from the call in one place, and the segment-id summaries' workspace.
#ifndef MAXATTN_SM90_PROBLEM_H_
#define MAXATTN_SM90_PROBLEM_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "maxattn/attention.h"
#include "maxattn/sm90/kernel_config.h"

namespace maxattn::sm90 {

// Ok, or Internal naming `what` and the CUDA error.
Status CudaStatus(cudaError_t err, const char* what);

// Ok when the current device is compute capability 9.0, else Unimplemented.
Status CheckSm90Device();

bool Aligned16(const void* p);

// Fills `data[0, n)` with `value` on the stream (nothing when data is null or n == 0).
Status FillFloats(float* data, int64_t n, float value, cudaStream_t stream);

// The call's sizes, visibility and scales for a kernel whose tiles are
// block_m queries by block_n keys (the segment summaries are left null:
// PrepareSegments sets them).
ProblemArgs MakeProblemArgs(const AttentionShape& shape, const AttentionOptions& options,
                            const AttentionInputs& inputs, int block_m, int block_n);

// Bytes of the segment-id summaries for `args`' tiles (segments.h), with the
// backward's key-block queries when `key_block_queries`.
size_t SegmentSummaryBytes(const ProblemArgs& args, bool key_block_queries);

// Enqueues the segment-id summaries into `scratch` (SegmentSummaryBytes of
// 16-byte-aligned device memory) and points args at them and at the ids.
Status PrepareSegments(const AttentionInputs& inputs, bool key_block_queries, void* scratch, cudaStream_t stream,
                       ProblemArgs* args);

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_PROBLEM_H_
