// Small helpers shared by the CPU forward and backward passes.
#ifndef MAXATTN_CPU_COMMON_H_
#define MAXATTN_CPU_COMMON_H_

#include <cstdint>
#include <exception>
#include <limits>
#include <new>
#include <string>

#include "maxattn/attention.h"
#include "maxattn/cpu/convert.h"

namespace maxattn::cpu {

inline constexpr float kInf = std::numeric_limits<float>::infinity();
inline constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Tile sizes. kBlockQ must be a multiple of 16 (it is the vector dimension of
// the logits tile, stored transposed as [kv, q]); kBlockKv is free.
inline constexpr int64_t kBlockQ = 96;
inline constexpr int64_t kBlockKv = 64;

inline constexpr int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline constexpr int64_t CeilDiv(int64_t x, int64_t m) { return (x + m - 1) / m; }

// Packs `rows` rows of a [.., H]-strided tensor into a row-major float tile
// with leading dim ld (>= h), converting and scaling. Unused lanes untouched.
inline void PackRows(DType dtype, const void* base, int64_t first_elem, int64_t row_stride,
                     int64_t rows, int64_t h, float scale, float* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const void* src = ElemPtr(base, dtype, first_elem + r * row_stride);
    if (scale == 1.0f) {
      LoadRow(dtype, src, h, dst + r * ld);
    } else {
      LoadRowScaled(dtype, src, h, scale, dst + r * ld);
    }
  }
}

// Transposes a row-major [rows, h] tile (leading dim ld) into [h, ldt].
inline void Transpose(const float* src, int64_t rows, int64_t h, int64_t ld, float* dst,
                      int64_t ldt) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < h; ++c) dst[c * ldt + r] = src[r * ld + c];
  }
}

// Runs a public entry point's body: validates, then calls `impl`; exceptions
// (allocation failures included) come back as Status, never cross the API.
template <typename Impl>
Status Guarded(const char* entry, const AttentionShape& shape, const AttentionOptions& options,
               const AttentionInputs& inputs, Impl&& impl) {
  try {
    MAXATTN_RETURN_IF_ERROR(ValidateShapeAndOptions(shape, options, inputs));
    return impl();
  } catch (const std::bad_alloc&) {
    return Status::Internal(std::string(entry) + ": out of memory");
  } catch (const std::exception& e) {
    return Status::Internal(std::string(entry) + ": " + e.what());
  } catch (...) {
    return Status::Internal(std::string(entry) + ": unknown error");
  }
}

}  // namespace maxattn::cpu

#endif  // MAXATTN_CPU_COMMON_H_
