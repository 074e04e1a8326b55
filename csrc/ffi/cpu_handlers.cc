// XLA FFI handlers of the CPU backend: decode, check, call the core.
#include <string>

#include "ffi/decode.h"
#include "ffi/handlers.h"

namespace maxattn::ffi_glue {
namespace {

constexpr const char* kFwdOp = "maxattn_attention_fwd_cpu";
constexpr const char* kBwdOp = "maxattn_attention_bwd_cpu";

// The CPU-only operands/attribute bound after BindCommon's: sink_logits [N]
// f32 (or [0]: vanilla softmax), dropout_seed [4] u32 (or [0]: no dropout),
// dropout_rate. Fills the corresponding fields of `call`.
ffi::Error DecodeExtras(const char* op, const ffi::AnyBuffer& sink_logits, const ffi::AnyBuffer& dropout_seed,
                        float dropout_rate, DecodedCall* call) {
  const bool has_sink = sink_logits.element_count() != 0 || sink_logits.dimensions().size() != 1;
  if (has_sink) {
    MAXATTN_FFI_RETURN_IF_ERROR(
        CheckOptional(op, "sink_logits", sink_logits, true, ffi::DataType::F32, {call->shape.num_q_heads}));
    call->inputs.sink_logits = static_cast<const float*>(sink_logits.untyped_data());
  }
  call->options.dropout_rate = dropout_rate;
  if (dropout_rate > 0.0f) {
    MAXATTN_FFI_RETURN_IF_ERROR(CheckOptional(op, "dropout_seed", dropout_seed, true, ffi::DataType::U32, {4}));
    call->inputs.dropout_seed = static_cast<const uint32_t*>(dropout_seed.untyped_data());
  } else {
    MAXATTN_FFI_RETURN_IF_ERROR(CheckOptional(op, "dropout_seed", dropout_seed, false, ffi::DataType::U32, {}));
  }
  return ToFfiError(ValidateShapeAndOptions(call->shape, call->options, call->inputs));
}

ffi::Error ForwardImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                       ffi::AnyBuffer mask, ffi::AnyBuffer q_seq_lengths, ffi::AnyBuffer kv_seq_lengths,
                       ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids, float scale,
                       bool is_causal, bool bottom_right, int64_t window_left, int64_t window_right,
                       float softcap, bool has_bias, bool has_mask, bool has_q_seq_lengths,
                       bool has_kv_seq_lengths, bool has_segment_ids, ffi::AnyBuffer sink_logits,
                       ffi::AnyBuffer dropout_seed, float dropout_rate, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> max_logit) {
  DecodedCall call;
  MAXATTN_FFI_RETURN_IF_ERROR(DecodeCall(
      kFwdOp, {q, k, v, bias, mask, q_seq_lengths, kv_seq_lengths, q_segment_ids, kv_segment_ids},
      {scale, is_causal, bottom_right, window_left, window_right, softcap, has_bias, has_mask,
       has_q_seq_lengths, has_kv_seq_lengths, has_segment_ids},
      ffi::DataType::F32, &call));
  MAXATTN_FFI_RETURN_IF_ERROR(DecodeExtras(kFwdOp, sink_logits, dropout_seed, dropout_rate, &call));
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
  MAXATTN_FFI_RETURN_IF_ERROR(DecodeCall(
      kBwdOp, {q, k, v, bias, mask, q_seq_lengths, kv_seq_lengths, q_segment_ids, kv_segment_ids},
      {scale, is_causal, bottom_right, window_left, window_right, softcap, has_bias, has_mask,
       has_q_seq_lengths, has_kv_seq_lengths, has_segment_ids},
      ffi::DataType::F32, &call));
  MAXATTN_FFI_RETURN_IF_ERROR(DecodeExtras(kBwdOp, sink_logits, dropout_seed, dropout_rate, &call));
  const AttentionShape& s = call.shape;
  const ffi::DataType t = q.element_type();
  const std::vector<int64_t> out_dims = {s.batch, s.q_len, s.num_q_heads, s.head_dim_v};
  const std::vector<int64_t> lse_dims = {s.batch, s.num_q_heads, s.q_len};
  MAXATTN_FFI_RETURN_IF_ERROR(CheckType(kBwdOp, "out", out.element_type(), t));
  MAXATTN_FFI_RETURN_IF_ERROR(CheckDims(kBwdOp, "out", out.dimensions(), out_dims));
  MAXATTN_FFI_RETURN_IF_ERROR(CheckType(kBwdOp, "dout", dout.element_type(), t));
  MAXATTN_FFI_RETURN_IF_ERROR(CheckDims(kBwdOp, "dout", dout.dimensions(), out_dims));
  MAXATTN_FFI_RETURN_IF_ERROR(CheckType(kBwdOp, "lse", lse.element_type(), ffi::DataType::F32));
  MAXATTN_FFI_RETURN_IF_ERROR(CheckDims(kBwdOp, "lse", lse.dimensions(), lse_dims));
  bool has_dlse = false;
  MAXATTN_FFI_RETURN_IF_ERROR(CheckOutput(kBwdOp, "dlse", dlse, ffi::DataType::F32, lse_dims, &has_dlse));
  MAXATTN_FFI_RETURN_IF_ERROR(CheckType(kBwdOp, "dq", dq->element_type(), t));
  MAXATTN_FFI_RETURN_IF_ERROR(CheckDims(kBwdOp, "dq", dq->dimensions(), {s.batch, s.q_len, s.num_q_heads, s.head_dim}));
  MAXATTN_FFI_RETURN_IF_ERROR(CheckType(kBwdOp, "dk", dk->element_type(), t));
  MAXATTN_FFI_RETURN_IF_ERROR(CheckDims(kBwdOp, "dk", dk->dimensions(), {s.batch, s.kv_len, s.num_kv_heads, s.head_dim}));
  MAXATTN_FFI_RETURN_IF_ERROR(CheckType(kBwdOp, "dv", dv->element_type(), t));
  MAXATTN_FFI_RETURN_IF_ERROR(CheckDims(kBwdOp, "dv", dv->dimensions(), {s.batch, s.kv_len, s.num_kv_heads, s.head_dim_v}));
  bool want_dbias = false;
  if (has_bias) {
    const BroadcastDims& b = call.inputs.bias_dims;
    MAXATTN_FFI_RETURN_IF_ERROR(
        CheckOutput(kBwdOp, "dbias", *dbias, ffi::DataType::F32, {b.b, b.n, b.t, b.s}, &want_dbias));
  } else {
    MAXATTN_FFI_RETURN_IF_ERROR(CheckOptional(kBwdOp, "dbias", *dbias, false, ffi::DataType::F32, {}));
  }

  bool want_dsink = false;
  MAXATTN_FFI_RETURN_IF_ERROR(
      CheckOutput(kBwdOp, "dsink", *dsink, ffi::DataType::F32, {s.batch, s.num_q_heads}, &want_dsink));

  BackwardInputs saved;
  saved.out = out.untyped_data();
  saved.dout = dout.untyped_data();
  saved.lse = static_cast<const float*>(lse.untyped_data());
  saved.dlse = has_dlse ? static_cast<const float*>(dlse.untyped_data()) : nullptr;
  BackwardOutputs grads;
  grads.dq = dq->untyped_data();
  grads.dk = dk->untyped_data();
  grads.dv = dv->untyped_data();
  grads.dbias = want_dbias ? static_cast<float*>(dbias->untyped_data()) : nullptr;
  grads.dsink = want_dsink ? static_cast<float*>(dsink->untyped_data()) : nullptr;
  return ToFfiError(AttentionBackwardCpu(s, call.options, call.inputs, saved, grads));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxattnAttentionFwdCpu, ForwardImpl,
                              BindCommon(ffi::Ffi::Bind())
                                  .Arg<ffi::AnyBuffer>()   // sink_logits [N] f32, or [0]
                                  .Arg<ffi::AnyBuffer>()   // dropout_seed [4] u32, or [0]
                                  .Attr<float>("dropout_rate")
                                  .Ret<ffi::AnyBuffer>()   // out [B, T, N, Hv]
                                  .Ret<ffi::AnyBuffer>()   // lse [B, N, T] f32, or [0]
                                  .Ret<ffi::AnyBuffer>()); // max_logit [B, N] f32, or [0]

XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxattnAttentionBwdCpu, BackwardImpl,
                              BindCommon(ffi::Ffi::Bind())
                                  .Arg<ffi::AnyBuffer>()   // sink_logits [N] f32, or [0]
                                  .Arg<ffi::AnyBuffer>()   // dropout_seed [4] u32, or [0]
                                  .Attr<float>("dropout_rate")
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
