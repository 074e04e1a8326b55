// Standalone GPU harness for the sm90 forward (csrc/maxattn/sm90/): numerics
// against a float64 CPU reference over a matrix of cases, then timings.
//
//   sm90_fwd_harness            all cases, then the timed shapes
//   sm90_fwd_harness --small    five small cases, no timing (for compute-sanitizer)
//   sm90_fwd_harness --no-perf  all cases, no timing
//   sm90_fwd_harness --perf-only [--shape I] [--softcap X] [--segments D] [--sinks]
//                               timings only (of timed shape I alone; with a soft cap;
//                               with segment ids of D equal documents per row; with
//                               off-by-one sinks)
//
// SM90_HARNESS_DUMP=1 also prints, for cases with segment ids, the pre-pass summaries
// (segments.h) and the first rows whose lse is off.
//
// Each case draws fresh random inputs, poisons the outputs (0x7f bytes: a huge
// finite value) before the run, compares out / lse / max_logit with the
// reference (docs/contract.md's tolerances), re-runs with lse and max_logit
// off (out must be bit-identical) and re-runs once more (out must be
// bit-identical: a moving result is a race). Exit code 1 if any case fails.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "maxattn/attention.h"
#include "maxattn/sm90/sm90_attention.h"
#include "harness_common.h"

