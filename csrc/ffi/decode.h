// Decoding of the operands and attributes shared by every attention FFI
// target (CPU and CUDA, forward and backward) into the core's structs.
//
// Operand order of every target: q, k, v, bias, mask, q_seq_lengths,
// kv_seq_lengths, q_segment_ids, kv_segment_ids, sink_logits, dropout_seed.
// Absent optional operands are zero-sized placeholders; has_* attributes
// (and dropout_rate > 0) say which are present.
#ifndef MAXATTN_FFI_DECODE_H_
#define MAXATTN_FFI_DECODE_H_

#include <cstdint>
#include <string_view>
#include <utility>

#include "ffi/ffi_helpers.h"

namespace maxattn::ffi_glue {

// Attributes common to every target (see python/maxattn/_src/ffi_call.py).
struct CallAttrs {
  float scale;
  bool is_causal;
  bool bottom_right;
  int64_t window_left;
  int64_t window_right;
  float softcap;
  bool has_bias;
  bool has_mask;
  bool has_q_seq_lengths;
  bool has_kv_seq_lengths;
  bool has_segment_ids;
  float dropout_rate;
};

struct CallOperands {
  const ffi::AnyBuffer& q;
  const ffi::AnyBuffer& k;
  const ffi::AnyBuffer& v;
  const ffi::AnyBuffer& bias;
  const ffi::AnyBuffer& mask;
  const ffi::AnyBuffer& q_seq_lengths;
  const ffi::AnyBuffer& kv_seq_lengths;
  const ffi::AnyBuffer& q_segment_ids;
  const ffi::AnyBuffer& kv_segment_ids;
  const ffi::AnyBuffer& sink_logits;
  const ffi::AnyBuffer& dropout_seed;
};

struct DecodedCall {
  AttentionShape shape;
  AttentionOptions options;
  AttentionInputs inputs;
};

// Binds the eleven common operands and the attributes, in that order.
template <typename Binding>
auto BindCommon(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()            // q [B, T, N, H]
      .template Arg<ffi::AnyBuffer>()            // k [B, S, K, H]
      .template Arg<ffi::AnyBuffer>()            // v [B, S, K, Hv]
      .template Arg<ffi::AnyBuffer>()            // bias [b', n', t', s'] or placeholder
      .template Arg<ffi::AnyBuffer>()            // mask [b', n', t', s'] pred or placeholder
      .template Arg<ffi::AnyBuffer>()            // q_seq_lengths [B] s32 or placeholder
      .template Arg<ffi::AnyBuffer>()            // kv_seq_lengths [B] s32 or placeholder
      .template Arg<ffi::AnyBuffer>()            // q_segment_ids [B, T] s32 or placeholder
      .template Arg<ffi::AnyBuffer>()            // kv_segment_ids [B, S] s32 or placeholder
      .template Attr<float>("scale")
      .template Attr<bool>("is_causal")
      .template Attr<bool>("bottom_right")
      .template Attr<int64_t>("window_left")
      .template Attr<int64_t>("window_right")
      .template Attr<float>("softcap")
      .template Attr<bool>("has_bias")
      .template Attr<bool>("has_mask")
      .template Attr<bool>("has_q_seq_lengths")
      .template Attr<bool>("has_kv_seq_lengths")
      .template Attr<bool>("has_segment_ids")
      .template Arg<ffi::AnyBuffer>()            // sink_logits [N] f32 or placeholder (vanilla softmax)
      .template Arg<ffi::AnyBuffer>()            // dropout_seed [4] u32 or placeholder (no dropout)
      .template Attr<float>("dropout_rate");
}

// Checks every operand against q/k/v and the attributes and fills `call`.
// `bias_type` is the element type the backend expects for a present bias.
inline ffi::Error DecodeCall(std::string_view op, const CallOperands& in, const CallAttrs& attrs,
                             ffi::DataType bias_type, DecodedCall* call) {
  const auto qd = in.q.dimensions();
  const auto kd = in.k.dimensions();
  const auto vd = in.v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return ffi::Error::InvalidArgument(std::string(op) + ": q, k, v must have rank 4, got " +
                                       DimsToString(qd) + ", " + DimsToString(kd) + ", " +
                                       DimsToString(vd));
  }
  const auto dtype = ToCoreDType(in.q.element_type());
  if (!dtype) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": operand `q` must be float32, bfloat16 or float16");
  }
  MAXATTN_FFI_RETURN_IF_ERROR(CheckType(op, "k", in.k.element_type(), in.q.element_type()));
  MAXATTN_FFI_RETURN_IF_ERROR(CheckType(op, "v", in.v.element_type(), in.q.element_type()));

  AttentionShape& s = call->shape;
  s = AttentionShape{qd[0], qd[1], kd[1], qd[2], kd[2], qd[3], vd[3]};
  MAXATTN_FFI_RETURN_IF_ERROR(CheckDims(op, "k", kd, {s.batch, s.kv_len, s.num_kv_heads, s.head_dim}));
  MAXATTN_FFI_RETURN_IF_ERROR(CheckDims(op, "v", vd, {s.batch, s.kv_len, s.num_kv_heads, s.head_dim_v}));

  AttentionInputs& x = call->inputs;
  x = AttentionInputs{};
  x.dtype = *dtype;
  x.q = in.q.untyped_data();
  x.k = in.k.untyped_data();
  x.v = in.v.untyped_data();
  if (attrs.has_bias) {
    MAXATTN_FFI_RETURN_IF_ERROR(CheckType(op, "bias", in.bias.element_type(), bias_type));
    MAXATTN_FFI_RETURN_IF_ERROR(ReadBroadcastDims(op, "bias", in.bias, s, &x.bias_dims));
    x.bias = static_cast<const float*>(in.bias.untyped_data());
  } else {
    MAXATTN_FFI_RETURN_IF_ERROR(CheckOptional(op, "bias", in.bias, false, bias_type, {}));
  }
  if (attrs.has_mask) {
    MAXATTN_FFI_RETURN_IF_ERROR(CheckType(op, "mask", in.mask.element_type(), ffi::DataType::PRED));
    MAXATTN_FFI_RETURN_IF_ERROR(ReadBroadcastDims(op, "mask", in.mask, s, &x.mask_dims));
    x.mask = static_cast<const bool*>(in.mask.untyped_data());
  } else {
    MAXATTN_FFI_RETURN_IF_ERROR(CheckOptional(op, "mask", in.mask, false, ffi::DataType::PRED, {}));
  }
  MAXATTN_FFI_RETURN_IF_ERROR(CheckOptional(op, "q_seq_lengths", in.q_seq_lengths, attrs.has_q_seq_lengths,
                                            ffi::DataType::S32, {s.batch}));
  MAXATTN_FFI_RETURN_IF_ERROR(CheckOptional(op, "kv_seq_lengths", in.kv_seq_lengths,
                                            attrs.has_kv_seq_lengths, ffi::DataType::S32, {s.batch}));
  MAXATTN_FFI_RETURN_IF_ERROR(CheckOptional(op, "q_segment_ids", in.q_segment_ids, attrs.has_segment_ids,
                                            ffi::DataType::S32, {s.batch, s.q_len}));
  MAXATTN_FFI_RETURN_IF_ERROR(CheckOptional(op, "kv_segment_ids", in.kv_segment_ids, attrs.has_segment_ids,
                                            ffi::DataType::S32, {s.batch, s.kv_len}));
  if (attrs.has_q_seq_lengths) x.q_seq_lengths = static_cast<const int32_t*>(in.q_seq_lengths.untyped_data());
  if (attrs.has_kv_seq_lengths) x.kv_seq_lengths = static_cast<const int32_t*>(in.kv_seq_lengths.untyped_data());
  if (attrs.has_segment_ids) {
    x.q_segment_ids = static_cast<const int32_t*>(in.q_segment_ids.untyped_data());
    x.kv_segment_ids = static_cast<const int32_t*>(in.kv_segment_ids.untyped_data());
  }

  AttentionOptions& o = call->options;
  o.scale = attrs.scale;
  o.causal = attrs.is_causal;
  o.alignment = attrs.bottom_right ? CausalAlignment::kBottomRight : CausalAlignment::kTopLeft;
  o.window_left = attrs.window_left;
  o.window_right = attrs.window_right;
  o.softcap = attrs.softcap;
  const bool has_sink = in.sink_logits.element_count() != 0 || in.sink_logits.dimensions().size() != 1;
  if (has_sink) {
    MAXATTN_FFI_RETURN_IF_ERROR(
        CheckOptional(op, "sink_logits", in.sink_logits, true, ffi::DataType::F32, {s.num_q_heads}));
    x.sink_logits = static_cast<const float*>(in.sink_logits.untyped_data());
  }
  o.dropout_rate = attrs.dropout_rate;
  MAXATTN_FFI_RETURN_IF_ERROR(CheckOptional(op, "dropout_seed", in.dropout_seed, attrs.dropout_rate > 0.0f,
                                            ffi::DataType::U32, {4}));
  if (attrs.dropout_rate > 0.0f) x.dropout_seed = static_cast<const uint32_t*>(in.dropout_seed.untyped_data());
  return ToFfiError(ValidateShapeAndOptions(s, o, x));
}

