// XLA FFI handlers of the cuDNN backend: decode, check, call the core.
//
// Same operands, attributes and results as the CPU handlers (see decode.h),
// except that a bias (and dbias) has the input dtype, as cuDNN expects. Every failure comes
// back as an ffi::Error; nothing throws across the FFI boundary.
#include <cuda_runtime_api.h>

#include <exception>
#include <string>
#include <utility>

#include "ffi/decode.h"
#include "maxattn/cudnn/cudnn_attention.h"

namespace maxattn::ffi_glue {
namespace {

constexpr const char* kFwdOp = "maxattn_attention_fwd_cuda";
constexpr const char* kBwdOp = "maxattn_attention_bwd_cuda";

cudnn::DeviceContext MakeContext(cudaStream_t stream, int32_t device, ffi::ScratchAllocator& scratch) {
  cudnn::DeviceContext ctx;
  ctx.device = device;
  ctx.stream = stream;
  ctx.allocate = [&scratch](size_t bytes) -> void* {
    // XLA's FFI allocator refuses alignments above 16 bytes (64 was refused on the H200 run).
    auto p = scratch.Allocate(bytes, 16);
    return p.has_value() ? *p : nullptr;
  };
  return ctx;
}

ffi::Error ForwardImpl(cudaStream_t stream, int32_t device, ffi::ScratchAllocator scratch, ffi::AnyBuffer q,
                       ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias, ffi::AnyBuffer mask,
                       ffi::AnyBuffer q_seq_lengths, ffi::AnyBuffer kv_seq_lengths, ffi::AnyBuffer q_segment_ids,
                       ffi::AnyBuffer kv_segment_ids, float scale, bool is_causal, bool bottom_right,
                       int64_t window_left, int64_t window_right, float softcap, bool has_bias, bool has_mask,
                       bool has_q_seq_lengths, bool has_kv_seq_lengths, bool has_segment_ids,
                       ffi::AnyBuffer sink_logits, ffi::AnyBuffer dropout_seed, float dropout_rate,
                       ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                       ffi::Result<ffi::AnyBuffer> max_logit) {
  DecodedCall call;
  MAXATTN_FFI_RETURN_IF_ERROR(DecodeCall(kFwdOp,
                                         {q, k, v, bias, mask, q_seq_lengths, kv_seq_lengths, q_segment_ids,
                                          kv_segment_ids, sink_logits, dropout_seed},
                                         {scale, is_causal, bottom_right, window_left, window_right, softcap,
                                          has_bias, has_mask, has_q_seq_lengths, has_kv_seq_lengths,
                                          has_segment_ids, dropout_rate},
                                         q.element_type(), &call));
  ForwardOutputs outputs;
  MAXATTN_FFI_RETURN_IF_ERROR(
      DecodeForwardOutputs(kFwdOp, call, q.element_type(), *out, *lse, *max_logit, &outputs));
  try {
    return ToFfiError(cudnn::AttentionForwardCudnn(call.shape, call.options, call.inputs, outputs,
                                                   MakeContext(stream, device, scratch)));
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string(kFwdOp) + ": " + e.what());
  }
}

ffi::Error BackwardImpl(cudaStream_t stream, int32_t device, ffi::ScratchAllocator scratch, ffi::AnyBuffer q,
                        ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias, ffi::AnyBuffer mask,
                        ffi::AnyBuffer q_seq_lengths, ffi::AnyBuffer kv_seq_lengths, ffi::AnyBuffer q_segment_ids,
                        ffi::AnyBuffer kv_segment_ids, float scale, bool is_causal, bool bottom_right,
                        int64_t window_left, int64_t window_right, float softcap, bool has_bias, bool has_mask,
                        bool has_q_seq_lengths, bool has_kv_seq_lengths, bool has_segment_ids,
                        ffi::AnyBuffer sink_logits, ffi::AnyBuffer dropout_seed, float dropout_rate,
                        ffi::AnyBuffer out, ffi::AnyBuffer dout, ffi::AnyBuffer lse, ffi::AnyBuffer dlse,
                        ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                        ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dbias,
                        ffi::Result<ffi::AnyBuffer> dsink) {
  DecodedCall call;
  MAXATTN_FFI_RETURN_IF_ERROR(DecodeCall(kBwdOp,
                                         {q, k, v, bias, mask, q_seq_lengths, kv_seq_lengths, q_segment_ids,
                                          kv_segment_ids, sink_logits, dropout_seed},
                                         {scale, is_causal, bottom_right, window_left, window_right, softcap,
                                          has_bias, has_mask, has_q_seq_lengths, has_kv_seq_lengths,
                                          has_segment_ids, dropout_rate},
                                         q.element_type(), &call));
  BackwardInputs saved;
  BackwardOutputs grads;
  MAXATTN_FFI_RETURN_IF_ERROR(DecodeBackwardBuffers(kBwdOp, call, q.element_type(), q.element_type(), out, dout,
                                                    lse, dlse, *dq, *dk, *dv, *dbias, *dsink, &saved, &grads));
  try {
    return ToFfiError(cudnn::AttentionBackwardCudnn(call.shape, call.options, call.inputs, saved, grads,
                                                    MakeContext(stream, device, scratch)));
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string(kBwdOp) + ": " + e.what());
  }
}

template <typename Binding>
auto BindContext(Binding binding) {
  return std::move(binding).template Ctx<ffi::PlatformStream<cudaStream_t>>()  // the call's CUDA stream
      .template Ctx<ffi::DeviceOrdinal>()                           // the call's device
      .template Ctx<ffi::ScratchAllocator>();                       // cuDNN workspace and statistics
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxattnAttentionFwdCuda, ForwardImpl,
                              BindCommon(BindContext(ffi::Ffi::Bind()))
                                  .Ret<ffi::AnyBuffer>()   // out [B, T, N, Hv]
                                  .Ret<ffi::AnyBuffer>()   // lse [B, N, T] f32, or [0]
                                  .Ret<ffi::AnyBuffer>()); // max_logit [B, N] f32, or [0]

XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxattnAttentionBwdCuda, BackwardImpl,
                              BindCommon(BindContext(ffi::Ffi::Bind()))
                                  .Arg<ffi::AnyBuffer>()   // out [B, T, N, Hv]
                                  .Arg<ffi::AnyBuffer>()   // dout [B, T, N, Hv]
                                  .Arg<ffi::AnyBuffer>()   // lse [B, N, T] f32
                                  .Arg<ffi::AnyBuffer>()   // dlse: must be [0] (folded into out/dout/v by Python)
                                  .Ret<ffi::AnyBuffer>()   // dq
                                  .Ret<ffi::AnyBuffer>()   // dk
                                  .Ret<ffi::AnyBuffer>()   // dv
                                  .Ret<ffi::AnyBuffer>()   // dbias like bias (input dtype), or [0]
                                  .Ret<ffi::AnyBuffer>()); // dsink [B, N] f32, or [0]

}  // namespace maxattn::ffi_glue
