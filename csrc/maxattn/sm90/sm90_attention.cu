// maxattn sm90: argument checks, the run-time dispatch over the forward's kernel
// instances (head dim x dtype x soft cap; the consumer-loop variant per head dim is
// the one measured and tested on the GPU, see NOTES.md), the segment-id pre-pass
// and the degenerate cases.
#include "maxattn/sm90/sm90_attention.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <exception>
#include <string>

#include <cutlass/numeric_types.h>

#include "maxattn/float_max.cuh"
#include "maxattn/sm90/kernel_config.h"
#include "maxattn/sm90/launch.h"
#include "maxattn/sm90/problem.h"

namespace maxattn {
namespace {

using sm90::CudaStatus;

constexpr int64_t kMaxGridYZ = 65535;
constexpr int64_t kMaxLen = int64_t{1} << 30;

// lse [B, N, T] of rows that see no key: the head's sink logit.
__global__ void FillSinkLseKernel(float* lse, const float* sink, int64_t n, int64_t heads, int64_t q_len) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    lse[i] = sink[(i / q_len) % heads];
  }
}

Status FillEmptyLse(float* lse, const float* sink, int64_t B, int64_t N, int64_t T, cudaStream_t stream) {
  if (sink == nullptr) return sm90::FillFloats(lse, B * N * T, -INFINITY, stream);
  if (lse == nullptr) return Status::Ok();
  const int64_t n = B * N * T;
  const int64_t blocks = (n + 255) / 256 < 1024 ? (n + 255) / 256 : 1024;
  FillSinkLseKernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(lse, sink, n, N, T);
  return CudaStatus(cudaGetLastError(), "sink lse fill kernel launch");
}

// The instance for one head dim and soft cap, in the input's element type; its loop is
// ForwardVariant's choice (kernel_config.h).
template <int kHeadDim, bool kSoftcap>
Status LaunchInstance(bool bf16, const sm90::FwdArgs& args, const AttentionInputs& inputs, cudaStream_t stream) {
  constexpr int kVariant = sm90::ForwardVariant(kHeadDim, kSoftcap);
  return bf16 ? sm90::LaunchForward<kHeadDim, cutlass::bfloat16_t, kVariant, kSoftcap>(args, inputs.q, inputs.k,
                                                                                     inputs.v, stream)
              : sm90::LaunchForward<kHeadDim, cutlass::half_t, kVariant, kSoftcap>(args, inputs.q, inputs.k,
                                                                                 inputs.v, stream);
}

template <bool kSoftcap>
Status DispatchHeadDim(const AttentionShape& shape, const sm90::FwdArgs& args, const AttentionInputs& inputs,
                       cudaStream_t stream) {
  const bool bf16 = inputs.dtype == DType::kBFloat16;
  switch (shape.head_dim) {
    case 64: return LaunchInstance<64, kSoftcap>(bf16, args, inputs, stream);
    case 128: return LaunchInstance<128, kSoftcap>(bf16, args, inputs, stream);
    case 256: return LaunchInstance<256, kSoftcap>(bf16, args, inputs, stream);
    default:
      return Status::Internal("sm90 attention: no kernel for head_dim " + std::to_string(shape.head_dim));
  }
}

Status Dispatch(const AttentionShape& shape, const sm90::FwdArgs& args, const AttentionInputs& inputs,
                cudaStream_t stream) {
  return args.softcap > 0.0f ? DispatchHeadDim<true>(shape, args, inputs, stream)
                             : DispatchHeadDim<false>(shape, args, inputs, stream);
}

Status ForwardImpl(const AttentionShape& shape, const AttentionOptions& options, const AttentionInputs& inputs,
                   const ForwardOutputs& outputs, const DeviceContext& ctx) {
  cudaStream_t stream = ctx.stream;
  MAXATTN_RETURN_IF_ERROR(ValidateShapeAndOptions(shape, options, inputs));
  if (auto reason = Sm90UnsupportedReason(shape, options, inputs)) return Status::Unimplemented(*reason);
  if (outputs.out == nullptr) return Status::InvalidArgument("sm90 attention: outputs.out is null");
  if (!sm90::Aligned16(outputs.out)) {
    return Status::Unimplemented("sm90 backend: outputs.out must be 16-byte aligned");
  }
  MAXATTN_RETURN_IF_ERROR(sm90::CheckSm90Device());

  const int64_t B = shape.batch, T = shape.q_len, S = shape.kv_len, N = shape.num_q_heads;
  const int64_t out_bytes = B * T * N * shape.head_dim_v *
                            static_cast<int64_t>(inputs.dtype == DType::kFloat32 ? 4 : 2);
  const int64_t max_rows = outputs.max_logit_over_batch ? 1 : B;  // of max_logit [rows, N]
  if (B == 0 || N == 0 || T == 0) return sm90::FillFloats(outputs.max_logit, max_rows * N, -INFINITY, stream);
  if (S == 0) {  // every row fully masked
    MAXATTN_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(outputs.out, 0, static_cast<size_t>(out_bytes), stream),
                                       "cudaMemsetAsync(out)"));
    MAXATTN_RETURN_IF_ERROR(FillEmptyLse(outputs.lse, inputs.sink_logits, B, N, T, stream));
    return sm90::FillFloats(outputs.max_logit, max_rows * N, -INFINITY, stream);
  }

  sm90::FwdArgs args;
  static_cast<sm90::ProblemArgs&>(args) = sm90::MakeProblemArgs(
      shape, options, inputs, sm90::kQueryBlockSize, sm90::KeyBlockSize(static_cast<int>(shape.head_dim)));
  args.out = outputs.out;
  args.lse = outputs.lse;
  args.max_logit = outputs.max_logit;
  args.max_logit_row_stride = outputs.max_logit_over_batch ? 0 : static_cast<int>(N);
  args.sink_logits = inputs.sink_logits;
  args.num_tiles = static_cast<int>(args.num_m_blocks * N * B);
  if (outputs.max_logit != nullptr) {
    // Below every float in the kernel's atomic ordering (float_max.cuh).
    MAXATTN_RETURN_IF_ERROR(
        CudaStatus(cudaMemsetAsync(outputs.max_logit, kAtomicMaxEmptyByte, static_cast<size_t>(max_rows * N) * 4,
                                   stream),
                   "cudaMemsetAsync(max_logit)"));
  }
  // Workspace, one block: the persistent grid's tile counter (16 bytes, zeroed
  // on the stream), then the segment-id summaries.
  const bool segments = inputs.q_segment_ids != nullptr;
  const size_t counter_bytes = static_cast<size_t>(Sm90TileCounterBytes(shape.head_dim));
  const size_t scratch_bytes = counter_bytes + (segments ? sm90::SegmentSummaryBytes(args, false) : 0);
  if (scratch_bytes > 0) {
    char* scratch = static_cast<char*>(ctx.allocate ? ctx.allocate(scratch_bytes) : nullptr);
    if (scratch == nullptr) {
      return Status::Internal("sm90 attention: could not allocate " + std::to_string(scratch_bytes) +
                              " bytes of workspace (tile counter and segment-id summaries)");
    }
    if (counter_bytes > 0) {
      args.tile_counter = reinterpret_cast<int*>(scratch);
      MAXATTN_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(args.tile_counter, 0, sizeof(int), stream),
                                         "cudaMemsetAsync(tile counter)"));
    }
    if (segments) {
      MAXATTN_RETURN_IF_ERROR(sm90::PrepareSegments(inputs, false, scratch + counter_bytes, stream, &args));
    }
  }
  return Dispatch(shape, args, inputs, stream);
}

}  // namespace