// An optional output is either requested, with exactly `expected` dims, or
// not requested, passed as the rank-1 placeholder [0]. `expected` has rank >= 2.
inline ffi::Error CheckOutput(std::string_view op, std::string_view operand, const ffi::AnyBuffer& buffer,
                              ffi::DataType type, const std::vector<int64_t>& expected, bool* requested) {
  const auto dims = buffer.dimensions();
  *requested = !(dims.size() == 1 && dims[0] == 0);
  if (!*requested) return ffi::Error::Success();
  MAXATTN_FFI_RETURN_IF_ERROR(CheckType(op, operand, buffer.element_type(), type));
  return CheckDims(op, operand, dims, expected);
}

// Checks the forward results (out; lse and max_logit requested by shape) and
// points `outputs` at them; unrequested optional outputs stay null.
inline ffi::Error DecodeForwardOutputs(std::string_view op, const DecodedCall& call, ffi::DataType dtype,
                                       ffi::AnyBuffer& out, ffi::AnyBuffer& lse, ffi::AnyBuffer& max_logit,
                                       ForwardOutputs* outputs) {
  const AttentionShape& s = call.shape;
  MAXATTN_FFI_RETURN_IF_ERROR(CheckType(op, "out", out.element_type(), dtype));
  MAXATTN_FFI_RETURN_IF_ERROR(
      CheckDims(op, "out", out.dimensions(), {s.batch, s.q_len, s.num_q_heads, s.head_dim_v}));
  bool want_lse = false, want_max = false;
  MAXATTN_FFI_RETURN_IF_ERROR(
      CheckOutput(op, "lse", lse, ffi::DataType::F32, {s.batch, s.num_q_heads, s.q_len}, &want_lse));
  MAXATTN_FFI_RETURN_IF_ERROR(
      CheckOutput(op, "max_logit", max_logit, ffi::DataType::F32, {s.batch, s.num_q_heads}, &want_max));
  outputs->out = out.untyped_data();
  outputs->lse = want_lse ? static_cast<float*>(lse.untyped_data()) : nullptr;
  outputs->max_logit = want_max ? static_cast<float*>(max_logit.untyped_data()) : nullptr;
  return ffi::Error::Success();
}

