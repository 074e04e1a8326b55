// XLA FFI handlers of the CPU backend: decode, check, call the core.
#include "ffi/decode.h"
#include "ffi/handlers.h"

namespace maxattn::ffi_glue {
namespace {

constexpr const char* kFwdOp = "maxattn_attention_fwd_cpu";
constexpr const char* kBwdOp = "maxattn_attention_bwd_cpu";

ffi::Error ForwardImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                       ffi::AnyBuffer mask, ffi::AnyBuffer q_seq_lengths, ffi::AnyBuffer kv_seq_lengths,
                       ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids, float scale,
                       bool is_causal, bool bottom_right, int64_t window_left, int64_t window_right,
                       float softcap, bool has_bias, bool has_mask, bool has_q_seq_lengths,
                       bool has_kv_seq_lengths, bool has_segment_ids, ffi::AnyBuffer sink_logits,
                       ffi::AnyBuffer dropout_seed, float dropout_rate, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> max_logit) {
  DecodedCall call;
  MAXATTN_FFI_RETURN_IF_ERROR(DecodeCall(kFwdOp,
                                         {q, k, v, bias, mask, q_seq_lengths, kv_seq_lengths, q_segment_ids,
                                          kv_segment_ids, sink_logits, dropout_seed},
                                         {scale, is_causal, bottom_right, window_left, window_right, softcap,
                                          has_bias, has_mask, has_q_seq_lengths, has_kv_seq_lengths,
                                          has_segment_ids, dropout_rate},
                                         ffi::DataType::F32, &call));
  ForwardOutputs outputs;
  MAXATTN_FFI_RETURN_IF_ERROR(
      DecodeForwardOutputs(kFwdOp, call, q.element_type(), *out, *lse, *max_logit, &outputs));
  return ToFfiError(AttentionForwardCpu(call.shape, call.options, call.inputs, outputs));
}

ffi::Error BackwardImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                        ffi::AnyBuffer mask, ffi::AnyBuffer q_seq_lengths, ffi::AnyBuffer kv_seq_lengths,
                        ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids, float scale,
                        bool is_causal, bool bottom_right, int64_t window_left, int64_t window_right,
                        float softcap, bool has_bias, bool has_mask, bool has_q_seq_lengths,
                        bool has_kv_seq_lengths, bool has_segment_ids, ffi::AnyBuffer sink_logits,
                        ffi::AnyBuffer dropout_seed, float dropout_rate, ffi::AnyBuffer out,
                        ffi::AnyBuffer dout, ffi::AnyBuffer lse, ffi::AnyBuffer dlse,
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
                                         ffi::DataType::F32, &call));
  BackwardInputs saved;
  BackwardOutputs grads;
  MAXATTN_FFI_RETURN_IF_ERROR(DecodeBackwardBuffers(kBwdOp, call, q.element_type(), ffi::DataType::F32, out,
                                                    dout, lse, dlse, *dq, *dk, *dv, *dbias, *dsink, &saved,
                                                    &grads));
  return ToFfiError(AttentionBackwardCpu(call.shape, call.options, call.inputs, saved, grads));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxattnAttentionFwdCpu, ForwardImpl,
                              BindCommon(ffi::Ffi::Bind())
                                  .Ret<ffi::AnyBuffer>()   // out [B, T, N, Hv]
                                  .Ret<ffi::AnyBuffer>()   // lse [B, N, T] f32, or [0]
                                  .Ret<ffi::AnyBuffer>()); // max_logit [B, N] f32, or [0]

XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxattnAttentionBwdCpu, BackwardImpl,
                              BindCommon(ffi::Ffi::Bind())
                                  .Arg<ffi::AnyBuffer>()   // out [B, T, N, Hv]
                                  .Arg<ffi::AnyBuffer>()   // dout [B, T, N, Hv]
                                  .Arg<ffi::AnyBuffer>()   // lse [B, N, T] f32
                                  .Arg<ffi::AnyBuffer>()   // dlse [B, N, T] f32, or [0] (zero)
                                  .Ret<ffi::AnyBuffer>()   // dq
                                  .Ret<ffi::AnyBuffer>()   // dk
                                  .Ret<ffi::AnyBuffer>()   // dv
                                  .Ret<ffi::AnyBuffer>()   // dbias f32 like bias, or [0]
                                  .Ret<ffi::AnyBuffer>()); // dsink [B, N] f32, or [0]

}  // namespace maxattn::ffi_glue
