// The row epilogue shared by the CPU forward and backward: scale a float
// accumulator row and store it in the tensor's dtype. always_inline and
// target-neutral like kernels.h, so the scaling loop is vectorised for the ISA
// of the target("...") entry point that inlines it.
#ifndef MAXATTN_CPU_ROW_STORE_H_
#define MAXATTN_CPU_ROW_STORE_H_

#include <cstdint>

#include "maxattn/attention.h"
#include "maxattn/cpu/convert.h"
#include "maxattn/cpu/kernels.h"

namespace maxattn::cpu {

// dst[0..n) = dtype(src[0..n) * scale), through the float scratch tmp[0..n).
MAXATTN_ALWAYS_INLINE void StoreRowScaled(DType dtype, const float* src, int64_t n, float scale,
                                          float* tmp, void* dst) {
  for (int64_t h = 0; h < n; ++h) tmp[h] = src[h] * scale;
  StoreRow(dtype, tmp, n, dst);
}

}  // namespace maxattn::cpu

#endif  // MAXATTN_CPU_ROW_STORE_H_
