// Naive float64 reference of attention.h's semantics (forward and backward),
// written straight from the header comment: materialises every logit row.
#ifndef MAXATTN_TESTS_CPP_REFERENCE_H_
#define MAXATTN_TESTS_CPP_REFERENCE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "maxattn/attention.h"

namespace maxattn::testing {

struct RefProblem {
  AttentionShape shape;
  AttentionOptions options;
  std::vector<double> q, k, v;   // [B,T,N,H], [B,S,K,H], [B,S,K,Hv]
  std::vector<double> bias;      // bias_dims, or empty
  BroadcastDims bias_dims;
  std::vector<char> mask;        // mask_dims, or empty
  BroadcastDims mask_dims;
  std::vector<int32_t> q_len, kv_len;    // [B] or empty
  std::vector<int32_t> q_seg, kv_seg;    // [B,T], [B,S] or empty
};

struct RefForward {
  std::vector<double> out, lse, max_logit;
};

struct RefGrads {
  std::vector<double> dq, dk, dv, dbias;
};

inline int64_t BcastIndex(const BroadcastDims& d, int64_t b, int64_t n, int64_t i, int64_t j) {
  return ((((d.b == 1 ? 0 : b) * d.n + (d.n == 1 ? 0 : n)) * d.t + (d.t == 1 ? 0 : i)) * d.s) +
         (d.s == 1 ? 0 : j);
}

inline bool RefVisible(const RefProblem& p, int64_t b, int64_t n, int64_t i, int64_t j) {
  const auto& sh = p.shape;
  const auto& o = p.options;
  const int64_t qv = p.q_len.empty() ? sh.q_len : std::clamp<int64_t>(p.q_len[b], 0, sh.q_len);
  const int64_t kv = p.kv_len.empty() ? sh.kv_len : std::clamp<int64_t>(p.kv_len[b], 0, sh.kv_len);
  const int64_t d = o.alignment == CausalAlignment::kBottomRight ? kv - qv : 0;
  if (!(i < qv && j < kv)) return false;
  if (o.causal && !(j <= i + d)) return false;
  if (o.window_left >= 0 && !(j >= i + d - o.window_left)) return false;
  if (o.window_right >= 0 && !(j <= i + d + o.window_right)) return false;
  if (!p.q_seg.empty()) {
    const int32_t a = p.q_seg[b * sh.q_len + i], c = p.kv_seg[b * sh.kv_len + j];
    if (a != c || a == 0) return false;
  }
  if (!p.mask.empty() && !p.mask[BcastIndex(p.mask_dims, b, n, i, j)]) return false;
  return true;
}

// s (pre-softcap) for one (b, n, i, j).
inline double RefS(const RefProblem& p, int64_t b, int64_t n, int64_t i, int64_t j) {
  const auto& sh = p.shape;
  const int64_t G = sh.num_q_heads / sh.num_kv_heads, kh = n / G, H = sh.head_dim;
  double dot = 0;
  for (int64_t h = 0; h < H; ++h) {
    dot += p.q[((b * sh.q_len + i) * sh.num_q_heads + n) * H + h] *
           p.k[((b * sh.kv_len + j) * sh.num_kv_heads + kh) * H + h];
  }
  double s = static_cast<double>(p.options.scale) * dot;
  if (!p.bias.empty()) s += p.bias[BcastIndex(p.bias_dims, b, n, i, j)];
  return s;
}

inline double RefLogit(const RefProblem& p, double s) {
  const double c = p.options.softcap;
  return c > 0 ? c * std::tanh(s / c) : s;
}

inline RefForward RefAttentionForward(const RefProblem& p) {
  const auto& sh = p.shape;
  const int64_t B = sh.batch, T = sh.q_len, S = sh.kv_len, N = sh.num_q_heads;
  const int64_t Hv = sh.head_dim_v, G = N > 0 ? N / sh.num_kv_heads : 1;
  const double inf = std::numeric_limits<double>::infinity();
  RefForward r;
  r.out.assign(B * T * N * Hv, 0.0);
  r.lse.assign(B * N * T, -inf);
  r.max_logit.assign(B * N, -inf);
  std::vector<double> logit(S);
  std::vector<char> vis(S);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < T; ++i) {
        double mx = -inf;
        bool any = false;
        for (int64_t j = 0; j < S; ++j) {
          vis[j] = RefVisible(p, b, n, i, j);
          if (!vis[j]) continue;
          const double s = RefS(p, b, n, i, j);
          double& ml = r.max_logit[b * N + n];
          if (std::isnan(s) || std::isnan(ml)) {
            ml = std::numeric_limits<double>::quiet_NaN();
          } else {
            ml = std::max(ml, s);
          }
          logit[j] = RefLogit(p, s);
          mx = std::max(mx, logit[j]);
          any = true;
        }
        if (!any || mx == -inf) continue;
        double sum = 0;
        for (int64_t j = 0; j < S; ++j)
          if (vis[j]) sum += std::exp(logit[j] - mx);
        r.lse[(b * N + n) * T + i] = mx + std::log(sum);
        for (int64_t j = 0; j < S; ++j) {
          if (!vis[j]) continue;
          const double pj = std::exp(logit[j] - mx) / sum;
          for (int64_t h = 0; h < Hv; ++h) {
            r.out[((b * T + i) * N + n) * Hv + h] +=
                pj * p.v[((b * S + j) * sh.num_kv_heads + n / G) * Hv + h];
          }
        }
      }
  return r;
}

