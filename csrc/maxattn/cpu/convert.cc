#include "maxattn/cpu/convert.h"

#include <cstring>

namespace maxattn::cpu {

void LoadRow(DType dtype, const void* src, int64_t n, float* dst) {
  if (n <= 0) return;  // dst may be null for empty rows; memcpy(null, ...) is UB
  switch (dtype) {
    case DType::kFloat32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case DType::kBFloat16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(s[i]);
      return;
    }
    case DType::kFloat16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = F16ToFloat(s[i]);
      return;
    }
  }
}

void LoadRowScaled(DType dtype, const void* src, int64_t n, float scale, float* dst) {
  LoadRow(dtype, src, n, dst);
  for (int64_t i = 0; i < n; ++i) dst[i] *= scale;
}

void StoreRow(DType dtype, const float* src, int64_t n, void* dst) {
  if (n <= 0) return;
  switch (dtype) {
    case DType::kFloat32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case DType::kBFloat16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = FloatToBf16(src[i]);
      return;
    }
    case DType::kFloat16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = FloatToF16(src[i]);
      return;
    }
  }
}

}  // namespace maxattn::cpu
