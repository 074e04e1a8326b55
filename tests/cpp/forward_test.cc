// Forward (out, lse, max_logit) and backward (dq, dk, dv, dbias) of the CPU
// backend against the float64 reference, over the feature matrix.
#include <gtest/gtest.h>

#include <limits>

#include "test_util.h"

namespace maxattn::testing {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

Case Base(uint32_t seed) {
  Case c;
  c.seed = seed;
  return c;
}

TEST(CpuAttention, OddSizesMha) {
  Case c = Base(1).Sizes(2, 37, 53, 3, 3, 40, 40);
  c.options.scale = 0.3f;
  RunAndCompare(c);
}

// T, S across several tiles and not multiples of them; H = 1 .. 256; Hv != H.
TEST(CpuAttention, HeadDims) {
  const int64_t dims[][2] = {{1, 1}, {1, 3}, {40, 40}, {72, 40}, {128, 128}, {256, 72}, {16, 256}};
  uint32_t seed = 10;
  for (auto [h, hv] : dims) {
    SCOPED_TRACE("H=" + std::to_string(h) + " Hv=" + std::to_string(hv));
    Case c = Base(seed++).Sizes(1, 131, 150, 2, 1, h, hv);
    c.options.scale = 1.0f / std::sqrt(static_cast<float>(h));
    RunAndCompare(c);
  }
}

TEST(CpuAttention, GqaAndMqa) {
  for (auto [n, k] : {std::pair<int64_t, int64_t>{6, 2}, {4, 1}, {4, 4}}) {
    SCOPED_TRACE("N=" + std::to_string(n) + " K=" + std::to_string(k));
    Case c = Base(20 + static_cast<uint32_t>(n * 10 + k)).Sizes(2, 45, 70, n, k, 24, 16);
    c.options.scale = 0.25f;
    c.options.causal = true;
    RunAndCompare(c);
  }
}

TEST(CpuAttention, CausalAlignments) {
  for (auto align : {CausalAlignment::kTopLeft, CausalAlignment::kBottomRight}) {
    for (auto [t, s] : {std::pair<int64_t, int64_t>{100, 230}, {230, 100}, {193, 193}}) {
      SCOPED_TRACE("align=" + std::to_string(static_cast<int>(align)) + " T=" + std::to_string(t) +
                   " S=" + std::to_string(s));
      Case c = Base(static_cast<uint32_t>(30 + t + s)).Sizes(1, t, s, 2, 1, 32, 32);
      c.options.scale = 0.2f;
      c.options.causal = true;
      c.options.alignment = align;
      RunAndCompare(c);
    }
  }
}

TEST(CpuAttention, PaddingLengths) {
  for (bool causal : {false, true}) {
    Case c = Base(40).Sizes(4, 70, 90, 2, 2, 16, 16);
    c.options.scale = 0.25f;
    c.options.causal = causal;
    c.options.alignment = CausalAlignment::kBottomRight;
    c.q_len = {0, 17, 70, 40};
    c.kv_len = {90, 0, 33, 90};
    RunAndCompare(c);
  }
}

TEST(CpuAttention, SegmentIds) {
  Case c = Base(50).Sizes(2, 100, 110, 2, 1, 16, 24);
  c.options.scale = 0.25f;
  c.segments = true;
  RunAndCompare(c);
  c.options.causal = true;
  c.seed = 51;
  RunAndCompare(c);
}

TEST(CpuAttention, SlidingWindow) {
  const int64_t windows[][2] = {{8, 3}, {0, 0}, {-1, 5}, {5, -1}, {70, 70}};
  uint32_t seed = 60;
  for (auto [l, r] : windows) {
    for (bool causal : {false, true}) {
      SCOPED_TRACE("window=(" + std::to_string(l) + "," + std::to_string(r) + ") causal=" +
                   std::to_string(causal));
      Case c = Base(seed++).Sizes(1, 120, 140, 2, 1, 16, 16);
      c.options.scale = 0.25f;
      c.options.causal = causal;
      c.options.alignment = CausalAlignment::kBottomRight;
      c.options.window_left = l;
      c.options.window_right = r;
      RunAndCompare(c);
    }
  }
}

// Every broadcast pattern of the bias (forward and dbias reduction).
TEST(CpuAttention, BiasBroadcastPatterns) {
  const int64_t B = 2, T = 23, S = 29, N = 4, K = 2;
  for (int bits = 0; bits < 16; ++bits) {
    BroadcastDims d{bits & 1 ? B : 1, bits & 2 ? N : 1, bits & 4 ? T : 1, bits & 8 ? S : 1};
    SCOPED_TRACE("bias dims " + std::to_string(d.b) + "," + std::to_string(d.n) + "," +
                 std::to_string(d.t) + "," + std::to_string(d.s));
    Case c = Base(static_cast<uint32_t>(100 + bits)).Sizes(B, T, S, N, K, 8, 8);
    c.options.scale = 0.35f;
    c.options.causal = bits % 3 == 0;
    c.bias_dims = d;
    RunAndCompare(c);
  }
}

TEST(CpuAttention, BiasMultiTile) {
  Case c = Base(120).Sizes(1, 150, 170, 2, 2, 16, 16);
  c.options.scale = 0.25f;
  c.options.causal = true;
  c.bias_dims = BroadcastDims{1, 2, 150, 170};
  RunAndCompare(c);
  c.bias_dims = BroadcastDims{1, 1, 1, 170};
  c.seed = 121;
  RunAndCompare(c);
}

TEST(CpuAttention, DenseMask) {
  const BroadcastDims dims[] = {{2, 3, 50, 80}, {2, 1, 50, 80}, {1, 1, 1, 80}, {1, 3, 50, 1}};
  uint32_t seed = 130;
  for (const auto& d : dims) {
    Case c = Base(seed++).Sizes(2, 50, 80, 3, 1, 16, 16);
    c.options.scale = 0.25f;
    c.mask_dims = d;
    RunAndCompare(c);
  }
}

TEST(CpuAttention, Softcap) {
  Case c = Base(140).Sizes(2, 60, 75, 2, 1, 32, 32);
  c.options.scale = 0.5f;
  c.options.softcap = 3.0f;
  c.options.causal = true;
  c.bias_dims = BroadcastDims{1, 2, 60, 75};
  RunAndCompare(c);
}

TEST(CpuAttention, SoftcapWithPadding) {
  Case c = Base(141).Sizes(2, 100, 130, 2, 2, 16, 16);
  c.options.scale = 1.0f;
  c.options.softcap = 5.0f;
  c.q_len = {100, 64};
  c.kv_len = {50, 130};
  RunAndCompare(c);
}

TEST(CpuAttention, HalfPrecision) {
  for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
    for (bool causal : {false, true}) {
      SCOPED_TRACE("dtype=" + std::to_string(static_cast<int>(dt)) + " causal=" +
                   std::to_string(causal));
      Case c = Base(150 + static_cast<uint32_t>(dt) * 2 + causal).Sizes(2, 110, 97, 4, 2, 72, 40);
      c.options.scale = 1.0f / std::sqrt(72.0f);
      c.options.causal = causal;
      c.dtype = dt;
      c.bias_dims = BroadcastDims{1, 4, 1, 97};
      RunAndCompare(c);
    }
  }
}

