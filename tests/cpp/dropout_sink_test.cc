// Dropout and attention sinks (softmax types) of the CPU backend against a
// naive float64 reference written from the semantics in attention.h.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "maxattn/dropout.h"
#include "test_util.h"

namespace maxattn::testing {
namespace {

struct Extras {
  std::vector<float> sink;       // [N] or empty
  std::vector<uint32_t> seed;    // [4] or empty
};

struct RefOut {
  std::vector<double> out, lse, dq, dk, dv, dsink;
};

// Forward and (if dout given) backward of L = <dout, out> + <dlse, lse>.
RefOut RefExtras(const RefProblem& p, const Extras& x, const std::vector<double>* dout,
                 const std::vector<float>* dlse) {
  const auto& sh = p.shape;
  const int64_t B = sh.batch, T = sh.q_len, S = sh.kv_len, N = sh.num_q_heads, K = sh.num_kv_heads;
  const int64_t H = sh.head_dim, Hv = sh.head_dim_v, G = N / K;
  const double inf = std::numeric_limits<double>::infinity();
  const float rate = p.options.dropout_rate;
  const uint32_t thr = DropoutThreshold(rate);
  const double zscale = rate > 0 ? static_cast<double>(1.0f / (1.0f - rate)) : 1.0;
  RefOut r;
  r.out.assign(B * T * N * Hv, 0.0);
  r.lse.assign(B * N * T, -inf);
  r.dq.assign(p.q.size(), 0.0);
  r.dk.assign(p.k.size(), 0.0);
  r.dv.assign(p.v.size(), 0.0);
  r.dsink.assign(B * N, 0.0);
  std::vector<double> logit(S), prob(S), z(S), dp(S), sv(S);
  std::vector<char> vis(S);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < T; ++i) {
        const double sink = x.sink.empty() ? -inf : x.sink[n];
        double mx = -inf;
        for (int64_t j = 0; j < S; ++j) {
          vis[j] = RefVisible(p, b, n, i, j);
          if (!vis[j]) continue;
          sv[j] = RefS(p, b, n, i, j);
          logit[j] = RefLogit(p, sv[j]);
          mx = std::max(mx, logit[j]);
        }
        const double m = std::max(mx, sink);
        if (m == -inf) continue;
        double sum = std::exp(sink - m);
        for (int64_t j = 0; j < S; ++j)
          if (vis[j]) sum += std::exp(logit[j] - m);
        const double lse = m + std::log(sum);
        r.lse[(b * N + n) * T + i] = lse;
        const int64_t kh = n / G;
        double* o = &r.out[((b * T + i) * N + n) * Hv];
        for (int64_t j = 0; j < S; ++j) {
          prob[j] = vis[j] ? std::exp(logit[j] - lse) : 0.0;
          z[j] = rate > 0 ? (DropoutBits(x.seed.data(), b, n, i, j) >= thr ? zscale : 0.0) : 1.0;
          for (int64_t h = 0; h < Hv; ++h) o[h] += prob[j] * z[j] * p.v[((b * S + j) * K + kh) * Hv + h];
        }
        if (dout == nullptr) continue;
        const double* dO = &(*dout)[((b * T + i) * N + n) * Hv];
        double D = 0;
        for (int64_t h = 0; h < Hv; ++h) D += dO[h] * o[h];
        const double dl = dlse == nullptr ? 0.0 : (*dlse)[(b * N + n) * T + i];
        if (sink != -inf) r.dsink[b * N + n] -= std::exp(sink - lse) * (D - dl);
        for (int64_t j = 0; j < S; ++j) {
          if (prob[j] == 0) continue;
          double d = 0;
          for (int64_t h = 0; h < Hv; ++h) d += dO[h] * p.v[((b * S + j) * K + kh) * Hv + h];
          double ds = prob[j] * (z[j] * d - D + dl);
          if (p.options.softcap > 0) {
            const double t = std::tanh(sv[j] / p.options.softcap);
            ds *= 1 - t * t;
          }
          for (int64_t h = 0; h < H; ++h) {
            r.dq[((b * T + i) * N + n) * H + h] += p.options.scale * ds * p.k[((b * S + j) * K + kh) * H + h];
            r.dk[((b * S + j) * K + kh) * H + h] += p.options.scale * ds * p.q[((b * T + i) * N + n) * H + h];
          }
          for (int64_t h = 0; h < Hv; ++h) r.dv[((b * S + j) * K + kh) * Hv + h] += prob[j] * z[j] * dO[h];
        }
      }
  return r;
}

void RunExtras(const Case& c, const Extras& x) {
  Problem p(c);
  p.inputs.sink_logits = x.sink.empty() ? nullptr : x.sink.data();
  p.inputs.dropout_seed = x.seed.empty() ? nullptr : x.seed.data();
  const Tolerances tol = TolFor(c.dtype);
  const Status st = p.Forward();
  ASSERT_TRUE(st.ok()) << st.message();
  // Forward reference (the backward reference needs the kernel's dout).
  const RefOut f = RefExtras(p.ref, x, nullptr, nullptr);
  const auto out = p.out.Read();
  ASSERT_TRUE(AllFinite(out));
  EXPECT_LE(RelL2(out, f.out), tol.out) << "out";
  ExpectLseNear(p.lse, f.lse, tol.lse);
  // max_logit is unaffected by dropout and excludes the sink.
  ExpectMaxLogitNear(p.max_logit, RefAttentionForward(p.ref).max_logit, tol.max_logit);

  std::mt19937 rng(c.seed + 7);
  std::normal_distribution<double> normal(0.0, 1.0);
  Tensor dout(c.dtype, static_cast<int64_t>(p.out.values.size()));
  for (int64_t i = 0; i < static_cast<int64_t>(dout.values.size()); ++i) dout.Set(i, normal(rng));
  std::vector<float> dlse(p.lse.size());
  for (auto& v : dlse) v = static_cast<float>(normal(rng));
  Tensor dq(c.dtype, static_cast<int64_t>(p.q.values.size()));
  Tensor dk(c.dtype, static_cast<int64_t>(p.k.values.size()));
  Tensor dv(c.dtype, static_cast<int64_t>(p.v.values.size()));
  std::vector<float> dsink(static_cast<size_t>(c.B * c.N), 777.0f);
  BackwardInputs saved{p.out.data(), dout.data(), p.lse.data(), dlse.data()};
  BackwardOutputs grads{dq.data(), dk.data(), dv.data(), nullptr, dsink.data()};
  const Status bst = AttentionBackwardCpu(p.shape, c.options, p.inputs, saved, grads);
  ASSERT_TRUE(bst.ok()) << bst.message();
  const RefOut g = RefExtras(p.ref, x, &dout.values, &dlse);
  EXPECT_LE(RelL2(dq.Read(), g.dq), tol.grad) << "dq";
  EXPECT_LE(RelL2(dk.Read(), g.dk), tol.grad) << "dk";
  EXPECT_LE(RelL2(dv.Read(), g.dv), tol.grad) << "dv";
  EXPECT_LE(RelL2(ToDouble(dsink), g.dsink), tol.grad) << "dsink";
}

Extras Sinks(int64_t N, uint32_t seed) {
  Extras x;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.5f);
  for (int64_t n = 0; n < N; ++n) x.sink.push_back(normal(rng));
  return x;
}