std::optional<std::string> Sm90UnsupportedReason(const AttentionShape& shape, const AttentionOptions& options,
                                                 const AttentionInputs& inputs) {
  if (inputs.dtype != DType::kBFloat16 && inputs.dtype != DType::kFloat16) {
    return std::string("sm90 backend: dtype must be bfloat16 or float16 (float32 is not supported)");
  }
  if (shape.head_dim != shape.head_dim_v) {
    return "sm90 backend: head_dim (" + std::to_string(shape.head_dim) + ") must equal head_dim_v (" +
           std::to_string(shape.head_dim_v) + ")";
  }
  if (shape.head_dim != 64 && shape.head_dim != 128 && shape.head_dim != 256) {
    return "sm90 backend: head_dim must be 64, 128 or 256 (got " + std::to_string(shape.head_dim) + ")";
  }
  if (inputs.bias != nullptr) return std::string("sm90 backend: bias is not supported");
  if (inputs.mask != nullptr) return std::string("sm90 backend: a dense boolean mask is not supported");
  if (options.dropout_rate > 0.0f) return std::string("sm90 backend: dropout is not supported");
  if (!(options.scale > 0.0f) || !std::isfinite(options.scale)) {
    return std::string("sm90 backend: scale must be positive and finite");
  }
  if (shape.num_kv_heads <= 0 || shape.num_q_heads % shape.num_kv_heads != 0) {
    return std::string("sm90 backend: num_q_heads must be a multiple of num_kv_heads");
  }
  if (shape.q_len > kMaxLen || shape.kv_len > kMaxLen) {
    return std::string("sm90 backend: q_len and kv_len must be at most 2^30");
  }
  if (shape.num_q_heads > kMaxGridYZ) return std::string("sm90 backend: num_q_heads must be at most 65535");
  if (shape.batch > kMaxGridYZ) return std::string("sm90 backend: batch must be at most 65535");
  if ((shape.q_len + 127) / 128 * shape.num_q_heads * shape.batch > INT32_MAX) {
    return std::string("sm90 backend: ceil(q_len / 128) * num_q_heads * batch must fit in int32");
  }
  if (shape.num_q_heads > INT32_MAX) return std::string("sm90 backend: num_q_heads must fit in int32");
  // TMA: global strides below 2^40 bytes.
  const int64_t elem = 2;
  const int64_t q_batch_stride = shape.q_len * shape.num_q_heads * shape.head_dim * elem;
  const int64_t kv_batch_stride = shape.kv_len * shape.num_kv_heads * shape.head_dim * elem;
  if (q_batch_stride >= (int64_t{1} << 40) || kv_batch_stride >= (int64_t{1} << 40)) {
    return std::string("sm90 backend: one batch row of q, k or v must be smaller than 2^40 bytes");
  }
  if (!sm90::Aligned16(inputs.q) || !sm90::Aligned16(inputs.k) || !sm90::Aligned16(inputs.v)) {
    return std::string("sm90 backend: q, k and v must be 16-byte aligned");
  }
  return std::nullopt;
}

int Sm90TileCounterBytes(int64_t head_dim) {
  return sm90::UsesTileCounter(static_cast<int>(head_dim)) ? 16 : 0;
}

Status AttentionForwardSm90(const AttentionShape& shape, const AttentionOptions& options,
                            const AttentionInputs& inputs, const ForwardOutputs& outputs, const DeviceContext& ctx) {
  try {
    return ForwardImpl(shape, options, inputs, outputs, ctx);
  } catch (const std::exception& e) {
    return Status::Internal(std::string("sm90 attention: ") + e.what());
  } catch (...) {
    return Status::Internal("sm90 attention: unknown exception");
  }
}

}  // namespace maxattn
