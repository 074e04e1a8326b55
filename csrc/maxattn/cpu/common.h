// Small helpers shared by the CPU forward and backward passes.
#ifndef MAXATTN_CPU_COMMON_H_
#define MAXATTN_CPU_COMMON_H_

#include <cstdint>
#include <limits>

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

}  // namespace maxattn::cpu

#endif  // MAXATTN_CPU_COMMON_H_
