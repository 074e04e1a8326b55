#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <random>

#include "maxattn/cpu/convert.h"

namespace maxattn::cpu {
namespace {

TEST(Convert, Float16RoundTripAllValues) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = F16ToFloat(static_cast<uint16_t>(h));
    const bool nan = (h & 0x7C00u) == 0x7C00u && (h & 0x3FFu) != 0;
    if (nan) {
      EXPECT_TRUE(std::isnan(f));
      EXPECT_TRUE(std::isnan(F16ToFloat(FloatToF16(f))));
    } else {
      EXPECT_EQ(FloatToF16(f), h) << h;
    }
  }
}

#if defined(__FLT16_MAX__) && defined(__x86_64__)
// GCC's _Float16 conversion is correctly rounded: use it as the oracle.
TEST(Convert, Float16RoundingMatchesCompiler) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    uint32_t x = bits(rng);
    if (i % 2) x = (x & 0x807FFFFFu) | ((100u + x % 50u) << 23);  // near the f16 range
    const float f = std::bit_cast<float>(x);
    if (std::isnan(f)) continue;
    const _Float16 h = static_cast<_Float16>(f);
    EXPECT_EQ(FloatToF16(f), std::bit_cast<uint16_t>(h)) << f;
  }
}
#endif

TEST(Convert, Float16Specials) {
  EXPECT_EQ(FloatToF16(65504.0f), 0x7BFF);
  EXPECT_EQ(FloatToF16(65520.0f), 0x7C00);  // ties to even -> inf
  EXPECT_EQ(FloatToF16(-std::numeric_limits<float>::infinity()), 0xFC00);
  EXPECT_EQ(FloatToF16(0x1p-24f), 0x0001);   // smallest subnormal
  EXPECT_EQ(FloatToF16(0x1p-25f), 0x0000);   // tie to even (0)
  EXPECT_EQ(FloatToF16(0x1.8p-25f), 0x0001);
  EXPECT_EQ(FloatToF16(-0.0f), 0x8000);
  EXPECT_EQ(F16ToFloat(0x3C00), 1.0f);
  EXPECT_EQ(F16ToFloat(0x0001), 0x1p-24f);
}

TEST(Convert, BFloat16) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3F80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1).
  EXPECT_EQ(FloatToBf16(1.0f + 0x1p-8f), 0x3F80);
  EXPECT_EQ(FloatToBf16(1.0f + 0x1p-7f + 0x1p-8f), 0x3F82);  // tie, rounds up to even
  EXPECT_EQ(FloatToBf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3F81);
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7F80);  // rounds to inf
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(FloatToBf16(0x1p-130f), 0x0008);  // subnormal kept (2^19 * 2^-149)
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose payload lives only in the low bits must stay NaN.
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::bit_cast<float>(0x7F800001u)))));
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(h));
    if (!std::isnan(f)) {
      EXPECT_EQ(FloatToBf16(f), h);
    }
  }
  // Random: the result is the nearest bf16 (checked in double).
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1e3f, 1e3f);
  for (int i = 0; i < 100000; ++i) {
    const float f = u(rng);
    const double r = Bf16ToFloat(FloatToBf16(f));
    const uint16_t hb = FloatToBf16(f);
    const double up = Bf16ToFloat(static_cast<uint16_t>(hb + 1)), down = Bf16ToFloat(static_cast<uint16_t>(hb - 1));
    EXPECT_LE(std::abs(r - f), std::abs(up - f));
    EXPECT_LE(std::abs(r - f), std::abs(down - f));
  }
}

TEST(Convert, Rows) {
  const float src[5] = {1.5f, -2.25f, 0.0f, 3e-5f, 1e4f};
  uint16_t h[5];
  float back[5];
  StoreRow(DType::kFloat16, src, 5, h);
  LoadRow(DType::kFloat16, h, 5, back);
  for (int i = 0; i < 5; ++i) EXPECT_NEAR(back[i], src[i], std::abs(src[i]) * 1e-3 + 1e-7);
  LoadRowScaled(DType::kFloat32, src, 5, 2.0f, back);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(back[i], 2 * src[i]);
}

}  // namespace
}  // namespace maxattn::cpu