namespace {

using namespace harness;
using maxattn::ForwardOutputs;
using maxattn::Status;

struct Reference {
  std::vector<double> out, lse, max_logit;
  std::vector<char> empty;  // [B*N*T]: the row sees no key (out must be 0)
};

Reference ComputeReference(const Case& c, const std::vector<float>& q, const std::vector<float>& k,
                           const std::vector<float>& v, double scale) {
  Reference r;
  const int B = c.B, T = c.T, S = c.S, N = c.N, K = c.K, H = c.H, G = N / K;
  r.out.assign(static_cast<size_t>(B) * T * N * H, 0.0);
  r.lse.assign(static_cast<size_t>(B) * N * T, -kInf);
  r.max_logit.assign(static_cast<size_t>(B) * N, -kInf);
  r.empty.assign(static_cast<size_t>(B) * N * T, 1);
  auto work = [&](int bn) {
    const int b = bn / N, n = bn % N, kh = n / G;
    const double sink = c.sink.empty() ? -kInf : c.sink[n];
    const Visibility vis = VisFor(c, b);
    std::vector<double> s(S);
    double head_max = -kInf;
    bool head_nan = false;
    for (int i = 0; i < T; ++i) {
      r.lse[(static_cast<size_t>(b) * N + n) * T + i] = sink;  // a row that sees nothing
      const float* qi = &q[((static_cast<size_t>(b) * T + i) * N + n) * H];
      double m = -kInf, lm = -kInf;  // max of the raw logits (max_logit) and of the capped ones
      bool any = false, row_nan = false;
      std::vector<double> l(S);
      for (int j = 0; j < S; ++j) {
        if (!vis(i, j)) continue;
        const float* kj = &k[((static_cast<size_t>(b) * S + j) * K + kh) * H];
        double dot = 0;
        for (int h = 0; h < H; ++h) dot += static_cast<double>(qi[h]) * kj[h];
        s[j] = scale * dot;
        l[j] = c.softcap > 0 ? c.softcap * std::tanh(s[j] / c.softcap) : s[j];
        any = true;
        if (std::isnan(s[j])) {
          row_nan = true;
        } else {
          m = std::max(m, s[j]);
          lm = std::max(lm, l[j]);
        }
      }
      if (!any) continue;
      r.empty[(static_cast<size_t>(b) * N + n) * T + i] = 0;
      if (row_nan) head_nan = true; else head_max = std::max(head_max, m);
      double sum = 0;
      std::vector<double> acc(H, 0.0);
      for (int j = 0; j < S; ++j) {
        if (!vis(i, j)) continue;
        const double p = row_nan ? std::nan("") : std::exp(l[j] - lm);
        sum += p;
        const float* vj = &v[((static_cast<size_t>(b) * S + j) * K + kh) * H];
        for (int h = 0; h < H; ++h) acc[h] += p * vj[h];
      }
      // lse = log(sum_j exp(l_j) + exp(sink)), out = sum_j exp(l_j - lse) v_j.
      const double top = std::max(lm, sink);
      const double lse = top + std::log(sum * std::exp(lm - top) + std::exp(sink - top));
      const double norm = std::exp(lm - lse);
      double* o = &r.out[((static_cast<size_t>(b) * T + i) * N + n) * H];
      for (int h = 0; h < H; ++h) o[h] = acc[h] * norm;
      r.lse[(static_cast<size_t>(b) * N + n) * T + i] = row_nan ? std::nan("") : lse;
    }
    r.max_logit[static_cast<size_t>(b) * N + n] = head_nan ? std::nan("") : head_max;
  };
  ParallelFor(B * N, work);
  return r;
}

bool RunCase(const Case& c, uint64_t seed) {
  const int B = c.B, T = c.T, S = c.S, N = c.N, H = c.H;
  std::mt19937_64 rng(seed);
  const HostInputs host = DrawInputs(c, rng);
  const size_t nq = host.q.size();
  const double scale = DeviceCall::Scale(c);
  const Reference ref = ComputeReference(c, host.q, host.k, host.v, static_cast<float>(scale));

  DeviceCall call(c, host);
  const AttentionShape& shape = call.shape;
  const AttentionOptions& opt = call.options;
  const AttentionInputs& in = call.inputs;
  DeviceBuffer<uint16_t> dout(nq), dout2(nq);
  DeviceBuffer<float> dlse(static_cast<size_t>(B) * N * T), dmax(static_cast<size_t>(B) * N);

  if (auto reason = maxattn::Sm90UnsupportedReason(shape, opt, in)) {
    std::printf("FAIL %-34s unsupported: %s\n", c.name.c_str(), reason->c_str());
    return false;
  }
  ScratchArena scratch;  // reused by the three runs (same sizes)
  scratch.poison = true;
  auto run = [&](void* out, float* lse, float* mx, bool max_over_batch = false) {
    CUDA_OK(cudaMemset(out, 0x7f, dout.bytes()));
    if (lse) CUDA_OK(cudaMemset(lse, 0x7f, dlse.bytes()));
    if (mx) CUDA_OK(cudaMemset(mx, 0x7f, dmax.bytes()));
    ForwardOutputs o;
    o.out = out; o.lse = lse; o.max_logit = mx; o.max_logit_over_batch = max_over_batch;
    Status st = maxattn::AttentionForwardSm90(shape, opt, in, o, scratch.Context());
    if (!st.ok()) {
      std::printf("FAIL %-34s status: %s\n", c.name.c_str(), st.message().c_str());
      return false;
    }
    CUDA_OK(cudaDeviceSynchronize());
    return true;
  };
  if (!run(dout.ptr, dlse.ptr, dmax.ptr)) return false;
  if (std::getenv("SM90_HARNESS_DUMP") != nullptr && !c.q_seg.empty()) {
    const int bn = H <= 128 ? 128 : 64, NB = (S + bn - 1) / bn, MB = (T + 127) / 128;
    std::vector<int32_t> kb(static_cast<size_t>(B) * NB * 4), qb(static_cast<size_t>(B) * MB * 4),
        re(static_cast<size_t>(B) * S);
    char* base = static_cast<char*>(scratch.block) + maxattn::Sm90TileCounterBytes(H);
    CUDA_OK(cudaMemcpy(kb.data(), base, kb.size() * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(qb.data(), base + kb.size() * 4, qb.size() * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(re.data(), base + (kb.size() + qb.size()) * 4, re.size() * 4, cudaMemcpyDeviceToHost));
    for (int b = 0; b < B; ++b) {
      for (int nb = 0; nb < NB; ++nb) {
        const int32_t* x = &kb[(static_cast<size_t>(b) * NB + nb) * 4];
        std::printf("  b%d key block %d: lo %d hi %d uniform %d\n", b, nb, x[0], x[1], x[2]);
      }
      for (int mb = 0; mb < MB; ++mb) {
        const int32_t* x = &qb[(static_cast<size_t>(b) * MB + mb) * 4];
        std::printf("  b%d query block %d: n [%d, %d) uniform %d\n", b, mb, x[0], x[1], x[2]);
      }
      std::printf("  b%d run ends:", b);
      for (int j = 0; j < S; ++j) if (j == 0 || re[static_cast<size_t>(b) * S + j] != re[static_cast<size_t>(b) * S + j - 1]) std::printf(" %d:%d", j, re[static_cast<size_t>(b) * S + j]);
      std::printf("\n");
    }
  }
  std::vector<uint16_t> got(nq), got2(nq);
  std::vector<float> glse(dlse.count), gmax(dmax.count);
  CUDA_OK(cudaMemcpy(got.data(), dout.ptr, dout.bytes(), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(glse.data(), dlse.ptr, dlse.bytes(), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(gmax.data(), dmax.ptr, dmax.bytes(), cudaMemcpyDeviceToHost));
  if (std::getenv("SM90_HARNESS_DUMP") != nullptr) {
    int shown = 0;
    for (size_t idx = 0; idx < glse.size() && shown < 40; ++idx) {
      if (std::fabs(glse[idx] - ref.lse[idx]) > 1e-2 || (std::isinf(ref.lse[idx]) != std::isinf(glse[idx]))) {
        std::printf("  lse b%zu n%zu i%zu: got %.4f ref %.4f\n", idx / (static_cast<size_t>(N) * T),
                    idx / T % N, idx % T, glse[idx], ref.lse[idx]);
        ++shown;
      }
    }
  }

  // out
  double num = 0, den = 0;
  size_t nan_mismatch = 0, masked_nonzero = 0;
  for (size_t idx = 0; idx < nq; ++idx) {
    const double g = FromBits(got[idx], c.dtype), r = ref.out[idx];
    if (std::isnan(r) || std::isnan(g)) {
      nan_mismatch += std::isnan(r) != std::isnan(g);
      continue;
    }
    num += (g - r) * (g - r);
    den += r * r;
  }
  for (int b = 0; b < B; ++b)
    for (int n = 0; n < N; ++n)
      for (int i = 0; i < T; ++i)
        if (ref.empty[(static_cast<size_t>(b) * N + n) * T + i])
          for (int h = 0; h < H; ++h)
            masked_nonzero += got[((static_cast<size_t>(b) * T + i) * N + n) * H + h] != 0;
  const double out_err = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  const double out_tol = c.dtype == DType::kBFloat16 ? 2e-2 : 1e-2;
  // lse
  double lse_err = 0;
  size_t lse_bad = 0, masked_rows = 0;
  for (size_t idx = 0; idx < glse.size(); ++idx) {
    const double g = glse[idx], r = ref.lse[idx];
    masked_rows += ref.empty[idx];
    if (std::isinf(r)) {
      lse_bad += g != r;
    } else if (std::isnan(r) || std::isnan(g)) {
      lse_bad += std::isnan(r) != std::isnan(g);
    } else {
      const double e = std::fabs(g - r) / std::max(1.0, std::fabs(r));
      lse_err = std::max(lse_err, e);
      lse_bad += e > 2e-3;
    }
  }
  // max_logit
  double max_err = 0;
  size_t max_bad = 0;
  for (size_t idx = 0; idx < gmax.size(); ++idx) {
    const double g = gmax[idx], r = ref.max_logit[idx];
    if (std::isnan(r) || std::isnan(g) || std::isinf(r) || std::isinf(g)) {
      const bool same = (std::isnan(r) && std::isnan(g)) || (g == r);
      max_bad += !same;
    } else {
      const double e = std::fabs(g - r) / std::max(std::fabs(r), 1e-3);
      max_err = std::max(max_err, e);
      max_bad += e > 1e-3;
    }
  }
  // out without lse / max_logit, and a second identical run: bit-identical.
  size_t diff_nolse = 0, diff_rerun = 0;
  if (!run(dout2.ptr, nullptr, nullptr)) return false;
  CUDA_OK(cudaMemcpy(got2.data(), dout2.ptr, dout2.bytes(), cudaMemcpyDeviceToHost));
  for (size_t idx = 0; idx < nq; ++idx) diff_nolse += got2[idx] != got[idx];
  if (!run(dout2.ptr, dlse.ptr, dmax.ptr)) return false;
  CUDA_OK(cudaMemcpy(got2.data(), dout2.ptr, dout2.bytes(), cudaMemcpyDeviceToHost));
  for (size_t idx = 0; idx < nq; ++idx) diff_rerun += got2[idx] != got[idx];
  // max_logit over the batch ([1, N]) equals the NaN-propagating max of the rows' values exactly.
  size_t over_bad = 0;
  if (!run(dout2.ptr, nullptr, dmax.ptr, true)) return false;
  std::vector<float> gover(static_cast<size_t>(N));
  CUDA_OK(cudaMemcpy(gover.data(), dmax.ptr, gover.size() * sizeof(float), cudaMemcpyDeviceToHost));
  for (int n = 0; n < N; ++n) {
    float want = -INFINITY;
    for (int b = 0; b < B; ++b) {
      const float row = gmax[static_cast<size_t>(b) * N + n];
      want = std::isnan(row) || std::isnan(want) ? std::nanf("") : std::max(want, row);
    }
    over_bad += std::isnan(want) ? !std::isnan(gover[n]) : gover[n] != want;
  }

  double ref_max_abs = -kInf;
  for (double m : ref.max_logit) if (!std::isnan(m)) ref_max_abs = std::max(ref_max_abs, m);
  const bool pass = out_err <= out_tol && nan_mismatch == 0 && masked_nonzero == 0 && lse_bad == 0 &&
                    max_bad == 0 && diff_nolse == 0 && diff_rerun == 0 && over_bad == 0;
  std::printf("%s %-34s %s out_rel=%.2e lse_err=%.1e max_rel=%.1e nan_mis=%zu masked_rows=%zu masked_nz=%zu "
              "lse_bad=%zu max_bad=%zu nolse_diff=%zu rerun_diff=%zu over_batch_bad=%zu top_logit=%.3f\n",
              pass ? "PASS" : "FAIL", c.name.c_str(), DTypeName(c.dtype), out_err, lse_err, max_err, nan_mismatch,
              masked_rows, masked_nonzero, lse_bad, max_bad, diff_nolse, diff_rerun, over_bad, ref_max_abs);
  std::fflush(stdout);
  return pass;
}

std::vector<Case> AllCases() {
  std::vector<Case> v;
  auto add = [&](Case c) { v.push_back(std::move(c)); };
  for (DType t : {DType::kBFloat16, DType::kFloat16}) {
    for (int H : {64, 128, 256}) {
      const std::string h = "h" + std::to_string(H);
      add({h + " dense", 2, 256, 256, 4, 4, H, t});
      add({h + " causal tl odd", 2, 300, 300, 2, 2, H, t, true});
      add({h + " causal br T<S", 2, 200, 333, 2, 1, H, t, true, true});
    }
  }
  const DType bf = DType::kBFloat16;
  add({"h128 causal tl T>S", 1, 333, 200, 2, 2, 128, bf, true, false});
  add({"h128 causal br T>S (masked rows)", 1, 333, 200, 2, 2, 128, bf, true, true});
  add({"h128 dense T!=S odd", 2, 77, 515, 3, 3, 128, bf});
  // Dense key tails: one key past a whole block, several blocks, NaN and spike rows with sinks.
  add({"h128 dense key tail S=161", 2, 100, 161, 2, 2, 128, bf});
  add({"h128 dense S=480 mqa", 1, 130, 480, 2, 1, 128, DType::kFloat16});
  {
    Case c{"h128 dense nan spike sinks", 2, 200, 330, 2, 2, 128, bf};
    c.nan = true;
    c.spike = true;
    c.sink = {0.5f, -1.0f};
    add(c);
  }
  // Head dim 256 runs 80-key blocks: a tail of one key past a whole block, causal across block edges.
  add({"h256 key tail S=81 mqa", 1, 96, 81, 2, 1, 256, bf});
  add({"h256 causal br S=240 fp16", 2, 170, 240, 2, 2, 256, DType::kFloat16, true, true});
  add({"h128 gqa 8/2 causal", 2, 384, 384, 8, 2, 128, bf, true});
  add({"h128 mqa 4/1 dense", 1, 130, 260, 4, 1, 128, bf});
  add({"h64 gqa 6/3 causal br", 1, 190, 250, 6, 3, 64, bf, true, true});
  add({"h128 window 64,0 causal", 1, 500, 500, 2, 2, 128, bf, true, false, 64, 0});
  add({"h128 window 32,16", 1, 400, 450, 2, 2, 128, bf, false, false, 32, 16});
  add({"h128 window 100,-1 br", 1, 300, 420, 2, 2, 128, bf, false, true, 100, -1});
  add({"h256 window 40,40", 1, 260, 260, 2, 1, 256, DType::kFloat16, false, false, 40, 40});
  {
    Case c{"h128 padding lengths", 3, 257, 300, 2, 2, 128, bf};
    c.q_lens = {100, 257, 0};
    c.kv_lens = {180, 64, 300};
    add(c);
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
    Case c{"h256 spike padding", 2, 200, 200, 2, 2, 256, bf};
    c.spike = true;
    c.kv_lens = {200, 150};
    add(c);
  }
  {
    Case c{"h128 nan in a query row", 2, 256, 256, 2, 2, 128, bf, true};
    c.nan = true;
    add(c);
  }
  // Soft cap: q scaled up so that raw logits reach ~+-60 and the cap (30 or 50) bends them;
  // with causal, window, padding, GQA, a NaN row and each head dim.
  for (int H : {64, 128, 256}) {
    Case c{"h" + std::to_string(H) + " softcap 30 causal", 2, 300, 300, 4, 2, H, bf, true};
    c.softcap = 30.0f;
    c.q_gain = 24.0f;
    add(c);
  }
  {
    Case c{"h128 softcap 50 dense fp16", 2, 256, 333, 2, 2, 128, DType::kFloat16};
    c.softcap = 50.0f;
    c.q_gain = 16.0f;
    add(c);
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
    Case c{"h128 softcap nan row", 2, 256, 256, 2, 2, 128, bf, true};
    c.softcap = 30.0f;
    c.nan = true;
    add(c);
  }
  {
    Case c{"h128 softcap spike", 2, 256, 256, 4, 4, 128, bf, true};
    c.softcap = 20.0f;
    c.spike = true;
    add(c);
  }
  // Segment ids: B > 1 with unequal runs (length-1 runs, runs across tile edges, padding runs,
  // an all-padding row), 16 runs in a row, non-contiguous ids, T != S, with masks and features.
  {
    Case c{"h128 segments B=3 unequal causal", 3, 700, 700, 4, 2, 128, bf, true};
    AppendRuns(c.q_seg, {1, 130, 200, 5, 364}, {1, 2, 3, 4, 5});
    AppendRuns(c.q_seg, {700}, {7});
    AppendRuns(c.q_seg, {50, 300, 250, 100}, {0, 1, 2, 0});
    c.kv_seg = c.q_seg;
    add(c);
  }
  {
    Case c{"h64 segments 16 runs fp16 dense", 2, 1024, 1024, 2, 2, 64, DType::kFloat16};
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
    Case c{"h256 segments T!=S causal br", 2, 300, 420, 2, 1, 256, bf, true, true};
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
  // Sinks (learnable and off-by-one): the denominator gains exp(sink[n]); empty rows have
  // lse = sink; a sink of -inf is the vanilla softmax; a large sink dominates small rows.
  {
    Case c{"h128 sinks causal padding gqa", 3, 300, 300, 4, 2, 128, bf, true};
    c.sink = {-1.0f, 0.5f, 6.0f, -kInf32};
    c.q_lens = {300, 0, 129};
    c.kv_lens = {300, 200, 1};
    add(c);
  }
  {
    Case c{"h64 off-by-one dense fp16 T!=S", 2, 200, 333, 2, 1, 64, DType::kFloat16};
    c.sink = {0.0f, 0.0f};
    add(c);
  }
  {
    Case c{"h256 sinks softcap br", 2, 260, 300, 2, 2, 256, bf, true, true};
    c.sink = {2.0f, -3.0f};
    c.softcap = 30.0f;
    c.q_gain = 24.0f;
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
  add({"h128 T=1 decode S=1000", 3, 1, 1000, 4, 2, 128, bf});
  add({"h128 T=1 causal br S=700", 2, 1, 700, 2, 2, 128, bf, true, true});
  add({"h128 long causal 1024", 1, 1024, 1024, 2, 2, 128, bf, true});
  add({"h64 long dense 1000", 1, 1000, 1000, 2, 2, 64, DType::kFloat16});
  return v;
}

std::vector<Case> SmallCases() {
  std::vector<Case> v;
  Case a{"small h128 causal padding", 2, 150, 200, 2, 1, 128, DType::kBFloat16, true, true};
  a.q_lens = {150, 40};
  a.kv_lens = {200, 190};
  v.push_back(a);
  v.push_back({"small h64 window", 1, 130, 140, 2, 2, 64, DType::kFloat16, false, false, 20, 10});
  // The persistent H = 256 kernel (out stored from registers) and the capped persistent H = 64 loop.
  Case h{"small h256 causal padding", 2, 140, 200, 2, 1, 256, DType::kBFloat16, true, true};
  h.q_lens = {140, 60};
  h.kv_lens = {200, 170};
  v.push_back(h);
  Case c{"small h64 softcap causal", 1, 150, 150, 2, 2, 64, DType::kBFloat16, true};
  c.softcap = 30.0f;
  v.push_back(c);
  Case s{"small h128 segments", 2, 200, 200, 2, 2, 128, DType::kBFloat16, true};
  AppendRuns(s.q_seg, {1, 128, 71}, {1, 2, 3});
  AppendRuns(s.q_seg, {20, 180}, {0, 4});
  s.kv_seg = s.q_seg;
  s.sink = {0.5f, -2.0f};  // and sinks (epilogue)
  v.push_back(s);
  return v;
}

// softcap > 0: a logit soft cap; docs > 0: segment ids with `docs` equal documents per row
// (shape 5 is the unpacked equivalent of shape 2 with 8 documents).
void Perf(int only_shape, float softcap, int docs, bool sinks) {
  struct Shape { int B, T, N, K, H; bool causal; };
  const Shape shapes[] = {{4, 2048, 32, 32, 128, true}, {4, 2048, 32, 32, 128, false},
                          {2, 8192, 16, 16, 128, true}, {4, 4096, 32, 8, 128, true},
                          {8, 2048, 16, 16, 64, true},  {16, 1024, 16, 16, 128, true},
                          {4, 2048, 16, 16, 256, true}};
  if (softcap > 0) std::printf("\nsoft cap %g", softcap);
  if (docs > 0) std::printf("\n%d documents per row (segment ids)", docs);
  if (sinks) std::printf("\nsinks (off-by-one)");
  std::printf("\n%-28s %10s %10s %10s %10s %10s\n", "B,T,N,K,H mask", "ms(lse)", "TFLOP/s", "ms(+max)",
              "TFLOP/s", "max cost");
  for (int si = 0; si < static_cast<int>(sizeof shapes / sizeof shapes[0]); ++si) {
    if (only_shape >= 0 && si != only_shape) continue;
    const Shape& s = shapes[si];
    const size_t nq = static_cast<size_t>(s.B) * s.T * s.N * s.H, nk = static_cast<size_t>(s.B) * s.T * s.K * s.H;
    DeviceBuffer<uint16_t> q(nq), k(nk), v(nk), out(nq);
    DeviceBuffer<float> lse(static_cast<size_t>(s.B) * s.N * s.T), mx(static_cast<size_t>(s.B) * s.N);
    RandomFill<<<1024, 256>>>(q.ptr, nq, 1u, true);
    RandomFill<<<1024, 256>>>(k.ptr, nk, 2u, true);
    RandomFill<<<1024, 256>>>(v.ptr, nk, 3u, true);
    CUDA_OK(cudaGetLastError());
    AttentionShape shape;
    shape.batch = s.B; shape.q_len = s.T; shape.kv_len = s.T; shape.num_q_heads = s.N;
    shape.num_kv_heads = s.K; shape.head_dim = s.H; shape.head_dim_v = s.H;
    AttentionOptions opt;
    opt.scale = 1.0f / std::sqrt(static_cast<float>(s.H));
    opt.causal = s.causal;
    opt.softcap = softcap;
    AttentionInputs in;
    in.dtype = DType::kBFloat16; in.q = q.ptr; in.k = k.ptr; in.v = v.ptr;
    std::vector<int> ids;
    for (int b = 0; b < s.B && docs > 0; ++b)
      for (int i = 0; i < s.T; ++i) ids.push_back(1 + static_cast<int>(static_cast<int64_t>(i) * docs / s.T));
    DeviceBuffer<int32_t> seg(ids.size());
    if (docs > 0) {
      CUDA_OK(cudaMemcpy(seg.ptr, ids.data(), seg.bytes(), cudaMemcpyHostToDevice));
      in.q_segment_ids = in.kv_segment_ids = seg.ptr;
    }
    DeviceBuffer<float> sink(sinks ? s.N : 0);
    if (sinks) {
      CUDA_OK(cudaMemset(sink.ptr, 0, sink.bytes()));  // 0.0f: the off-by-one softmax
      in.sink_logits = sink.ptr;
    }
    ScratchArena scratch;
    const maxattn::DeviceContext ctx = scratch.Context();
    cudaEvent_t e0, e1;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    auto once = [&](bool with_max) {
      ForwardOutputs o;
      o.out = out.ptr; o.lse = lse.ptr; o.max_logit = with_max ? mx.ptr : nullptr;
      CUDA_OK(cudaEventRecord(e0));
      Status st = maxattn::AttentionForwardSm90(shape, opt, in, o, ctx);
      CUDA_OK(cudaEventRecord(e1));
      if (!st.ok()) { std::printf("perf status: %s\n", st.message().c_str()); std::exit(1); }
      CUDA_OK(cudaEventSynchronize(e1));
      float ms = 0;
      CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
      return static_cast<double>(ms);
    };
    for (int w = 0; w < 3; ++w) { once(false); once(true); }
    std::vector<double> a, b;
    for (int r = 0; r < 30; ++r) { a.push_back(once(false)); b.push_back(once(true)); }
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    const double ma = a[a.size() / 2], mb = b[b.size() / 2];
    const double flops = 4.0 * s.B * s.N * static_cast<double>(s.T) * s.T * s.H * (s.causal ? 0.5 : 1.0);
    char label[64];
    std::snprintf(label, sizeof label, "%d,%d,%d,%d,%d %s", s.B, s.T, s.N, s.K, s.H, s.causal ? "causal" : "none");
    std::printf("%-28s %10.4f %10.1f %10.4f %10.1f %9.2f%%\n", label, ma, flops / ma / 1e9, mb, flops / mb / 1e9,
                (mb / ma - 1.0) * 100.0);
    std::fflush(stdout);
    CUDA_OK(cudaEventDestroy(e0));
    CUDA_OK(cudaEventDestroy(e1));
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool small = false, perf = true;
  int only_shape = -1;
  float softcap = 0.0f;  // --softcap X: the timed shapes with a logit soft cap
  int docs = 0;          // --segments D: ... with D equal documents per row
  bool sinks = false;    // --sinks: ... with off-by-one sinks
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--small")) { small = true; perf = false; }
    if (!std::strcmp(argv[i], "--no-perf")) perf = false;
    if (!std::strcmp(argv[i], "--shape") && i + 1 < argc) only_shape = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--softcap") && i + 1 < argc) softcap = static_cast<float>(std::atof(argv[++i]));
    if (!std::strcmp(argv[i], "--segments") && i + 1 < argc) docs = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--sinks")) sinks = true;
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a crash keeps what was printed before it
  cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, cc %d.%d, %d SMs\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
  int failures = 0, total = 0;
  const std::vector<Case> cases = small ? SmallCases() : AllCases();
  bool perf_only = false;
  for (int i = 1; i < argc; ++i) perf_only |= !std::strcmp(argv[i], "--perf-only");
  if (!perf_only) {
    uint64_t seed = 1234;
    for (const Case& c : cases) {
      ++total;
      failures += !RunCase(c, seed++);
    }
    std::printf("\n%d/%d cases passed\n", total - failures, total);
  }
  if (perf) Perf(only_shape, softcap, docs, sinks);
  return failures == 0 ? 0 : 1;
}
