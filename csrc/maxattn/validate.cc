// ValidateShapeAndOptions: the size/option rules shared by every backend.
#include <cmath>
#include <string>

#include "maxattn/attention.h"

namespace maxattn {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

Status CheckBroadcast(const char* name, const BroadcastDims& d, const AttentionShape& s) {
  const struct {
    const char* field;
    int64_t value;
    int64_t full;
    const char* full_name;
  } dims[] = {{"b", d.b, s.batch, "batch"},
              {"n", d.n, s.num_q_heads, "num_q_heads"},
              {"t", d.t, s.q_len, "q_len"},
              {"s", d.s, s.kv_len, "kv_len"}};
  for (const auto& x : dims) {
    if (x.value != 1 && x.value != x.full) {
      return Status::InvalidArgument(std::string(name) + "." + x.field + " (" + Str(x.value) +
                                     ") must be 1 or " + x.full_name + " (" + Str(x.full) + ")");
    }
  }
  return Status::Ok();
}

}  // namespace

Status ValidateShapeAndOptions(const AttentionShape& shape, const AttentionOptions& options,
                               const AttentionInputs& inputs) {
  const struct {
    const char* name;
    int64_t value;
  } sizes[] = {{"batch", shape.batch},           {"q_len", shape.q_len},
               {"kv_len", shape.kv_len},         {"num_q_heads", shape.num_q_heads},
               {"num_kv_heads", shape.num_kv_heads}, {"head_dim", shape.head_dim},
               {"head_dim_v", shape.head_dim_v}};
  for (const auto& x : sizes) {
    if (x.value < 0) {
      return Status::InvalidArgument(std::string(x.name) + " (" + Str(x.value) +
                                     ") must be >= 0");
    }
  }
  if (shape.num_q_heads > 0 && shape.num_kv_heads < 1) {
    return Status::InvalidArgument("num_kv_heads (" + Str(shape.num_kv_heads) +
                                   ") must be >= 1 when num_q_heads (" +
                                   Str(shape.num_q_heads) + ") >= 1");
  }
  if (shape.num_kv_heads > 0 && shape.num_q_heads % shape.num_kv_heads != 0) {
    return Status::InvalidArgument("num_q_heads (" + Str(shape.num_q_heads) +
                                   ") must be a multiple of num_kv_heads (" +
                                   Str(shape.num_kv_heads) + ")");
  }
  switch (inputs.dtype) {
    case DType::kFloat32:
    case DType::kBFloat16:
    case DType::kFloat16:
      break;
    default:
      return Status::InvalidArgument("dtype (" + Str(static_cast<int>(inputs.dtype)) +
                                     ") must be float32 (0), bfloat16 (1) or float16 (2)");
  }
  if (options.alignment != CausalAlignment::kTopLeft &&
      options.alignment != CausalAlignment::kBottomRight) {
    return Status::InvalidArgument("alignment (" + Str(static_cast<int>(options.alignment)) +
                                   ") must be top-left (0) or bottom-right (1)");
  }
  if (options.window_left < -1) {
    return Status::InvalidArgument("window_left (" + Str(options.window_left) +
                                   ") must be >= 0, or -1 for unbounded");
  }
  if (options.window_right < -1) {
    return Status::InvalidArgument("window_right (" + Str(options.window_right) +
                                   ") must be >= 0, or -1 for unbounded");
  }
  if (!std::isfinite(options.softcap)) {
    return Status::InvalidArgument("softcap (" + std::to_string(options.softcap) +
                                   ") must be finite (<= 0 disables it)");
  }
  if (!(options.dropout_rate >= 0.0f && options.dropout_rate < 1.0f)) {
    return Status::InvalidArgument("dropout_rate (" + std::to_string(options.dropout_rate) +
                                   ") must be in [0, 1)");
  }
  if (options.dropout_rate > 0.0f && inputs.dropout_seed == nullptr) {
    return Status::InvalidArgument("dropout_rate > 0 needs dropout_seed (got null)");
  }
  if (inputs.bias != nullptr) MAXATTN_RETURN_IF_ERROR(CheckBroadcast("bias_dims", inputs.bias_dims, shape));
  if (inputs.mask != nullptr) MAXATTN_RETURN_IF_ERROR(CheckBroadcast("mask_dims", inputs.mask_dims, shape));
  if ((inputs.q_segment_ids == nullptr) != (inputs.kv_segment_ids == nullptr)) {
    return Status::InvalidArgument(
        "q_segment_ids and kv_segment_ids must be given together (got only one)");
  }
  if (options.max_segments < 0 || options.max_segments > kMaxSegmentsPerRow) {
    return Status::InvalidArgument("max_segments (" + Str(options.max_segments) + ") must be in [0, " +
                                   Str(kMaxSegmentsPerRow) + "]");
  }
  if (options.max_segments > 0 && inputs.q_segment_ids == nullptr) {
    return Status::InvalidArgument("max_segments > 0 needs q_segment_ids and kv_segment_ids (got none)");
  }
  return Status::Ok();
}

}  // namespace maxattn
