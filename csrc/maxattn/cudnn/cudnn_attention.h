// cuDNN backend of the maxattn core: fused SDPA through cudnn-frontend.
//
// Framework-free like the CPU backend: callers (csrc/ffi/cuda_handlers.cc)
// pass device pointers, the CUDA stream, the device ordinal and a workspace
// allocator. Layouts are those of attention.h, with two differences that the
// Python side (python/maxattn/_src/cudnn.py) arranges:
//   * bias is in the input dtype (bf16/fp16), not float32, with dims
//     [b', n', T, S] (b' in {1, B}, n' in {1, N}); dbias likewise.
//   * q_seq_lengths and kv_seq_lengths are both present or both absent.
//   * a dense boolean mask and segment ids are folded into the bias: entries
//     they remove hold the dtype's lowest finite value. Their operands are
//     still passed; their presence tells the backend that a row may lose every
//     key, which it detects from the softmax statistics (out = 0, lse = -inf).
//     Except with options.max_segments > 0 (no bias, mask, dropout or sink):
//     then the segment ids become cuDNN ragged sequences (ragged.h), O(B * T)
//     memory, and rows that break the max_segments promise come out NaN.
//   * the lse cotangent is folded into extra value columns (dlse is null).
// Not supported here (the Python backend refuses them before any call):
// float32, soft cap.
//
// Dropout uses cuDNN's Philox generator, seeded from the four words of
// inputs.dropout_seed: masks are reproducible for a given seed and shape, but
// differ from the CPU backend's. Sinks: cuDNN's sink token, except when
// max_logit is requested (cuDNN's Max would include the sink): then the
// vanilla softmax runs and one extra pass rescales out.
//
// Outputs follow the contract of attention.h: rows with no visible key get
// out = 0 and lse = -inf and are left out of max_logit, which is reduced to
// [B, N] on the GPU.
#ifndef MAXATTN_CUDNN_CUDNN_ATTENTION_H_
#define MAXATTN_CUDNN_CUDNN_ATTENTION_H_

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "maxattn/attention.h"
#include "maxattn/device_context.h"

namespace maxattn::cudnn {

// Where and how one call runs (device_context.h).
using DeviceContext = ::maxattn::DeviceContext;

// What support depends on besides the shape and options: the call as this
// backend receives it (after the Python side folded masks into the bias and
// completed the sequence lengths).
// (Segment ids as ragged sequences are options.max_segments > 0.)
struct CallFeatures {
  DType dtype = DType::kBFloat16;
  bool bias = false;            // a bias operand (the user's, or folded masks)
  bool masked_by_bias = false;  // a dense mask or segment ids are folded into it
  bool padding = false;         // sequence lengths
  bool sink = false;            // sink logits
};

CallFeatures FeaturesOf(const AttentionInputs& inputs, const AttentionOptions& options);

// The one support decision of the cudnn backend: Ok, or Unimplemented with the
// exact reason (python/maxattn/_src/backends/cudnn.py reports it through
// _maxattn_cuda.unsupported_reason, and both entry points below check it).
Status CheckSupported(const AttentionShape& shape, const AttentionOptions& options, const CallFeatures& features);

// The effective cuDNN version at run time (cudnnGetVersion(), e.g. 91900).
size_t RuntimeVersion();

// True when the SDPA node can emit Stats and Max together (cuDNN >= 9.21);
// below that the backend requests Max and Sum_exp and computes
// lse = Max + log(Sum_exp) in its own kernel.
bool SupportsStatsWithMax();

// outputs.lse / outputs.max_logit may be null (not requested): a call that
// requests neither runs the plain graph without softmax statistics.
Status AttentionForwardCudnn(const AttentionShape& shape, const AttentionOptions& options,
                             const AttentionInputs& inputs, const ForwardOutputs& outputs,
                             const DeviceContext& ctx);

// saved.lse is required; saved.dlse must be null (the Python side folds a
// non-zero lse cotangent into an extra value column). grads.dbias (input
// dtype, dims of the bias) is written when non-null.
Status AttentionBackwardCudnn(const AttentionShape& shape, const AttentionOptions& options,
                              const AttentionInputs& inputs, const BackwardInputs& saved,
                              const BackwardOutputs& grads, const DeviceContext& ctx);

// Test-only hooks (maxattn._maxattn_cuda._graph_builds and _fail_next_*).
namespace test_hooks {
int64_t GraphBuilds();                     // graphs built (and cached) in this process
void FailNextGraphBuilds(int n);           // the next n builds fail as a cuDNN rejection
void FailNextWorkspaceAllocations(int n);  // the next n scratch allocations fail
}  // namespace test_hooks

}  // namespace maxattn::cudnn

#endif  // MAXATTN_CUDNN_CUDNN_ATTENTION_H_
