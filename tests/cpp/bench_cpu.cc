// Timing of the CPU forward/backward (not a test). Prints ms and GFLOP/s,
// counting 4*B*N*T*S*H flops for the forward (2 GEMMs) halved when causal.
// usage: bench_cpu [B T N K H causal iters with_max_logit run_backward]
// with_max_logit=0 does not request max_logit, so the difference of two runs
// (e.g. instruction counts under `valgrind --tool=callgrind`, which are
// repeatable on a loaded machine) is the cost of max_logit.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "maxattn/attention.h"

int main(int argc, char** argv) {
  auto arg = [&](int i, long def) { return argc > i ? std::atol(argv[i]) : def; };
  const int64_t B = arg(1, 1), T = arg(2, 2048), N = arg(3, 8), K = arg(4, N), H = arg(5, 64);
  const bool causal = arg(6, 0) != 0;
  const int iters = static_cast<int>(arg(7, 10));
  const bool with_max = arg(8, 1) != 0;
  const int passes = arg(9, 1) != 0 ? 2 : 1;
  const int64_t S = T;
  std::mt19937 rng(1);
  std::normal_distribution<float> dist;
  std::vector<float> q(static_cast<size_t>(B * T * N * H)), k(static_cast<size_t>(B * S * K * H)),
      v(k.size()), out(q.size()), lse(static_cast<size_t>(B * N * T)), ml(static_cast<size_t>(B * N));
  for (auto* x : {&q, &k, &v})
    for (auto& e : *x) e = dist(rng);
  maxattn::AttentionShape shape{B, T, S, N, K, H, H};
  maxattn::AttentionOptions opt;
  opt.scale = 1.0f / std::sqrt(static_cast<float>(H));
  opt.causal = causal;
  maxattn::AttentionInputs in;
  in.q = q.data();
  in.k = k.data();
  in.v = v.data();
  maxattn::ForwardOutputs fo{out.data(), lse.data(), with_max ? ml.data() : nullptr};
  std::vector<float> dout(q.size(), 0.5f), dq(q.size()), dk(k.size()), dv(v.size());
  maxattn::BackwardInputs bi{out.data(), dout.data(), lse.data(), nullptr};
  maxattn::BackwardOutputs bo{dq.data(), dk.data(), dv.data(), nullptr};
  const double flops = 4.0 * static_cast<double>(B * N * T * S * H) * (causal ? 0.5 : 1.0);
  for (int pass = 0; pass < passes; ++pass) {
    double best = 1e30;
    for (int it = 0; it < iters + 1; ++it) {
      const auto t0 = std::chrono::steady_clock::now();
      const maxattn::Status st = pass == 0 ? maxattn::AttentionForwardCpu(shape, opt, in, fo)
                                           : maxattn::AttentionBackwardCpu(shape, opt, in, bi, bo);
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!st.ok()) {
        std::fprintf(stderr, "error: %s\n", st.message().c_str());
        return 1;
      }
      if (it > 0 && dt < best) best = dt;
    }
    const double f = pass == 0 ? flops : flops * 2.5;
    std::printf("%s B=%ld T=%ld N=%ld K=%ld H=%ld causal=%d: %.2f ms  %.1f GFLOP/s\n",
                pass == 0 ? "fwd" : "bwd", static_cast<long>(B), static_cast<long>(T),
                static_cast<long>(N), static_cast<long>(K), static_cast<long>(H), causal ? 1 : 0,
                best * 1e3, f / best * 1e-9);
  }
  return 0;
}