TEST(Philox, KnownAnswers) {  // Random123 kat_vectors, philox4x32_10
  Philox4x32 r = Philox4x32_10(0, 0, 0, 0, 0, 0);
  EXPECT_EQ(r.v[0], 0x6627e8d5u);
  EXPECT_EQ(r.v[1], 0xe169c58du);
  EXPECT_EQ(r.v[2], 0xbc57ac4cu);
  EXPECT_EQ(r.v[3], 0x9b00dbd8u);
  r = Philox4x32_10(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u);
  EXPECT_EQ(r.v[0], 0xd16cfe09u);
  EXPECT_EQ(r.v[1], 0x94fdccebu);
  EXPECT_EQ(r.v[2], 0x5001e420u);
  EXPECT_EQ(r.v[3], 0x24126ea1u);
}

TEST(Philox, KeepFractionAndTileAgreesWithBits) {
  const uint32_t seed[4] = {123u, 456u, 7u, 3u};
  const float rate = 0.3f;
  const uint32_t thr = DropoutThreshold(rate);
  const int64_t rows = 37, cols = 61, ld = 40;
  std::vector<unsigned char> keep(static_cast<size_t>(cols * ld), 9);
  DropoutKeepTile(seed, thr, 2, 5, 11, rows, 6, cols, ld, keep.data());
  double kept = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t jj = 0; jj < cols; ++jj) {
      const bool want = DropoutBits(seed, 2, 5, 11 + r, 6 + jj) >= thr;
      ASSERT_EQ(keep[jj * ld + r], want ? 1 : 0);
      kept += want;
    }
  const double n = rows * cols, frac = kept / n, sigma = std::sqrt(0.3 * 0.7 / n);
  EXPECT_NEAR(frac, 0.7, 5 * sigma);
  EXPECT_EQ(DropoutThreshold(0.0f), 0u);
  EXPECT_EQ(DropoutThreshold(0.5f), 0x80000000u);
}

