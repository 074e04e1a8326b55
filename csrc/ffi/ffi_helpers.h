// Small helpers shared by the CPU and CUDA FFI handlers: turning core Status
// into ffi::Error, decoding dtypes and checking buffer shapes against the
// attributes with messages that name the operand.
#ifndef MAXATTN_FFI_FFI_HELPERS_H_
#define MAXATTN_FFI_FFI_HELPERS_H_

#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "maxattn/attention.h"
#include "xla/ffi/api/ffi.h"

namespace maxattn::ffi_glue {

namespace ffi = xla::ffi;

#define MAXATTN_FFI_RETURN_IF_ERROR(expr)      \
  do {                                         \
    ::xla::ffi::Error maxattn_err_ = (expr);   \
    if (maxattn_err_.failure()) return maxattn_err_; \
  } while (false)

inline ffi::Error ToFfiError(const Status& status) {
  switch (status.code()) {
    case Status::Code::kOk:
      return ffi::Error::Success();
    case Status::Code::kInvalidArgument:
      return ffi::Error::InvalidArgument(status.message());
    case Status::Code::kUnimplemented:
      return ffi::Error(ffi::ErrorCode::kUnimplemented, status.message());
    case Status::Code::kInternal:
      break;
  }
  return ffi::Error::Internal(status.message());
}

inline std::string DimsToString(ffi::Span<const int64_t> dims) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < dims.size(); ++i) os << (i ? ", " : "") << dims[i];
  os << "]";
  return os.str();
}

inline std::string DimsToString(const std::vector<int64_t>& dims) {
  return DimsToString(ffi::Span<const int64_t>(dims.data(), dims.size()));
}

// Fails unless `buffer` has exactly `expected` dimensions.
inline ffi::Error CheckDims(std::string_view op, std::string_view operand,
                            ffi::Span<const int64_t> dims, const std::vector<int64_t>& expected) {
  bool same = dims.size() == expected.size();
  for (size_t i = 0; same && i < dims.size(); ++i) same = dims[i] == expected[i];
  if (same) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(op) + ": operand `" + std::string(operand) +
                                     "` has shape " + DimsToString(dims) + ", expected " +
                                     DimsToString(expected));
}

inline ffi::Error CheckType(std::string_view op, std::string_view operand, ffi::DataType got,
                            ffi::DataType expected) {
  if (got == expected) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(op) + ": operand `" + std::string(operand) +
                                     "` has element type " + std::to_string(static_cast<int>(got)) +
                                     ", expected " + std::to_string(static_cast<int>(expected)));
}

// An absent optional operand or unrequested optional result is the rank-1
// placeholder [0]; anything else (a zero-sized [B, 0, ...] too) is present.
inline bool IsPlaceholder(const ffi::AnyBuffer& buffer) {
  const auto dims = buffer.dimensions();
  return dims.size() == 1 && dims[0] == 0;
}

// A present optional operand must have `type` and exactly `expected` dims.
// Returns whether it is present in *present.
inline ffi::Error CheckOptional(std::string_view op, std::string_view operand, const ffi::AnyBuffer& buffer,
                                ffi::DataType type, const std::vector<int64_t>& expected, bool* present) {
  *present = !IsPlaceholder(buffer);
  if (!*present) return ffi::Error::Success();
  MAXATTN_FFI_RETURN_IF_ERROR(CheckType(op, operand, buffer.element_type(), type));
  return CheckDims(op, operand, buffer.dimensions(), expected);
}

inline std::optional<DType> ToCoreDType(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F32:
      return DType::kFloat32;
    case ffi::DataType::BF16:
      return DType::kBFloat16;
    case ffi::DataType::F16:
      return DType::kFloat16;
    default:
      return std::nullopt;
  }
}

// Reads the [b', n', t', s'] sizes of a broadcastable rank-4 operand.
inline ffi::Error ReadBroadcastDims(std::string_view op, std::string_view operand,
                                    const ffi::AnyBuffer& buffer, const AttentionShape& shape,
                                    BroadcastDims* out) {
  auto dims = buffer.dimensions();
  const int64_t full[4] = {shape.batch, shape.num_q_heads, shape.q_len, shape.kv_len};
  if (dims.size() != 4) {
    return ffi::Error::InvalidArgument(std::string(op) + ": operand `" + std::string(operand) +
                                       "` must have rank 4, got shape " + DimsToString(dims));
  }
  for (int i = 0; i < 4; ++i) {
    if (dims[i] != 1 && dims[i] != full[i]) {
      return ffi::Error::InvalidArgument(
          std::string(op) + ": operand `" + std::string(operand) + "` of shape " + DimsToString(dims) +
          " is not broadcastable to [B, N, T, S] = " + DimsToString(std::vector<int64_t>(full, full + 4)));
    }
  }
  *out = BroadcastDims{dims[0], dims[1], dims[2], dims[3]};
  return ffi::Error::Success();
}

}  // namespace maxattn::ffi_glue

#endif  // MAXATTN_FFI_FFI_HELPERS_H_