// Checks the backward operands after the common ones (out, dout, lse, dlse)
// and results (dq, dk, dv, dbias, dsink) and fills `saved` and `grads`;
// unrequested optional results stay null. `bias_type` is the dtype of dbias
// (that of the bias).
inline ffi::Error DecodeBackwardBuffers(std::string_view op, const DecodedCall& call, ffi::DataType dtype,
                                        ffi::DataType bias_type, const ffi::AnyBuffer& out,
                                        const ffi::AnyBuffer& dout, const ffi::AnyBuffer& lse,
                                        const ffi::AnyBuffer& dlse, ffi::AnyBuffer& dq, ffi::AnyBuffer& dk,
                                        ffi::AnyBuffer& dv, ffi::AnyBuffer& dbias, ffi::AnyBuffer& dsink,
                                        BackwardInputs* saved, BackwardOutputs* grads) {
  const AttentionShape& s = call.shape;
  const std::vector<int64_t> out_dims = {s.batch, s.q_len, s.num_q_heads, s.head_dim_v};
  const std::vector<int64_t> lse_dims = {s.batch, s.num_q_heads, s.q_len};
  struct Expected {
    const char* name;
    const ffi::AnyBuffer& buffer;
    ffi::DataType type;
    std::vector<int64_t> dims;
  };
  const Expected required[] = {
      {"out", out, dtype, out_dims},
      {"dout", dout, dtype, out_dims},
      {"lse", lse, ffi::DataType::F32, lse_dims},
      {"dq", dq, dtype, {s.batch, s.q_len, s.num_q_heads, s.head_dim}},
      {"dk", dk, dtype, {s.batch, s.kv_len, s.num_kv_heads, s.head_dim}},
      {"dv", dv, dtype, {s.batch, s.kv_len, s.num_kv_heads, s.head_dim_v}},
  };
  for (const Expected& e : required) {
    MAXATTN_FFI_RETURN_IF_ERROR(CheckType(op, e.name, e.buffer.element_type(), e.type));
    MAXATTN_FFI_RETURN_IF_ERROR(CheckDims(op, e.name, e.buffer.dimensions(), e.dims));
  }
  bool has_dlse = false, want_dbias = false, want_dsink = false;
  MAXATTN_FFI_RETURN_IF_ERROR(CheckOutput(op, "dlse", dlse, ffi::DataType::F32, lse_dims, &has_dlse));
  if (call.inputs.bias) {
    const BroadcastDims& b = call.inputs.bias_dims;
    MAXATTN_FFI_RETURN_IF_ERROR(CheckOutput(op, "dbias", dbias, bias_type, {b.b, b.n, b.t, b.s}, &want_dbias));
  } else {
    MAXATTN_FFI_RETURN_IF_ERROR(CheckOptional(op, "dbias", dbias, false, bias_type, {}));
  }
  if (call.inputs.sink_logits) {
    MAXATTN_FFI_RETURN_IF_ERROR(
        CheckOutput(op, "dsink", dsink, ffi::DataType::F32, {s.batch, s.num_q_heads}, &want_dsink));
  } else {
    MAXATTN_FFI_RETURN_IF_ERROR(CheckOptional(op, "dsink", dsink, false, ffi::DataType::F32, {}));
  }
  saved->out = out.untyped_data();
  saved->dout = dout.untyped_data();
  saved->lse = static_cast<const float*>(lse.untyped_data());
  saved->dlse = has_dlse ? static_cast<const float*>(dlse.untyped_data()) : nullptr;
  grads->dq = dq.untyped_data();
  grads->dk = dk.untyped_data();
  grads->dv = dv.untyped_data();
  // A dbias of another dtype than float32 (the cuDNN backend's) travels in the same field.
  grads->dbias = want_dbias ? static_cast<float*>(dbias.untyped_data()) : nullptr;
  grads->dsink = want_dsink ? static_cast<float*>(dsink.untyped_data()) : nullptr;
  return ffi::Error::Success();
}

}  // namespace maxattn::ffi_glue

#endif  // MAXATTN_FFI_DECODE_H_
