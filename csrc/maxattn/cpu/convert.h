// bfloat16 / float16 <-> float32 conversions. Written by hand (no F16C / AVX-512
// BF16 dependency) so the portable build is exact everywhere: round to nearest
// even on store; inf, NaN (quieted) and subnormals handled.
#ifndef MAXATTN_CPU_CONVERT_H_
#define MAXATTN_CPU_CONVERT_H_

#include <bit>
#include <cstdint>

#include "maxattn/attention.h"

namespace maxattn::cpu {

inline float Bf16ToFloat(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

inline uint16_t FloatToBf16(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) {  // NaN: keep sign/payload top bits, force quiet.
    return static_cast<uint16_t>((x >> 16) | 0x0040u);
  }
  // Round to nearest even: add 0x7FFF plus the lowest kept bit. Overflow into
  // the exponent is the correct result (e.g. rounding up to inf).
  x += 0x7FFFu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

inline float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24 is exact in float.
    const float mag = static_cast<float>(mant) * 0x1p-24f;
    return std::bit_cast<float>(std::bit_cast<uint32_t>(mag) | sign);
  }
  if (exp == 31) {  // inf or NaN (quiet the NaN).
    return std::bit_cast<float>(sign | 0x7F800000u | (mant << 13) | (mant ? 0x00400000u : 0u));
  }
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t FloatToF16(float f) {
  // After F. Giesen's float_to_half_fast3_rtne (public domain).
  uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t sign = x & 0x80000000u;
  x ^= sign;
  uint32_t o;
  if (x >= (143u << 23)) {  // >= 65536: inf, or NaN -> quiet NaN
    o = x > 0x7F800000u ? (0x7E00u | ((x >> 13) & 0x3FFu)) : 0x7C00u;
  } else if (x < (113u << 23)) {  // result is subnormal or zero: let the FPU round.
    constexpr uint32_t kMagic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    const float r = std::bit_cast<float>(x) + std::bit_cast<float>(kMagic);
    o = std::bit_cast<uint32_t>(r) - kMagic;
  } else {
    const uint32_t mant_odd = (x >> 13) & 1u;
    x += (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFu;  // rebias, round half up...
    x += mant_odd;                                          // ...then to even
    o = x >> 13;
  }
  return static_cast<uint16_t>(o | (sign >> 16));
}

inline int64_t DTypeSize(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// dst[0..n) = float(src[0..n)); src is an element pointer of type `dtype`.
void LoadRow(DType dtype, const void* src, int64_t n, float* dst);
// Same, times `scale`.
void LoadRowScaled(DType dtype, const void* src, int64_t n, float scale, float* dst);
// dst[0..n) = dtype(src[0..n)), rounding to nearest even.
void StoreRow(DType dtype, const float* src, int64_t n, void* dst);

// Element pointer arithmetic on an untyped tensor.
inline const void* ElemPtr(const void* base, DType dtype, int64_t index) {
  return static_cast<const char*>(base) + index * DTypeSize(dtype);
}
inline void* ElemPtr(void* base, DType dtype, int64_t index) {
  return static_cast<char*>(base) + index * DTypeSize(dtype);
}

}  // namespace maxattn::cpu

#endif  // MAXATTN_CPU_CONVERT_H_
