// Standalone GPU harness for the sm90 backward (csrc/maxattn/sm90/bwd_*):
// gradients against a float64 CPU reference over a matrix of cases, then
// timings.
//
//   sm90_bwd_harness            all cases, then the timed shapes
//   sm90_bwd_harness --small    five small cases, no timing (for compute-sanitizer)
//   sm90_bwd_harness --no-perf  all cases, no timing
//   sm90_bwd_harness --perf-only [--shape I] [--softcap X] [--segments D]
//
// Each case draws fresh random q, k, v and a random output cotangent dO (and,
// in some cases, an lse cotangent), runs the sm90 forward for out and lse (the
// residuals the library saves), poisons the gradients (0x7f bytes) and runs
// the backward. dq, dk, dv (and dsink with sinks) are compared with the
// float64 reference by relative L2 error (docs/contract.md's tolerances: 2e-2 for bf16
// and fp16), NaN patterns must match, keys that no query sees and rows that
// see no key must have exactly zero gradients, and a second run must give
// bit-identical dk and dv (dq is summed by atomics: equal to 1e-5 relative).
// Exit code 1 if any case fails.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "harness_common.h"
#include "maxattn/attention.h"
#include "maxattn/sm90/sm90_attention.h"

namespace {

using namespace harness;
using maxattn::BackwardInputs;
using maxattn::BackwardOutputs;
using maxattn::ForwardOutputs;
using maxattn::Status;

struct BwdCase {
  Case c;
  bool dlse = false;           // a random lse cotangent too
  bool deterministic = false;  // options.deterministic: dq bit-identical across runs too
};

struct GradReference {
  std::vector<double> dq, dk, dv, dsink;
  std::vector<char> row_empty;  // [B*N*T]: the row sees no key
  std::vector<char> key_unseen;  // [B*K*S]: no query of the KV head's group sees the key
};

// The float64 gradients of the case's attention at the output cotangent dout
// [B, T, N, H] and lse cotangent dlse [B, N, T] (empty: zero), attention.h's
// formulas: P = exp(logit - lse), D = dO . out - dlse, dlogit = P (dO . v - D),
// dscore = dlogit (1 - tanh^2) with a soft cap, dq = scale dscore k,
// dk = scale dscore^T q, dv = P^T dO, dsink = -sum exp(sink - lse) D.
GradReference ComputeGradReference(const Case& c, const HostInputs& in, const std::vector<float>& dout,
                                   const std::vector<float>& dlse, double scale) {
  const int B = c.B, T = c.T, S = c.S, N = c.N, K = c.K, H = c.H, G = N / K;
  GradReference r;
  r.dq.assign(static_cast<size_t>(B) * T * N * H, 0.0);
  r.dk.assign(static_cast<size_t>(B) * S * K * H, 0.0);
  r.dv.assign(r.dk.size(), 0.0);
  r.dsink.assign(static_cast<size_t>(B) * N, 0.0);
  r.row_empty.assign(static_cast<size_t>(B) * N * T, 1);
  r.key_unseen.assign(static_cast<size_t>(B) * K * S, 1);
  // One job per (b, KV head): it owns dk, dv of its keys and dq, dsink of its group's heads.
  ParallelFor(B * K, [&](int job) {
    const int b = job / K, kh = job % K;
    const Visibility vis = VisFor(c, b);
    std::vector<double> s(S), l(S), p(S), out(H);
    for (int n = kh * G; n < (kh + 1) * G; ++n) {
      const double sink = c.sink.empty() ? -kInf : c.sink[n];
      for (int i = 0; i < T; ++i) {
        const float* qi = &in.q[((static_cast<size_t>(b) * T + i) * N + n) * H];
        const float* gi = &dout[((static_cast<size_t>(b) * T + i) * N + n) * H];
        double lm = -kInf;
        bool any = false, row_nan = false;
        for (int j = 0; j < S; ++j) {
          if (!vis(i, j)) continue;
          const float* kj = &in.k[((static_cast<size_t>(b) * S + j) * K + kh) * H];
          double dot = 0;
          for (int h = 0; h < H; ++h) dot += static_cast<double>(qi[h]) * kj[h];
          s[j] = scale * dot;
          l[j] = c.softcap > 0 ? c.softcap * std::tanh(s[j] / c.softcap) : s[j];
          any = true;
          if (std::isnan(l[j])) row_nan = true; else lm = std::max(lm, l[j]);
        }
        double sum = 0;
        for (int j = 0; j < S && any; ++j) {
          if (vis(i, j)) sum += std::exp(l[j] - lm);
        }
        double lse = sink;  // a row that sees nothing
        if (any) {
          const double top = std::max(lm, sink);
          lse = top + std::log(sum * std::exp(lm - top) + std::exp(sink - top));
          if (row_nan) lse = std::nan("");
        }
        std::fill(out.begin(), out.end(), 0.0);
        for (int j = 0; j < S && any; ++j) {
          if (!vis(i, j)) continue;
          p[j] = std::exp(l[j] - lse);
          const float* vj = &in.v[((static_cast<size_t>(b) * S + j) * K + kh) * H];
          for (int h = 0; h < H; ++h) out[h] += p[j] * vj[h];
        }
        const size_t row = (static_cast<size_t>(b) * N + n) * T + i;
        double d = 0;
        for (int h = 0; h < H; ++h) d += static_cast<double>(gi[h]) * out[h];
        if (!dlse.empty()) d -= dlse[row];
        if (!c.sink.empty() && sink != -kInf) r.dsink[static_cast<size_t>(b) * N + n] -= std::exp(sink - lse) * d;
        if (!any) continue;
        r.row_empty[row] = 0;
        double* dqi = &r.dq[((static_cast<size_t>(b) * T + i) * N + n) * H];
        for (int j = 0; j < S; ++j) {
          if (!vis(i, j)) continue;
          r.key_unseen[(static_cast<size_t>(b) * K + kh) * S + j] = 0;
          const float* kj = &in.k[((static_cast<size_t>(b) * S + j) * K + kh) * H];
          const float* vj = &in.v[((static_cast<size_t>(b) * S + j) * K + kh) * H];
          double dp = 0;
          for (int h = 0; h < H; ++h) dp += static_cast<double>(gi[h]) * vj[h];
          double ds = p[j] * (dp - d);
          if (c.softcap > 0) {
            const double t = std::tanh(s[j] / c.softcap);
            ds *= 1.0 - t * t;
          }
          double* dkj = &r.dk[((static_cast<size_t>(b) * S + j) * K + kh) * H];
          double* dvj = &r.dv[((static_cast<size_t>(b) * S + j) * K + kh) * H];
          for (int h = 0; h < H; ++h) {
            dqi[h] += scale * ds * kj[h];
            dkj[h] += scale * ds * qi[h];
            dvj[h] += p[j] * gi[h];
          }
        }
      }
    }
  });
  return r;
}

// Entries of a [rows, H] gradient whose row is flagged that are not exactly zero.
size_t NonzeroFlaggedRows(const std::vector<uint16_t>& g, const std::vector<char>& flags, int H, DType t,
                          std::vector<size_t> (*rows_of)(size_t, const Case&), const Case& c) {
  size_t bad = 0;
  for (size_t f = 0; f < flags.size(); ++f) {
    if (!flags[f]) continue;
    for (size_t row : rows_of(f, c)) {
      for (int h = 0; h < H; ++h) bad += FromBits(g[row * H + h], t) != 0.0f;
    }
  }
  return bad;
}

// The dq row of flag (b, n, i) of [B, N, T]; the dk/dv row of flag (b, kh, j) of [B, K, S].
std::vector<size_t> QueryRow(size_t f, const Case& c) {
  const size_t b = f / (static_cast<size_t>(c.N) * c.T), n = f / c.T % c.N, i = f % c.T;
  return {(b * c.T + i) * c.N + n};
}

std::vector<size_t> KeyRow(size_t f, const Case& c) {
  const size_t b = f / (static_cast<size_t>(c.K) * c.S), kh = f / c.S % c.K, j = f % c.S;
  return {(b * c.S + j) * c.K + kh};
}

bool RunCase(const BwdCase& bc, uint64_t seed) {
  const Case& c = bc.c;
  const int B = c.B, T = c.T, N = c.N, H = c.H;
  std::mt19937_64 rng(seed);
  const HostInputs host = DrawInputs(c, rng);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::vector<uint16_t> dout_bits(host.q.size());
  std::vector<float> dout(host.q.size()), dlse;
  for (size_t i = 0; i < dout.size(); ++i) {
    dout_bits[i] = ToBits(uni(rng), c.dtype);
    dout[i] = FromBits(dout_bits[i], c.dtype);
  }
  if (bc.dlse) {
    dlse.resize(static_cast<size_t>(B) * N * T);
    for (float& x : dlse) x = uni(rng);
  }
  const double scale = DeviceCall::Scale(c);
  const GradReference ref = ComputeGradReference(c, host, dout, dlse, scale);

  DeviceCall call(c, host);
  call.options.deterministic = bc.deterministic;
  if (auto reason = maxattn::Sm90BackwardUnsupportedReason(call.shape, call.options, call.inputs)) {
    std::printf("FAIL %-36s unsupported: %s\n", c.name.c_str(), reason->c_str());
    return false;
  }
  DeviceBuffer<uint16_t> out(host.q.size()), d_dout(host.q.size()), dq(host.q.size()), dk(host.k.size()),
      dv(host.k.size());
  DeviceBuffer<float> lse(static_cast<size_t>(B) * N * T), d_dlse(dlse.size()), dsink(c.sink.empty() ? 0 : B * N);
  Upload(d_dout, dout_bits);
  Upload(d_dlse, dlse);
  ScratchArena scratch;
  scratch.poison = true;
  ForwardOutputs fo;
  fo.out = out.ptr;
  fo.lse = lse.ptr;
  Status st = maxattn::AttentionForwardSm90(call.shape, call.options, call.inputs, fo, scratch.Context());
  if (!st.ok()) {
    std::printf("FAIL %-36s forward status: %s\n", c.name.c_str(), st.message().c_str());
    return false;
  }
  auto run = [&]() {
    CUDA_OK(cudaMemset(dq.ptr, 0x7f, dq.bytes()));
    CUDA_OK(cudaMemset(dk.ptr, 0x7f, dk.bytes()));
    CUDA_OK(cudaMemset(dv.ptr, 0x7f, dv.bytes()));
    if (dsink.count) CUDA_OK(cudaMemset(dsink.ptr, 0x7f, dsink.bytes()));
    BackwardInputs saved;
    saved.out = out.ptr;
    saved.dout = d_dout.ptr;
    saved.lse = lse.ptr;
    saved.dlse = bc.dlse ? d_dlse.ptr : nullptr;
    BackwardOutputs g;
    g.dq = dq.ptr;
    g.dk = dk.ptr;
    g.dv = dv.ptr;
    g.dsink = dsink.count ? dsink.ptr : nullptr;
    Status s = maxattn::AttentionBackwardSm90(call.shape, call.options, call.inputs, saved, g, scratch.Context());
    if (!s.ok()) {
      std::printf("FAIL %-36s backward status: %s\n", c.name.c_str(), s.message().c_str());
      return false;
    }
    CUDA_OK(cudaDeviceSynchronize());
    return true;
  };
  if (!run()) return false;
  const std::vector<uint16_t> gdq = Download(dq), gdk = Download(dk), gdv = Download(dv);
  const std::vector<float> gsink = Download(dsink);
  // dk: a NaN query row also reaches the keys of its tiles that it does not see (docs/contract.md).
  const RelError edq = RelL2(gdq, ref.dq, c.dtype), edk = RelL2(gdk, ref.dk, c.dtype, c.nan),
                 edv = RelL2(gdv, ref.dv, c.dtype);
  const RelError esink = c.sink.empty() ? RelError{} : RelL2(gsink, ref.dsink, c.dtype);
  const size_t empty_nz = NonzeroFlaggedRows(gdq, ref.row_empty, H, c.dtype, QueryRow, c);
  const size_t unseen_nz = NonzeroFlaggedRows(gdk, ref.key_unseen, H, c.dtype, KeyRow, c) +
                           NonzeroFlaggedRows(gdv, ref.key_unseen, H, c.dtype, KeyRow, c);
  // Second run: dk, dv and dsink bit-identical; dq equal up to the order of its
  // atomic sums, or bit-identical in the deterministic mode.
  if (!run()) return false;
  const std::vector<uint16_t> gdq2 = Download(dq), gdk2 = Download(dk), gdv2 = Download(dv);
  const std::vector<float> gsink2 = Download(dsink);
  size_t dkv_rerun = 0, dq_bits_rerun = 0;
  for (size_t i = 0; i < gdk.size(); ++i) dkv_rerun += (gdk[i] != gdk2[i]) + (gdv[i] != gdv2[i]);
  for (size_t i = 0; i < gsink.size(); ++i) dkv_rerun += std::memcmp(&gsink[i], &gsink2[i], sizeof(float)) != 0;
  for (size_t i = 0; i < gdq.size(); ++i) dq_bits_rerun += gdq[i] != gdq2[i];
  std::vector<double> dq_first(gdq.size());
  for (size_t i = 0; i < gdq.size(); ++i) dq_first[i] = FromBits(gdq[i], c.dtype);
  const RelError dq_rerun = RelL2(gdq2, dq_first, c.dtype);

  const double tol = 2e-2;
  const bool sink_ok = c.sink.empty() || (esink.rel <= tol && esink.nan_mismatch == 0);
  const bool pass = edq.rel <= tol && edk.rel <= tol && edv.rel <= tol && edq.nan_mismatch == 0 &&
                    edk.nan_mismatch == 0 && edv.nan_mismatch == 0 && sink_ok && empty_nz == 0 && unseen_nz == 0 &&
                    dkv_rerun == 0 && dq_rerun.rel <= 1e-2 && dq_rerun.nan_mismatch == 0 &&
                    (!bc.deterministic || dq_bits_rerun == 0);
  const std::string name = c.name + (bc.deterministic ? " [det]" : "");
  std::printf("%s %-42s %s dq=%.2e dk=%.2e dv=%.2e dsink=%.2e nan_mis=%zu/%zu/%zu empty_nz=%zu unseen_nz=%zu "
              "rerun dkv_diff=%zu dq_rel=%.1e dq_bits=%zu\n",
              pass ? "PASS" : "FAIL", name.c_str(), DTypeName(c.dtype), edq.rel, edk.rel, edv.rel,
              c.sink.empty() ? 0.0 : esink.rel, edq.nan_mismatch, edk.nan_mismatch, edv.nan_mismatch, empty_nz,
              unseen_nz, dkv_rerun, dq_rerun.rel, dq_bits_rerun);
  std::fflush(stdout);
  return pass;
}

std::vector<BwdCase> AllCases() {
  std::vector<BwdCase> v;
  auto add = [&](Case c, bool dlse = false) { v.push_back({std::move(c), dlse}); };
  const DType bf = DType::kBFloat16, fp = DType::kFloat16;
  for (DType t : {bf, fp}) {
    for (int H : {64, 128, 256}) {
      const std::string h = "h" + std::to_string(H);
      add({h + " dense", 2, 256, 256, 4, 4, H, t});
      add({h + " causal tl odd", 2, 300, 300, 2, 2, H, t, true});
      add({h + " causal br T<S", 2, 200, 333, 2, 1, H, t, true, true});
    }
  }
  add({"h128 causal tl T>S", 1, 333, 200, 2, 2, 128, bf, true, false});
  add({"h128 causal br T>S (masked rows)", 1, 333, 200, 2, 2, 128, bf, true, true});
  add({"h128 dense T!=S odd", 2, 77, 515, 3, 3, 128, bf});
  add({"h128 gqa 8/2 causal", 2, 384, 384, 8, 2, 128, bf, true});
  add({"h128 mqa 4/1 dense", 1, 130, 260, 4, 1, 128, bf});
  add({"h64 gqa 6/3 causal br", 1, 190, 250, 6, 3, 64, bf, true, true});
  add({"h128 window 64,0 causal", 1, 500, 500, 2, 2, 128, bf, true, false, 64, 0});
  add({"h128 window 32,16", 1, 400, 450, 2, 2, 128, bf, false, false, 32, 16});
  add({"h64 window 100,-1 br", 1, 300, 420, 2, 2, 64, fp, false, true, 100, -1});
  add({"h128 dlse dense", 2, 200, 260, 2, 2, 128, bf}, true);
  add({"h64 dlse causal gqa", 2, 260, 260, 4, 2, 64, bf, true}, true);
  {
    Case c{"h128 padding lengths", 3, 257, 300, 2, 2, 128, bf};
    c.q_lens = {100, 257, 0};
    c.kv_lens = {180, 64, 300};
    add(c, true);
  }
  {
    Case c{"h128 padding causal br", 2, 260, 270, 2, 2, 128, bf, true, true};
    c.q_lens = {129, 260};
    c.kv_lens = {270, 0};
    add(c);
  }
  {
    Case c{"h64 padding + window", 2, 300, 300, 2, 1, 64, bf, true, false, 50, 0};
    c.q_lens = {300, 11};
    c.kv_lens = {250, 300};
    add(c);
  }
  {
    Case c{"h128 spike in batch row 1", 2, 256, 256, 4, 4, 128, bf, true};
    c.spike = true;
    add(c);
  }
  {
    Case c{"h128 nan in a query row", 2, 256, 256, 2, 2, 128, bf, true};
    c.nan = true;
    add(c);
  }
  for (int H : {64, 128, 256}) {
    Case c{"h" + std::to_string(H) + " softcap 30 causal", 2, 300, 300, 4, 2, H, bf, true};
    c.softcap = 30.0f;
    c.q_gain = 24.0f;
    add(c);
  }
  {
    Case c{"h128 softcap 50 dense fp16", 2, 256, 333, 2, 2, 128, fp};
    c.softcap = 50.0f;
    c.q_gain = 16.0f;
    add(c, true);
  }
  {
    Case c{"h128 softcap window padding", 2, 260, 270, 2, 1, 128, bf, true, true, 64, 0};
    c.softcap = 30.0f;
    c.q_gain = 24.0f;
    c.q_lens = {129, 260};
    c.kv_lens = {270, 100};
    add(c);
  }
  {
    Case c{"h128 segments B=3 unequal causal", 3, 700, 700, 4, 2, 128, bf, true};
    AppendRuns(c.q_seg, {1, 130, 200, 5, 364}, {1, 2, 3, 4, 5});
    AppendRuns(c.q_seg, {700}, {7});
    AppendRuns(c.q_seg, {50, 300, 250, 100}, {0, 1, 2, 0});
    c.kv_seg = c.q_seg;
    add(c);
  }
  {
    Case c{"h64 segments 16 runs fp16 dense", 2, 1024, 1024, 2, 2, 64, fp};
    std::vector<int> lens, ids;
    int used = 0;
    for (int r = 0; r < 15; ++r) {
      lens.push_back(r % 3 == 0 ? 65 : 61);
      used += lens.back();
      ids.push_back(r + 1);
    }
    lens.push_back(1024 - used);
    ids.push_back(16);
    AppendRuns(c.q_seg, lens, ids);
    AppendRuns(c.q_seg, {1024}, {0});  // row 1: all padding
    c.kv_seg = c.q_seg;
    add(c);
  }
  {
    Case c{"h128 segments non-contiguous ids", 2, 300, 300, 2, 2, 128, bf};
    AppendRuns(c.q_seg, {40, 100, 60, 100}, {1, 2, 1, 3});
    AppendRuns(c.q_seg, {150, 150}, {3, -4});
    c.kv_seg = c.q_seg;
    add(c);
  }
  {
    Case c{"h128 segments T!=S causal br", 2, 300, 420, 2, 1, 128, bf, true, true};
    AppendRuns(c.q_seg, {100, 200}, {1, 2});
    AppendRuns(c.q_seg, {1, 299}, {5, 6});
    AppendRuns(c.kv_seg, {150, 270}, {1, 2});
    AppendRuns(c.kv_seg, {300, 120}, {6, 5});
    add(c);
  }
  {
    Case c{"h128 segments padding window gqa", 2, 260, 270, 4, 1, 128, bf, true, false, 64, 0};
    c.q_lens = {200, 260};
    c.kv_lens = {270, 150};
    AppendRuns(c.q_seg, {129, 131}, {1, 2});
    AppendRuns(c.q_seg, {10, 250}, {3, 4});
    AppendRuns(c.kv_seg, {129, 141}, {1, 2});
    AppendRuns(c.kv_seg, {10, 260}, {3, 4});
    add(c);
  }
  {
    Case c{"h128 segments spike softcap", 2, 512, 512, 4, 4, 128, bf, true};
    AppendRuns(c.q_seg, {128, 256, 128}, {1, 2, 3});
    AppendRuns(c.q_seg, {300, 212}, {1, 2});
    c.kv_seg = c.q_seg;
    c.spike = true;
    c.softcap = 30.0f;
    add(c);
  }
  {
    Case c{"h128 sinks causal padding gqa", 3, 300, 300, 4, 2, 128, bf, true};
    c.sink = {-1.0f, 0.5f, 6.0f, -kInf32};
    c.q_lens = {300, 0, 129};
    c.kv_lens = {300, 200, 1};
    add(c, true);
  }
  {
    Case c{"h64 off-by-one dense fp16 T!=S", 2, 200, 333, 2, 1, 64, fp};
    c.sink = {0.0f, 0.0f};
    add(c);
  }
  {
    Case c{"h128 sinks segments spike", 2, 400, 400, 2, 2, 128, bf, true};
    AppendRuns(c.q_seg, {30, 170, 200}, {0, 1, 2});
    AppendRuns(c.q_seg, {1, 399}, {3, 4});
    c.kv_seg = c.q_seg;
    c.sink = {1.5f, -0.5f};
    c.spike = true;
    add(c);
  }
  // Head dim 256 (bwd_config_wide.h: 64 keys per CTA, the warpgroups split the queries of S^T and
  // the columns of dK, dV and dQ): the features of the cases above at its own tile boundaries.
  add({"h256 gqa 8/2 causal br T>S", 1, 333, 200, 8, 2, 256, bf, true, true});
  add({"h256 window 64,16 fp16", 1, 300, 330, 2, 1, 256, fp, false, false, 64, 16});
  add({"h256 dlse dense T!=S odd", 2, 77, 515, 2, 2, 256, bf}, true);
  {
    Case c{"h256 padding softcap causal", 3, 257, 300, 2, 2, 256, bf, true};
    c.q_lens = {100, 257, 0};
    c.kv_lens = {180, 64, 300};
    c.softcap = 50.0f;
    c.q_gain = 16.0f;
    add(c, true);
  }
  {
    Case c{"h256 segments sinks spike gqa", 2, 400, 400, 4, 2, 256, bf, true};
    AppendRuns(c.q_seg, {30, 170, 1, 199}, {0, 1, 2, 3});
    AppendRuns(c.q_seg, {1, 63, 336}, {3, 4, 5});
    c.kv_seg = c.q_seg;
    c.sink = {1.5f, -0.5f, 0.0f, -kInf32};
    c.spike = true;
    add(c);
  }
  {
    Case c{"h256 nan in a query row", 2, 256, 256, 2, 2, 256, bf, true};
    c.nan = true;
    add(c);
  }
  add({"h256 T=1 decode S=700", 2, 1, 700, 4, 2, 256, bf});
  add({"h256 long dense 700", 1, 700, 700, 2, 2, 256, bf});
  add({"h128 T=1 decode S=1000", 3, 1, 1000, 4, 2, 128, bf});
  add({"h128 T=1 causal br S=700", 2, 1, 700, 2, 2, 128, bf, true, true});
  add({"h128 S=1 T=200 causal br", 2, 200, 1, 2, 2, 128, bf, true, true});
  add({"h128 long causal 1024", 1, 1024, 1024, 2, 2, 128, bf, true});
  add({"h64 long dense 1000", 1, 1000, 1000, 2, 2, 64, fp});
  // The deterministic mode (ordered dQ adds) on the cases with the most ways to
  // order them: many key blocks per query block, GQA, windows, segments, padding.
  const std::vector<BwdCase> plain = v;
  for (const char* name : {"h128 dense", "h64 dense", "h128 gqa 8/2 causal", "h128 window 32,16",
                           "h128 padding lengths", "h128 segments B=3 unequal causal", "h128 sinks causal padding gqa",
                           "h128 causal br T>S (masked rows)", "h64 long dense 1000", "h128 long causal 1024",
                           "h256 gqa 8/2 causal br T>S", "h256 padding softcap causal", "h256 segments sinks spike gqa",
                           "h256 long dense 700"}) {
    for (const BwdCase& b : plain) {
      if (b.c.name != name) continue;
      BwdCase d = b;
      d.deterministic = true;
      v.push_back(d);
      break;
    }
  }
  return v;
}

std::vector<BwdCase> SmallCases() {
  std::vector<BwdCase> v;
  Case a{"small h128 causal padding", 2, 150, 200, 2, 1, 128, DType::kBFloat16, true, true};
  a.q_lens = {150, 40};
  a.kv_lens = {200, 190};
  v.push_back({a, true});
  v.push_back({{"small h64 window", 1, 130, 140, 2, 2, 64, DType::kFloat16, false, false, 20, 10}, false});
  Case s{"small h128 segments softcap sinks", 2, 200, 200, 2, 2, 128, DType::kBFloat16, true};
  AppendRuns(s.q_seg, {1, 128, 71}, {1, 2, 3});
  AppendRuns(s.q_seg, {20, 180}, {0, 4});
  s.kv_seg = s.q_seg;
  s.sink = {0.5f, -2.0f};
  s.softcap = 30.0f;
  v.push_back({s, false});
  v.push_back({s, false, true});
  Case w{"small h256 segments softcap padding", 2, 150, 170, 4, 2, 256, DType::kBFloat16, true};
  AppendRuns(w.q_seg, {1, 100, 49}, {1, 2, 3});
  AppendRuns(w.q_seg, {150}, {4});
  AppendRuns(w.kv_seg, {20, 100, 50}, {1, 2, 3});
  AppendRuns(w.kv_seg, {170}, {4});
  w.q_lens = {150, 90};
  w.kv_lens = {170, 160};
  w.softcap = 30.0f;
  v.push_back({w, true});
  return v;
}

// Timings of the backward call (pre-pass, main kernel, post-pass), bf16. FLOPs
// counted as 2.5x the forward's (five GEMMs against two), halved for causal.
void Perf(int only_shape, float softcap, int docs, bool deterministic) {
  struct Shape { int B, T, N, K, H; bool causal; };
  const Shape shapes[] = {{4, 2048, 32, 32, 128, true}, {4, 2048, 32, 32, 128, false},
                          {2, 8192, 16, 16, 128, true}, {4, 4096, 32, 8, 128, true},
                          {8, 2048, 16, 16, 64, true},  {16, 1024, 16, 16, 128, true},
                          {4, 2048, 16, 16, 256, true}};
  if (softcap > 0) std::printf("\nsoft cap %g", softcap);
  if (docs > 0) std::printf("\n%d documents per row (segment ids)", docs);
  if (deterministic) std::printf("\ndeterministic backward (ordered dQ)");
  std::printf("\n%-28s %10s %10s %10s\n", "B,T,N,K,H mask", "fwd ms", "bwd ms", "bwd TFLOP/s");
  for (int si = 0; si < static_cast<int>(sizeof shapes / sizeof shapes[0]); ++si) {
    if (only_shape >= 0 && si != only_shape) continue;
    const Shape& s = shapes[si];
    const size_t nq = static_cast<size_t>(s.B) * s.T * s.N * s.H, nk = static_cast<size_t>(s.B) * s.T * s.K * s.H;
    DeviceBuffer<uint16_t> q(nq), k(nk), v(nk), out(nq), dout(nq), dq(nq), dk(nk), dv(nk);
    DeviceBuffer<float> lse(static_cast<size_t>(s.B) * s.N * s.T);
    RandomFill<<<1024, 256>>>(q.ptr, nq, 1u, true);
    RandomFill<<<1024, 256>>>(k.ptr, nk, 2u, true);
    RandomFill<<<1024, 256>>>(v.ptr, nk, 3u, true);
    RandomFill<<<1024, 256>>>(dout.ptr, nq, 4u, true);
    CUDA_OK(cudaGetLastError());
    AttentionShape shape;
    shape.batch = s.B; shape.q_len = s.T; shape.kv_len = s.T; shape.num_q_heads = s.N;
    shape.num_kv_heads = s.K; shape.head_dim = s.H; shape.head_dim_v = s.H;
    AttentionOptions opt;
    opt.scale = 1.0f / std::sqrt(static_cast<float>(s.H));
    opt.causal = s.causal;
    opt.softcap = softcap;
    opt.deterministic = deterministic;
    AttentionInputs in;
    in.dtype = DType::kBFloat16; in.q = q.ptr; in.k = k.ptr; in.v = v.ptr;
    std::vector<int> ids;
    for (int b = 0; b < s.B && docs > 0; ++b)
      for (int i = 0; i < s.T; ++i) ids.push_back(1 + static_cast<int>(static_cast<int64_t>(i) * docs / s.T));
    DeviceBuffer<int32_t> seg(ids.size());
    if (docs > 0) {
      Upload(seg, std::vector<int32_t>(ids.begin(), ids.end()));
      in.q_segment_ids = in.kv_segment_ids = seg.ptr;
    }
    ScratchArena scratch;
    const maxattn::DeviceContext ctx = scratch.Context();
    cudaEvent_t e0, e1;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    auto timed = [&](bool backward) {
      CUDA_OK(cudaEventRecord(e0));
      const Status st = [&] {
        if (backward) {
          BackwardInputs saved;
          saved.out = out.ptr; saved.dout = dout.ptr; saved.lse = lse.ptr;
          BackwardOutputs g;
          g.dq = dq.ptr; g.dk = dk.ptr; g.dv = dv.ptr;
          return maxattn::AttentionBackwardSm90(shape, opt, in, saved, g, ctx);
        }
        ForwardOutputs o;
        o.out = out.ptr; o.lse = lse.ptr;
        return maxattn::AttentionForwardSm90(shape, opt, in, o, ctx);
      }();
      CUDA_OK(cudaEventRecord(e1));
      if (!st.ok()) { std::printf("perf status: %s\n", st.message().c_str()); std::exit(1); }
      CUDA_OK(cudaEventSynchronize(e1));
      float ms = 0;
      CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
      return static_cast<double>(ms);
    };
    for (int w = 0; w < 3; ++w) { timed(false); timed(true); }
    std::vector<double> f, b;
    for (int r = 0; r < 20; ++r) { f.push_back(timed(false)); b.push_back(timed(true)); }
    std::sort(f.begin(), f.end());
    std::sort(b.begin(), b.end());
    const double mf = f[f.size() / 2], mb = b[b.size() / 2];
    const double flops = 2.5 * 4.0 * s.B * s.N * static_cast<double>(s.T) * s.T * s.H * (s.causal ? 0.5 : 1.0);
    char label[64];
    std::snprintf(label, sizeof label, "%d,%d,%d,%d,%d %s", s.B, s.T, s.N, s.K, s.H, s.causal ? "causal" : "none");
    std::printf("%-28s %10.4f %10.4f %10.1f\n", label, mf, mb, flops / mb / 1e9);
    std::fflush(stdout);
    CUDA_OK(cudaEventDestroy(e0));
    CUDA_OK(cudaEventDestroy(e1));
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool small = false, perf = true, perf_only = false;
  int only_shape = -1, docs = 0;
  float softcap = 0.0f;
  bool deterministic = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--small")) { small = true; perf = false; }
    if (!std::strcmp(argv[i], "--no-perf")) perf = false;
    if (!std::strcmp(argv[i], "--perf-only")) perf_only = true;
    if (!std::strcmp(argv[i], "--shape") && i + 1 < argc) only_shape = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--softcap") && i + 1 < argc) softcap = static_cast<float>(std::atof(argv[++i]));
    if (!std::strcmp(argv[i], "--segments") && i + 1 < argc) docs = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--deterministic")) deterministic = true;
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a crash keeps what was printed before it
  cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, cc %d.%d, %d SMs\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
  int failures = 0, total = 0;
  if (!perf_only) {
    uint64_t seed = 4321;
    for (const BwdCase& c : small ? SmallCases() : AllCases()) {
      ++total;
      failures += !RunCase(c, seed++);
    }
    std::printf("\n%d/%d cases passed\n", total - failures, total);
  }
  if (perf) Perf(only_shape, softcap, docs, deterministic);
  return failures == 0 ? 0 : 1;
}