// Analytic gradients of L = <dout, out> + <dlse, lse> (dlse may be empty).
inline RefGrads RefAttentionBackward(const RefProblem& p, const std::vector<double>& dout,
                                     const std::vector<double>& dlse) {
  const auto& sh = p.shape;
  const int64_t B = sh.batch, T = sh.q_len, S = sh.kv_len, N = sh.num_q_heads;
  const int64_t K = sh.num_kv_heads, H = sh.head_dim, Hv = sh.head_dim_v, G = N / K;
  const RefForward f = RefAttentionForward(p);
  const double scale = p.options.scale, c = p.options.softcap;
  RefGrads g;
  g.dq.assign(p.q.size(), 0.0);
  g.dk.assign(p.k.size(), 0.0);
  g.dv.assign(p.v.size(), 0.0);
  g.dbias.assign(p.bias.size(), 0.0);
  std::vector<double> prob(S), dlogit(S), svals(S);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < T; ++i) {
        const double lse = f.lse[(b * N + n) * T + i];
        if (std::isinf(lse)) continue;
        const int64_t kh = n / G;
        const double* dO = &dout[((b * T + i) * N + n) * Hv];
        double D = 0;
        for (int64_t j = 0; j < S; ++j) {
          prob[j] = 0;
          dlogit[j] = 0;
          if (!RefVisible(p, b, n, i, j)) continue;
          svals[j] = RefS(p, b, n, i, j);
          prob[j] = std::exp(RefLogit(p, svals[j]) - lse);
          double dp = 0;
          for (int64_t h = 0; h < Hv; ++h) dp += dO[h] * p.v[((b * S + j) * K + kh) * Hv + h];
          dlogit[j] = dp;
          D += prob[j] * dp;
        }
        const double dl = dlse.empty() ? 0.0 : dlse[(b * N + n) * T + i];
        for (int64_t j = 0; j < S; ++j) {
          if (prob[j] == 0) continue;
          double ds = prob[j] * (dlogit[j] - D + dl);
          if (c > 0) {
            const double t = std::tanh(svals[j] / c);
            ds *= 1 - t * t;
          }
          for (int64_t h = 0; h < H; ++h) {
            g.dq[((b * T + i) * N + n) * H + h] += scale * ds * p.k[((b * S + j) * K + kh) * H + h];
            g.dk[((b * S + j) * K + kh) * H + h] += scale * ds * p.q[((b * T + i) * N + n) * H + h];
          }
          for (int64_t h = 0; h < Hv; ++h) g.dv[((b * S + j) * K + kh) * Hv + h] += prob[j] * dO[h];
          if (!p.bias.empty()) g.dbias[BcastIndex(p.bias_dims, b, n, i, j)] += ds;
        }
      }
  return g;
}

}  // namespace maxattn::testing

#endif  // MAXATTN_TESTS_CPP_REFERENCE_H_