TEST(CpuDropoutSink, LearnableSinkF32Gqa) {
  Case c;
  c.Sizes(2, 100, 130, 4, 2, 16, 24);
  c.seed = 700;
  c.options.scale = 0.3f;
  RunExtras(c, Sinks(4, 1));
}

TEST(CpuDropoutSink, SinkCausalPaddingEmptyRows) {
  Case c;
  c.Sizes(2, 40, 50, 2, 1, 8, 8);
  c.seed = 701;
  c.options.causal = true;
  c.q_len = {40, 30};
  c.kv_len = {0, 20};  // batch row 0 has no visible key: out 0, lse = sink
  RunExtras(c, Sinks(2, 2));
}

TEST(CpuDropoutSink, OffByOneBf16) {
  Case c;
  c.Sizes(1, 70, 70, 2, 2, 32, 32);
  c.seed = 702;
  c.dtype = DType::kBFloat16;
  Extras x;
  x.sink = {0.0f, 0.0f};
  RunExtras(c, x);
}

TEST(CpuDropoutSink, DropoutF32CausalGqa) {
  Case c;
  c.Sizes(2, 110, 90, 4, 2, 16, 16);
  c.seed = 703;
  c.options.causal = true;
  c.options.dropout_rate = 0.25f;
  c.bias_dims = BroadcastDims{1, 4, 110, 90};
  Extras x;
  x.seed = {11u, 22u, 0u, 0u};
  RunExtras(c, x);
}

TEST(CpuDropoutSink, DropoutSinkSoftcapBf16) {
  Case c;
  c.Sizes(2, 64, 200, 2, 1, 16, 8);
  c.seed = 704;
  c.dtype = DType::kBFloat16;
  c.options.softcap = 3.0f;
  c.options.dropout_rate = 0.5f;
  Extras x = Sinks(2, 3);
  x.seed = {5u, 6u, 4u, 2u};  // non-zero shard offsets
  RunExtras(c, x);
}

TEST(CpuDropoutSink, RateZeroIsBitIdentical) {
  Case c;
  c.Sizes(1, 50, 60, 2, 2, 8, 8);
  c.seed = 705;
  Problem a(c), b(c);
  const uint32_t seed[4] = {1u, 2u, 0u, 0u};
  b.inputs.dropout_seed = seed;
  ASSERT_TRUE(a.Forward().ok());
  ASSERT_TRUE(b.Forward().ok());
  EXPECT_EQ(a.out.bytes, b.out.bytes);
  EXPECT_EQ(a.lse, b.lse);
}

TEST(CpuDropoutSink, BadDropoutOptions) {
  Case c;
  Problem p(c);
  c.options.dropout_rate = 1.0f;
  ForwardOutputs o{p.q.data(), nullptr, nullptr};
  const uint32_t seed[4] = {1u, 2u, 0u, 0u};
  p.inputs.dropout_seed = seed;
  EXPECT_EQ(AttentionForwardCpu(p.shape, c.options, p.inputs, o).code(), Status::Code::kInvalidArgument);
  c.options.dropout_rate = -0.1f;
  EXPECT_EQ(AttentionForwardCpu(p.shape, c.options, p.inputs, o).code(), Status::Code::kInvalidArgument);
  c.options.dropout_rate = 0.1f;
  p.inputs.dropout_seed = nullptr;
  const Status st = AttentionForwardCpu(p.shape, c.options, p.inputs, o);
  EXPECT_EQ(st.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(st.message().find("dropout_seed"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace maxattn::testing
