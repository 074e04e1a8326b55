// maxattn sm90: the backward's host side -- argument checks, the workspace,
// the degenerate cases, and the four launches on the stream: pre-pass
// (bwd_prepost.h), segment summaries, the main kernel dispatched over its
// instances (head dim x dtype x soft cap) and its dQ post-pass (bwd_kernel.h).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <exception>
#include <string>

#include <cutlass/numeric_types.h>

#include "maxattn/sm90/bwd_config.h"
#include "maxattn/sm90/bwd_prepost.h"
#include "maxattn/sm90/launch.h"
#include "maxattn/sm90/problem.h"
#include "maxattn/sm90/sm90_attention.h"

namespace maxattn {
namespace {

using sm90::CudaStatus;

int64_t ElementBytes(DType t) { return t == DType::kFloat32 ? 4 : 2; }

template <bool kSoftcap>
Status DispatchBackward(const AttentionShape& shape, const sm90::BwdArgs& args, const AttentionInputs& inputs,
                        const BackwardInputs& saved, cudaStream_t stream) {
  using sm90::LaunchBackward;
  const bool bf16 = inputs.dtype == DType::kBFloat16;
  const void *q = inputs.q, *k = inputs.k, *v = inputs.v, *dout = saved.dout;
  switch (shape.head_dim) {
    case 64:
      return bf16 ? LaunchBackward<64, cutlass::bfloat16_t, kSoftcap>(args, q, k, v, dout, stream)
                  : LaunchBackward<64, cutlass::half_t, kSoftcap>(args, q, k, v, dout, stream);
    case 128:
      return bf16 ? LaunchBackward<128, cutlass::bfloat16_t, kSoftcap>(args, q, k, v, dout, stream)
                  : LaunchBackward<128, cutlass::half_t, kSoftcap>(args, q, k, v, dout, stream);
    case 256:
      return bf16 ? LaunchBackward<256, cutlass::bfloat16_t, kSoftcap>(args, q, k, v, dout, stream)
                  : LaunchBackward<256, cutlass::half_t, kSoftcap>(args, q, k, v, dout, stream);
    default:
      return Status::Internal("sm90 attention: no backward kernel for head_dim " + std::to_string(shape.head_dim));
  }
}

Status CheckBuffers(const AttentionInputs& inputs, const BackwardInputs& saved, const BackwardOutputs& grads) {
  const struct {
    const void* ptr;
    const char* name;
  } buffers[] = {{saved.out, "saved.out"}, {saved.dout, "saved.dout"}, {saved.lse, "saved.lse"},
                 {grads.dq, "grads.dq"},   {grads.dk, "grads.dk"},     {grads.dv, "grads.dv"}};
  for (const auto& b : buffers) {
    if (b.ptr == nullptr) return Status::InvalidArgument(std::string("sm90 attention: ") + b.name + " is null");
  }
  if (inputs.sink_logits != nullptr && grads.dsink == nullptr) {
    return Status::InvalidArgument("sm90 attention: grads.dsink is null but the call has sink logits");
  }
  const void* const aligned[] = {saved.out, saved.dout, grads.dq, grads.dk, grads.dv};
  for (const void* p : aligned) {
    if (!sm90::Aligned16(p)) {
      return Status::Unimplemented("sm90 backend: out, dout, dq, dk and dv must be 16-byte aligned");
    }
  }
  return Status::Ok();
}

Status BackwardImpl(const AttentionShape& shape, const AttentionOptions& options, const AttentionInputs& inputs,
                    const BackwardInputs& saved, const BackwardOutputs& grads, const DeviceContext& ctx) {
  cudaStream_t stream = ctx.stream;
  MAXATTN_RETURN_IF_ERROR(ValidateShapeAndOptions(shape, options, inputs));
  if (auto reason = Sm90BackwardUnsupportedReason(shape, options, inputs)) return Status::Unimplemented(*reason);
  MAXATTN_RETURN_IF_ERROR(CheckBuffers(inputs, saved, grads));
  MAXATTN_RETURN_IF_ERROR(sm90::CheckSm90Device());

  const int64_t B = shape.batch, T = shape.q_len, S = shape.kv_len, N = shape.num_q_heads, H = shape.head_dim;
  const int64_t elem = ElementBytes(inputs.dtype);
  const size_t dq_bytes = static_cast<size_t>(B * T * N * H * elem);
  const size_t dkv_bytes = static_cast<size_t>(B * S * shape.num_kv_heads * H * elem);
  if (grads.dsink != nullptr) {
    MAXATTN_RETURN_IF_ERROR(
        CudaStatus(cudaMemsetAsync(grads.dsink, 0, static_cast<size_t>(B * N) * 4, stream), "cudaMemsetAsync(dsink)"));
  }
  if (B == 0 || N == 0 || T == 0 || S == 0) {  // nothing is visible: zero gradients (and the sinks' own term)
    if (dq_bytes > 0) MAXATTN_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(grads.dq, 0, dq_bytes, stream), "cudaMemsetAsync(dq)"));
    if (dkv_bytes > 0) {
      MAXATTN_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(grads.dk, 0, dkv_bytes, stream), "cudaMemsetAsync(dk)"));
      MAXATTN_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(grads.dv, 0, dkv_bytes, stream), "cudaMemsetAsync(dv)"));
    }
    if (grads.dsink == nullptr || B * N * T == 0) return Status::Ok();
  }

  sm90::BwdArgs args;
  static_cast<sm90::ProblemArgs&>(args) =
      sm90::MakeProblemArgs(shape, options, inputs, sm90::kBwdBlockM, sm90::BwdBlockN(static_cast<int>(H)));
  args.t_pad = args.num_m_blocks * sm90::kBwdBlockM;
  args.dq = grads.dq;
  args.dk = grads.dk;
  args.dv = grads.dv;

  // Workspace, one block: dQ accumulator, lse*log2(e), D - dlse, the partial
  // sums of dsink, the dQ turn counters of the deterministic mode, segment
  // summaries (each part a multiple of 256 bytes).
  auto round256 = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
  const size_t accum_bytes = static_cast<size_t>(B * N * args.t_pad * H) * 4;
  const size_t stats_bytes = static_cast<size_t>(B * N * args.t_pad) * 4;
  const size_t partial_bytes =
      grads.dsink != nullptr ? round256(static_cast<size_t>(B * N * sm90::BwdPrepassBlocks(args.t_pad)) * 4) : 0;
  const size_t turns_bytes =
      options.deterministic
          ? round256(static_cast<size_t>(B * N * args.num_m_blocks * sm90::BwdTurnCounters(static_cast<int>(H))) * 4)
          : 0;
  const bool segments = inputs.q_segment_ids != nullptr;
  const size_t scratch_bytes = accum_bytes + 2 * stats_bytes + partial_bytes + turns_bytes +
                               (segments ? sm90::SegmentSummaryBytes(args, true) : 0);
  char* scratch = static_cast<char*>(ctx.allocate ? ctx.allocate(scratch_bytes) : nullptr);
  if (scratch == nullptr) {
    return Status::Internal("sm90 attention: could not allocate " + std::to_string(scratch_bytes) +
                            " bytes of backward workspace (dQ accumulator, row statistics, segment summaries)");
  }
  char* next = scratch;
  auto take = [&next](size_t bytes) {
    char* part = next;
    next += bytes;
    return part;
  };
  args.dq_accum = reinterpret_cast<float*>(take(accum_bytes));
  float* lse_log2 = reinterpret_cast<float*>(take(stats_bytes));
  float* dpsum = reinterpret_cast<float*>(take(stats_bytes));
  float* dsink_partial = reinterpret_cast<float*>(take(partial_bytes));
  args.dq_turns = options.deterministic ? reinterpret_cast<int*>(take(turns_bytes)) : nullptr;
  char* segment_summaries = take(0);
  args.lse_log2 = lse_log2;
  args.dpsum = dpsum;

  sm90::BwdPrepassArgs pre;
  pre.dtype = inputs.dtype;
  pre.out = saved.out;
  pre.dout = saved.dout;
  pre.lse = saved.lse;
  pre.dlse = saved.dlse;
  pre.q_lens = inputs.q_seq_lengths;
  pre.sink = inputs.sink_logits;
  pre.lse_log2 = lse_log2;
  pre.dpsum = dpsum;
  pre.dsink = grads.dsink;
  pre.dsink_partial = dsink_partial;
  pre.batch = static_cast<int>(B);
  pre.q_len = static_cast<int>(T);
  pre.heads = static_cast<int>(N);
  pre.head_dim = static_cast<int>(H);
  pre.t_pad = args.t_pad;
  pre.dq_accum = S > 0 ? args.dq_accum : nullptr;
  MAXATTN_RETURN_IF_ERROR(sm90::LaunchBwdPrepass(pre, stream));
  if (S == 0) return Status::Ok();  // only the sinks' gradient was left to compute

  if (args.dq_turns != nullptr) {
    MAXATTN_RETURN_IF_ERROR(
        CudaStatus(cudaMemsetAsync(args.dq_turns, 0, turns_bytes, stream), "cudaMemsetAsync(dq turn counters)"));
  }
  if (segments) MAXATTN_RETURN_IF_ERROR(sm90::PrepareSegments(inputs, true, segment_summaries, stream, &args));
  return options.softcap > 0.0f ? DispatchBackward<true>(shape, args, inputs, saved, stream)
                                : DispatchBackward<false>(shape, args, inputs, saved, stream);
}

}  // namespace