TEST(CpuAttention, FullyMaskedRows) {
  Case c = Base(160).Sizes(2, 40, 50, 2, 1, 16, 16);
  c.options.scale = 0.25f;
  c.mask_dims = BroadcastDims{2, 2, 40, 50};
  c.mask_density = 0.05;  // many rows have no visible key
  c.q_len = {40, 30};
  c.kv_len = {50, 45};
  RunAndCompare(c);
  Problem p(c);
  ASSERT_TRUE(p.Forward().ok());
  const RefForward ref = RefAttentionForward(p.ref);
  const auto out = p.out.Read();
  int empty_rows = 0;
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t n = 0; n < 2; ++n)
      for (int64_t i = 0; i < 40; ++i) {
        if (!std::isinf(ref.lse[(b * 2 + n) * 40 + i])) continue;
        ++empty_rows;
        EXPECT_EQ(p.lse[(b * 2 + n) * 40 + i], -kInf);
        for (int64_t h = 0; h < 16; ++h) EXPECT_EQ(out[((b * 40 + i) * 2 + n) * 16 + h], 0.0);
      }
  EXPECT_GT(empty_rows, 10);
}

TEST(CpuAttention, EverythingMasked) {
  Case c = Base(161).Sizes(2, 20, 30, 2, 2, 8, 8);
  c.q_len = {0, 20};
  c.kv_len = {30, 0};
  Problem p(c);
  ASSERT_TRUE(p.Forward().ok());
  for (float x : p.max_logit) EXPECT_EQ(x, -kInf);
  for (float x : p.lse) EXPECT_EQ(x, -kInf);
  for (double x : p.out.Read()) EXPECT_EQ(x, 0.0);
  std::mt19937 rng(1);
  ASSERT_TRUE(p.Backward(rng).ok());
  for (const auto* t : {&p.dq, &p.dk, &p.dv})
    for (double x : t->Read()) EXPECT_EQ(x, 0.0);
}

