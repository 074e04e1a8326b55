// Decoding of the operands and attributes shared by every attention FFI
// target (CPU and CUDA, forward and backward) into the core's structs.
//
// Operand order of every target: q, k, v, bias, mask, q_seq_lengths,
// kv_seq_lengths, q_segment_ids, kv_segment_ids, sink_logits, dropout_seed
// (python/maxattn/_src/call.py's Operands). An absent optional operand is the
// placeholder [0]: the buffers say what is present, and the attributes are
// exactly the core's AttentionOptions, decoded as one struct (options_attr.h).
// What is checked here is only buffer-versus-buffer and buffer-versus-option
// consistency; user-facing validation is the Python layer's.
#ifndef MAXATTN_FFI_DECODE_H_
#define MAXATTN_FFI_DECODE_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ffi/ffi_helpers.h"

namespace maxattn::ffi_glue {

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

// Reads a present broadcastable [b', n', t', s'] operand (bias or mask).
inline ffi::Error DecodeBroadcastable(std::string_view op, std::string_view name, const ffi::AnyBuffer& buffer,
                                      ffi::DataType type, const AttentionShape& s, BroadcastDims* dims,
                                      bool* present) {
  *present = !IsPlaceholder(buffer);
  if (!*present) return ffi::Error::Success();
  MAXATTN_FFI_RETURN_IF_ERROR(CheckType(op, name, buffer.element_type(), type));
  return ReadBroadcastDims(op, name, buffer, s, dims);
}

// Checks every operand against q/k/v and the options and fills `call`.
// `bias_type` is the element type the backend expects for a present bias.
inline ffi::Error DecodeCall(std::string_view op, const CallOperands& in, const AttentionOptions& options,
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
  bool present = false;
  MAXATTN_FFI_RETURN_IF_ERROR(DecodeBroadcastable(op, "bias", in.bias, bias_type, s, &x.bias_dims, &present));
  if (present) x.bias = static_cast<const float*>(in.bias.untyped_data());
  MAXATTN_FFI_RETURN_IF_ERROR(
      DecodeBroadcastable(op, "mask", in.mask, ffi::DataType::PRED, s, &x.mask_dims, &present));
  if (present) x.mask = static_cast<const bool*>(in.mask.untyped_data());
  MAXATTN_FFI_RETURN_IF_ERROR(
      CheckOptional(op, "q_seq_lengths", in.q_seq_lengths, ffi::DataType::S32, {s.batch}, &present));
  if (present) x.q_seq_lengths = static_cast<const int32_t*>(in.q_seq_lengths.untyped_data());
  MAXATTN_FFI_RETURN_IF_ERROR(
      CheckOptional(op, "kv_seq_lengths", in.kv_seq_lengths, ffi::DataType::S32, {s.batch}, &present));
  if (present) x.kv_seq_lengths = static_cast<const int32_t*>(in.kv_seq_lengths.untyped_data());
  MAXATTN_FFI_RETURN_IF_ERROR(
      CheckOptional(op, "q_segment_ids", in.q_segment_ids, ffi::DataType::S32, {s.batch, s.q_len}, &present));
  if (present) x.q_segment_ids = static_cast<const int32_t*>(in.q_segment_ids.untyped_data());
  MAXATTN_FFI_RETURN_IF_ERROR(CheckOptional(op, "kv_segment_ids", in.kv_segment_ids, ffi::DataType::S32,
                                            {s.batch, s.kv_len}, &present));
  if (present) x.kv_segment_ids = static_cast<const int32_t*>(in.kv_segment_ids.untyped_data());
  MAXATTN_FFI_RETURN_IF_ERROR(
      CheckOptional(op, "sink_logits", in.sink_logits, ffi::DataType::F32, {s.num_q_heads}, &present));
  if (present) x.sink_logits = static_cast<const float*>(in.sink_logits.untyped_data());
  MAXATTN_FFI_RETURN_IF_ERROR(
      CheckOptional(op, "dropout_seed", in.dropout_seed, ffi::DataType::U32, {4}, &present));
  if (present) x.dropout_seed = static_cast<const uint32_t*>(in.dropout_seed.untyped_data());
  if (present != (options.dropout_rate > 0.0f)) {
    return ffi::Error::InvalidArgument(std::string(op) + ": operand `dropout_seed` must be given iff "
                                       "dropout_rate > 0 (dropout_rate " + std::to_string(options.dropout_rate) +
                                       ", dropout_seed " + (present ? "given" : "absent") + ")");
  }
  call->options = options;
  return ToFfiError(ValidateShapeAndOptions(s, call->options, x));
}

// An optional result is either requested, with exactly `expected` dims, or
// not requested, passed as the placeholder [0].
inline ffi::Error CheckOutput(std::string_view op, std::string_view operand, const ffi::AnyBuffer& buffer,
                              ffi::DataType type, const std::vector<int64_t>& expected, bool* requested) {
  return CheckOptional(op, operand, buffer, type, expected, requested);
}

// Checks the forward results (out; lse and max_logit requested by shape) and
// points `outputs` at them; unrequested optional outputs stay null. A target
// that reduces max_logit over the batch (over_batch_ok) also takes it as [1, N].
inline ffi::Error DecodeForwardOutputs(std::string_view op, const DecodedCall& call, ffi::DataType dtype,
                                       ffi::AnyBuffer& out, ffi::AnyBuffer& lse, ffi::AnyBuffer& max_logit,
                                       bool over_batch_ok, ForwardOutputs* outputs) {
  const AttentionShape& s = call.shape;
  MAXATTN_FFI_RETURN_IF_ERROR(CheckType(op, "out", out.element_type(), dtype));
  MAXATTN_FFI_RETURN_IF_ERROR(
      CheckDims(op, "out", out.dimensions(), {s.batch, s.q_len, s.num_q_heads, s.head_dim_v}));
  bool want_lse = false, want_max = false;
  MAXATTN_FFI_RETURN_IF_ERROR(
      CheckOutput(op, "lse", lse, ffi::DataType::F32, {s.batch, s.num_q_heads, s.q_len}, &want_lse));
  const auto max_dims = max_logit.dimensions();
  outputs->max_logit_over_batch = over_batch_ok && s.batch != 1 && max_dims.size() == 2 && max_dims[0] == 1;
  MAXATTN_FFI_RETURN_IF_ERROR(CheckOutput(op, "max_logit", max_logit, ffi::DataType::F32,
                                          {outputs->max_logit_over_batch ? 1 : s.batch, s.num_q_heads}, &want_max));
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
  // A dbias (dsink) exists only with a bias (sink logits), with its dims.
  if (!call.inputs.bias && !IsPlaceholder(dbias)) {
    return ffi::Error::InvalidArgument(std::string(op) + ": result `dbias` is requested but there is no bias");
  }
  if (!call.inputs.sink_logits && !IsPlaceholder(dsink)) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": result `dsink` is requested but there are no sink_logits");
  }
  const BroadcastDims& b = call.inputs.bias_dims;
  MAXATTN_FFI_RETURN_IF_ERROR(CheckOutput(op, "dbias", dbias, bias_type, {b.b, b.n, b.t, b.s}, &want_dbias));
  MAXATTN_FFI_RETURN_IF_ERROR(
      CheckOutput(op, "dsink", dsink, ffi::DataType::F32, {s.batch, s.num_q_heads}, &want_dsink));
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
