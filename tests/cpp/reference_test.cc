// The float64 reference's backward against central finite differences of its
// forward, so the oracle for the kernel's gradients is itself checked.
#include <gtest/gtest.h>

#include <random>

#include "reference.h"

namespace maxattn::testing {
namespace {

double Loss(const RefProblem& p, const std::vector<double>& dout, const std::vector<double>& dlse) {
  const RefForward f = RefAttentionForward(p);
  double l = 0;
  for (size_t i = 0; i < f.out.size(); ++i) l += f.out[i] * dout[i];
  for (size_t i = 0; i < f.lse.size(); ++i)
    if (std::isfinite(f.lse[i])) l += f.lse[i] * dlse[i];
  return l;
}

void CheckFiniteDifferences(RefProblem p, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal;
  const auto& sh = p.shape;
  p.q.resize(sh.batch * sh.q_len * sh.num_q_heads * sh.head_dim);
  p.k.resize(sh.batch * sh.kv_len * sh.num_kv_heads * sh.head_dim);
  p.v.resize(sh.batch * sh.kv_len * sh.num_kv_heads * sh.head_dim_v);
  for (auto* t : {&p.q, &p.k, &p.v, &p.bias})
    for (double& x : *t) x = normal(rng);
  std::vector<double> dout(sh.batch * sh.q_len * sh.num_q_heads * sh.head_dim_v);
  std::vector<double> dlse(sh.batch * sh.num_q_heads * sh.q_len);
  for (double& x : dout) x = normal(rng);
  for (double& x : dlse) x = normal(rng);
  const RefGrads g = RefAttentionBackward(p, dout, dlse);
  const double eps = 1e-6;
  auto check = [&](std::vector<double> RefProblem::*field, const std::vector<double>& grad,
                   const char* name) {
    for (size_t i = 0; i < grad.size(); ++i) {
      RefProblem pp = p, pm = p;
      (pp.*field)[i] += eps;
      (pm.*field)[i] -= eps;
      const double fd = (Loss(pp, dout, dlse) - Loss(pm, dout, dlse)) / (2 * eps);
      EXPECT_NEAR(grad[i], fd, 1e-6 * std::max(1.0, std::abs(fd))) << name << "[" << i << "]";
    }
  };
  check(&RefProblem::q, g.dq, "dq");
  check(&RefProblem::k, g.dk, "dk");
  check(&RefProblem::v, g.dv, "dv");
  check(&RefProblem::bias, g.dbias, "dbias");
}

TEST(Reference, BackwardMatchesFiniteDifferences) {
  RefProblem p;
  p.shape = AttentionShape{2, 3, 4, 2, 1, 3, 2};
  p.options.scale = 0.7f;
  p.options.causal = true;
  p.options.alignment = CausalAlignment::kBottomRight;
  p.bias_dims = BroadcastDims{1, 2, 1, 4};
  p.bias.resize(8);
  p.kv_len = {4, 3};
  CheckFiniteDifferences(p, 1);
}

TEST(Reference, BackwardWithSoftcapMatchesFiniteDifferences) {
  RefProblem p;
  p.shape = AttentionShape{1, 4, 3, 2, 2, 2, 3};
  p.options.scale = 1.3f;
  p.options.softcap = 1.5f;
  p.bias_dims = BroadcastDims{1, 1, 4, 3};
  p.bias.resize(12);
  CheckFiniteDifferences(p, 2);
}

}  // namespace
}  // namespace maxattn::testing