TEST(CpuAttention, NanPropagatesIntoMaxLogit) {
  Case c = Base(170).Sizes(2, 30, 40, 3, 3, 8, 8);
  c.options.scale = 0.5f;
  c.kv_len = {40, 35};
  c.backward = false;
  Problem p(c);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  // Visible NaN in q at (b=1, i=7, n=2): max_logit[1, 2] must be NaN.
  p.q.Set(((1 * 30 + 7) * 3 + 2) * 8 + 3, nan);
  // NaN in k at an invisible (padded) key of b=1, head 0: must not leak.
  p.k.Set(((1 * 40 + 37) * 3 + 0) * 8 + 1, nan);
  p.ref.q = p.q.values;
  p.ref.k = p.k.values;
  p.Bind();
  ASSERT_TRUE(p.Forward().ok());
  for (int64_t bn = 0; bn < 6; ++bn) {
    if (bn == 1 * 3 + 2) {
      EXPECT_TRUE(std::isnan(p.max_logit[bn]));
    } else {
      EXPECT_TRUE(std::isfinite(p.max_logit[bn])) << bn;
    }
  }
  const RefForward ref = RefAttentionForward(p.ref);
  ExpectMaxLogitNear(p.max_logit, ref.max_logit, 1e-5);
}

// |s| ~ 1e4 with exactly representable integer inputs: lse finite and exact.
TEST(CpuAttention, LargeLogits) {
  Case c = Base(180).Sizes(2, 100, 120, 2, 1, 16, 16);
  c.options.scale = 1.0f;
  c.options.causal = true;
  Problem p(c);
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> u(-30, 30);
  for (size_t i = 0; i < p.q.values.size(); ++i) p.q.Set(static_cast<int64_t>(i), u(rng));
  for (size_t i = 0; i < p.k.values.size(); ++i) p.k.Set(static_cast<int64_t>(i), u(rng));
  p.ref.q = p.q.values;
  p.ref.k = p.k.values;
  p.Bind();
  ASSERT_TRUE(p.Forward().ok());
  const RefForward ref = RefAttentionForward(p.ref);
  double biggest = 0;
  for (double x : ref.max_logit) biggest = std::max(biggest, std::abs(x));
  EXPECT_GT(biggest, 3000.0);
  for (float x : p.lse) EXPECT_TRUE(std::isfinite(x));
  EXPECT_LE(RelL2(p.out.Read(), ref.out), 1e-5);
  ExpectLseNear(p.lse, ref.lse, 1e-6);
  ExpectMaxLogitNear(p.max_logit, ref.max_logit, 1e-6);
}

// One batch element holds a spike: the per-(b, n) max must see it.
TEST(CpuAttention, MaxLogitSpike) {
  Case c = Base(190).Sizes(3, 50, 60, 2, 2, 8, 8);
  c.options.scale = 0.3f;
  c.backward = false;
  Problem p(c);
  for (int64_t h = 0; h < 8; ++h) p.q.Set(((2 * 50 + 33) * 2 + 1) * 8 + h, 40.0);
  p.ref.q = p.q.values;
  p.Bind();
  ASSERT_TRUE(p.Forward().ok());
  const RefForward ref = RefAttentionForward(p.ref);
  ExpectMaxLogitNear(p.max_logit, ref.max_logit, 1e-5);
  EXPECT_GT(p.max_logit[2 * 2 + 1], 5 * p.max_logit[0]);
}

TEST(CpuAttention, ZeroSizes) {
  for (auto [t, s] : {std::pair<int64_t, int64_t>{0, 10}, {10, 0}, {0, 0}}) {
    Case c = Base(200).Sizes(2, t, s, 2, 1, 8, 8);
    Problem p(c);
    ASSERT_TRUE(p.Forward().ok());
    for (float x : p.max_logit) EXPECT_EQ(x, -kInf);
    for (float x : p.lse) EXPECT_EQ(x, -kInf);
    for (double x : p.out.Read()) EXPECT_EQ(x, 0.0);
    std::mt19937 rng(1);
    ASSERT_TRUE(p.Backward(rng).ok());
    for (const auto* tt : {&p.dq, &p.dk, &p.dv})
      for (double x : tt->Read()) EXPECT_EQ(x, 0.0);
  }
  Case c = Base(201).Sizes(0, 5, 5, 0, 0, 8, 8);
  Problem p(c);
  EXPECT_TRUE(p.Forward().ok());
  Case h0 = Base(202).Sizes(1, 20, 30, 2, 1, 0, 8);  // H = 0: uniform attention
  RunAndCompare(h0);
}

TEST(CpuAttention, LseWithoutOptionalOutputs) {
  Case c = Base(210).Sizes(1, 40, 40, 2, 2, 8, 8);
  Problem p(c);
  Tensor out(c.dtype, 40 * 2 * 8);
  ASSERT_TRUE(AttentionForwardCpu(p.shape, c.options, p.inputs, {out.data(), nullptr, nullptr}).ok());
  EXPECT_LE(RelL2(out.Read(), RefAttentionForward(p.ref).out), 1e-5);
}

TEST(CpuAttention, LargerMixed) {
  Case c = Base(220).Sizes(2, 300, 260, 4, 2, 64, 64);
  c.options.scale = 0.125f;
  c.options.causal = true;
  c.options.alignment = CausalAlignment::kBottomRight;
  c.kv_len = {260, 200};
  c.options.window_left = 100;
  c.bias_dims = BroadcastDims{2, 1, 300, 260};
  RunAndCompare(c);
}

}  // namespace
}  // namespace maxattn::testing