std::optional<std::string> Sm90BackwardUnsupportedReason(const AttentionShape& shape,
                                                         const AttentionOptions& options,
                                                         const AttentionInputs& inputs) {
  if (auto reason = Sm90UnsupportedReason(shape, options, inputs)) return reason;
  if (!sm90::BwdSupportsHeadDim(static_cast<int>(shape.head_dim))) {
    return "sm90 backward: head_dim must be 64, 128 or 256 (got " + std::to_string(shape.head_dim) + ")";
  }
  if (shape.num_kv_heads > 65535) return std::string("sm90 backward: num_kv_heads must be at most 65535");
  if (options.deterministic && shape.q_len > int64_t{sm90::kBwdMaxOrderedQueryBlocks} * sm90::kBwdBlockM) {
    return "sm90 backward: deterministic mode needs q_len <= " +
           std::to_string(int64_t{sm90::kBwdMaxOrderedQueryBlocks} * sm90::kBwdBlockM) + " (got " +
           std::to_string(shape.q_len) + ")";
  }
  return std::nullopt;
}

Status AttentionBackwardSm90(const AttentionShape& shape, const AttentionOptions& options,
                             const AttentionInputs& inputs, const BackwardInputs& saved,
                             const BackwardOutputs& grads, const DeviceContext& ctx) {
  try {
    return BackwardImpl(shape, options, inputs, saved, grads, ctx);
  } catch (const std::exception& e) {
    return Status::Internal(std::string("sm90 attention: ") + e.what());
  } catch (...) {
    return Status::Internal("sm90 attention: unknown exception");
  }
}

}  // namespace maxattn
