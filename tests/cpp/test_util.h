// Shared test harness: random problems, running the CPU backend, comparing
// against the float64 reference.
#ifndef MAXATTN_TESTS_CPP_TEST_UTIL_H_
#define MAXATTN_TESTS_CPP_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <algorithm>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "maxattn/attention.h"
#include "maxattn/cpu/convert.h"
#include "reference.h"

namespace maxattn::testing {

struct Case {
  int64_t B = 1, T = 16, S = 16, N = 2, K = 2, H = 8, Hv = 8;
  AttentionOptions options;
  DType dtype = DType::kFloat32;
  std::optional<BroadcastDims> bias_dims;
  std::optional<BroadcastDims> mask_dims;
  double mask_density = 0.7;
  std::vector<int32_t> q_len, kv_len;
  bool segments = false;
  bool dlse = true;
  bool backward = true;
  double input_scale = 1.0;
  uint32_t seed = 1;
  Case& Sizes(int64_t b, int64_t t, int64_t s, int64_t n, int64_t k, int64_t h, int64_t hv) {
    B = b, T = t, S = s, N = n, K = k, H = h, Hv = hv;
    return *this;
  }
};

// Rounds x to the storage dtype (what the kernel will see).
inline double RoundTo(DType dt, double x) {
  const float f = static_cast<float>(x);
  switch (dt) {
    case DType::kFloat32: return f;
    case DType::kBFloat16: return cpu::Bf16ToFloat(cpu::FloatToBf16(f));
    case DType::kFloat16: return cpu::F16ToFloat(cpu::FloatToF16(f));
  }
  return f;
}

// A typed tensor: storage bytes for the kernel plus the float64 values.
struct Tensor {
  DType dtype = DType::kFloat32;
  std::vector<unsigned char> bytes;
  std::vector<double> values;
  Tensor() = default;
  Tensor(DType dt, int64_t n) : dtype(dt), bytes(static_cast<size_t>(n * cpu::DTypeSize(dt))), values(n) {}
  void Set(int64_t i, double x) {
    values[i] = RoundTo(dtype, x);
    const float f = static_cast<float>(values[i]);
    if (dtype == DType::kFloat32) {
      std::memcpy(bytes.data() + 4 * i, &f, 4);
    } else {
      const uint16_t h = dtype == DType::kBFloat16 ? cpu::FloatToBf16(f) : cpu::FloatToF16(f);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
  }
  void* data() { return bytes.data(); }
  std::vector<double> Read() const {  // decode the storage
    std::vector<double> r(values.size());
    for (size_t i = 0; i < r.size(); ++i) {
      if (dtype == DType::kFloat32) {
        float f;
        std::memcpy(&f, bytes.data() + 4 * i, 4);
        r[i] = f;
      } else {
        uint16_t h;
        std::memcpy(&h, bytes.data() + 2 * i, 2);
        r[i] = dtype == DType::kBFloat16 ? cpu::Bf16ToFloat(h) : cpu::F16ToFloat(h);
      }
    }
    return r;
  }
};

inline double RelL2(const std::vector<double>& x, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += (x[i] - ref[i]) * (x[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  if (den == 0) return std::sqrt(num);
  return std::sqrt(num / den);
}

inline bool AllFinite(const std::vector<double>& x) {
  for (double v : x)
    if (!std::isfinite(v)) return false;
  return true;
}

// Everything one call needs: inputs (typed + float64), outputs, reference.
struct Problem {
  Case c;
  RefProblem ref;
  Tensor q, k, v, out, dout, dq, dk, dv;
  std::vector<float> bias;
  std::vector<char> mask_storage;  // bool-compatible bytes
  std::vector<bool> unused;
  std::unique_ptr<bool[]> mask;
  std::vector<float> lse, max_logit, dlse, dbias;
  AttentionShape shape;
  AttentionInputs inputs;

  explicit Problem(const Case& cs) : c(cs) {
    std::mt19937 rng(c.seed);
    std::normal_distribution<double> normal(0.0, 1.0);
    shape = AttentionShape{c.B, c.T, c.S, c.N, c.K, c.H, c.Hv};
    ref.shape = shape;
    ref.options = c.options;
    auto fill = [&](Tensor& t, int64_t n, double sc) {
      t = Tensor(c.dtype, n);
      for (int64_t i = 0; i < n; ++i) t.Set(i, sc * normal(rng));
    };
    fill(q, c.B * c.T * c.N * c.H, c.input_scale);
    fill(k, c.B * c.S * c.K * c.H, c.input_scale);
    fill(v, c.B * c.S * c.K * c.Hv, 1.0);
    ref.q = q.values;
    ref.k = k.values;
    ref.v = v.values;
    inputs.dtype = c.dtype;
    if (c.bias_dims) {
      const BroadcastDims& d = *c.bias_dims;
      bias.resize(d.b * d.n * d.t * d.s);
      for (auto& x : bias) x = static_cast<float>(normal(rng));
      ref.bias.assign(bias.begin(), bias.end());
      ref.bias_dims = d;
      inputs.bias_dims = d;
    }
    if (c.mask_dims) {
      const BroadcastDims& d = *c.mask_dims;
      const int64_t n = d.b * d.n * d.t * d.s;
      mask.reset(new bool[n]);
      ref.mask.resize(n);
      std::bernoulli_distribution bern(c.mask_density);
      for (int64_t i = 0; i < n; ++i) mask[i] = bern(rng), ref.mask[i] = mask[i];
      ref.mask_dims = d;
      inputs.mask_dims = d;
    }
    ref.q_len = c.q_len;
    ref.kv_len = c.kv_len;
    if (c.segments) {
      // Runs of random length with ids in {0 (padding), 1, 2, ...}.
      auto segs = [&](int64_t len) {
        std::vector<int32_t> ids(len);
        int32_t id = 1;
        std::uniform_int_distribution<int> run(1, 7), pad(0, 4);
        for (int64_t i = 0; i < len;) {
          const int32_t cur = pad(rng) == 0 ? 0 : id++;
          for (int r = run(rng); r > 0 && i < len; --r) ids[i++] = cur;
        }
        return ids;
      };
      for (int64_t b = 0; b < c.B; ++b) {
        // Same number of segment ids on both sides so they overlap.
        auto a = segs(c.T), kk = segs(c.S);
        for (auto& x : kk) x = x == 0 ? 0 : 1 + (x - 1) % std::max(1, *std::max_element(a.begin(), a.end()));
        ref.q_seg.insert(ref.q_seg.end(), a.begin(), a.end());
        ref.kv_seg.insert(ref.kv_seg.end(), kk.begin(), kk.end());
      }
    }
    Bind();
  }

  void Bind() {
    inputs.q = q.data();
    inputs.k = k.data();
    inputs.v = v.data();
    inputs.bias = bias.empty() ? nullptr : bias.data();
    inputs.mask = mask.get();
    inputs.q_seq_lengths = ref.q_len.empty() ? nullptr : ref.q_len.data();
    inputs.kv_seq_lengths = ref.kv_len.empty() ? nullptr : ref.kv_len.data();
    inputs.q_segment_ids = ref.q_seg.empty() ? nullptr : ref.q_seg.data();
    inputs.kv_segment_ids = ref.kv_seg.empty() ? nullptr : ref.kv_seg.data();
  }

  Status Forward() {
    out = Tensor(c.dtype, c.B * c.T * c.N * c.Hv);
    lse.assign(c.B * c.N * c.T, 12345.0f);
    max_logit.assign(c.B * c.N, 12345.0f);
    return AttentionForwardCpu(shape, c.options, inputs, {out.data(), lse.data(), max_logit.data()});
  }

  Status Backward(std::mt19937& rng) {
    std::normal_distribution<double> normal(0.0, 1.0);
    dout = Tensor(c.dtype, c.B * c.T * c.N * c.Hv);
    for (int64_t i = 0; i < static_cast<int64_t>(dout.values.size()); ++i) dout.Set(i, normal(rng));
    dlse.clear();
    if (c.dlse) {
      dlse.resize(c.B * c.N * c.T);
      for (auto& x : dlse) x = static_cast<float>(normal(rng));
    }
    dq = Tensor(c.dtype, static_cast<int64_t>(q.values.size()));
    dk = Tensor(c.dtype, static_cast<int64_t>(k.values.size()));
    dv = Tensor(c.dtype, static_cast<int64_t>(v.values.size()));
    dbias.assign(bias.size(), 777.0f);
    BackwardInputs saved{out.data(), dout.data(), lse.data(), dlse.empty() ? nullptr : dlse.data()};
    BackwardOutputs grads{dq.data(), dk.data(), dv.data(), dbias.empty() ? nullptr : dbias.data()};
    return AttentionBackwardCpu(shape, c.options, inputs, saved, grads);
  }
};

struct Tolerances {
  double out, lse, max_logit, grad;
};
inline Tolerances TolFor(DType dt) {
  if (dt == DType::kFloat32) return {1e-5, 1e-5, 1e-5, 1e-5};
  return {2e-2, 2e-2, 1e-3, 2e-2};
}

inline std::vector<double> ToDouble(const std::vector<float>& x) { return {x.begin(), x.end()}; }

// Checks that the finite entries agree and that -inf entries coincide.
inline void ExpectLseNear(const std::vector<float>& got, const std::vector<double>& want,
                          double tol) {
  std::vector<double> g, w;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_FALSE(std::isnan(got[i])) << "lse[" << i << "]";
    if (std::isinf(want[i])) {
      ASSERT_EQ(got[i], -std::numeric_limits<float>::infinity()) << "lse[" << i << "]";
    } else {
      ASSERT_TRUE(std::isfinite(got[i])) << "lse[" << i << "] = " << got[i] << " want " << want[i];
      g.push_back(got[i]);
      w.push_back(want[i]);
    }
  }
  EXPECT_LE(RelL2(g, w), tol);
}

inline void ExpectMaxLogitNear(const std::vector<float>& got, const std::vector<double>& want,
                               double tol) {
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(want[i])) {
      EXPECT_TRUE(std::isnan(got[i])) << "max_logit[" << i << "]";
    } else if (std::isinf(want[i])) {
      EXPECT_EQ(got[i], static_cast<float>(want[i])) << "max_logit[" << i << "]";
    } else {
      EXPECT_LE(std::abs(got[i] - want[i]), tol * std::max(1.0, std::abs(want[i])))
          << "max_logit[" << i << "] = " << got[i] << " want " << want[i];
    }
  }
}

// Runs forward (+ backward) and compares everything with the reference.
inline void RunAndCompare(const Case& c) {
  Problem p(c);
  const Tolerances tol = TolFor(c.dtype);
  const Status st = p.Forward();
  ASSERT_TRUE(st.ok()) << st.message();
  const RefForward ref = RefAttentionForward(p.ref);
  const std::vector<double> out = p.out.Read();
  ASSERT_TRUE(AllFinite(out));
  EXPECT_LE(RelL2(out, ref.out), tol.out) << "out";
  ExpectLseNear(p.lse, ref.lse, tol.lse);
  ExpectMaxLogitNear(p.max_logit, ref.max_logit, tol.max_logit);
  if (!c.backward) return;
  std::mt19937 rng(c.seed + 1000);
  const Status bst = p.Backward(rng);
  ASSERT_TRUE(bst.ok()) << bst.message();
  std::vector<double> dlse(p.dlse.begin(), p.dlse.end());
  const RefGrads g = RefAttentionBackward(p.ref, p.dout.values, dlse);
  const auto dq = p.dq.Read(), dk = p.dk.Read(), dv = p.dv.Read();
  ASSERT_TRUE(AllFinite(dq) && AllFinite(dk) && AllFinite(dv));
  EXPECT_LE(RelL2(dq, g.dq), tol.grad) << "dq";
  EXPECT_LE(RelL2(dk, g.dk), tol.grad) << "dk";
  EXPECT_LE(RelL2(dv, g.dv), tol.grad) << "dv";
  if (!p.dbias.empty()) {
    const auto db = ToDouble(p.dbias);
    ASSERT_TRUE(AllFinite(db));
    EXPECT_LE(RelL2(db, g.dbias), tol.grad) << "dbias";
  }
}

}  // namespace maxattn::testing

#endif  // MAXATTN_TESTS_CPP_TEST_UTIL_H_
