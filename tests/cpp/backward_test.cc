// Backward-specific checks; most backward coverage runs through
// RunAndCompare in forward_test.cc.
#include <gtest/gtest.h>

#include "test_util.h"

namespace maxattn::testing {
namespace {

TEST(CpuAttentionBackward, WithoutDlse) {
  Case c;
  c.Sizes(2, 70, 90, 4, 2, 32, 24);
  c.seed = 300;
  c.options.scale = 0.2f;
  c.options.causal = true;
  c.dlse = false;
  c.bias_dims = BroadcastDims{1, 1, 70, 90};
  RunAndCompare(c);
}

TEST(CpuAttentionBackward, SoftcapSegmentsWindow) {
  Case c;
  c.Sizes(2, 110, 100, 2, 1, 16, 16);
  c.seed = 301;
  c.options.scale = 0.7f;
  c.options.softcap = 2.0f;
  c.options.window_left = 20;
  c.options.window_right = 10;
  c.segments = true;
  c.bias_dims = BroadcastDims{2, 2, 110, 100};
  RunAndCompare(c);
}

TEST(CpuAttentionBackward, NoDbiasRequested) {
  Case c;
  c.Sizes(1, 30, 30, 2, 2, 8, 8);
  c.seed = 302;
  c.bias_dims = BroadcastDims{1, 2, 30, 30};
  Problem p(c);
  ASSERT_TRUE(p.Forward().ok());
  std::mt19937 rng(3);
  p.dbias.clear();
  BackwardInputs saved{p.out.data(), p.out.data(), p.lse.data(), nullptr};
  Tensor dq(c.dtype, 30 * 2 * 8), dk(c.dtype, 30 * 2 * 8), dv(c.dtype, 30 * 2 * 8);
  EXPECT_TRUE(
      AttentionBackwardCpu(p.shape, c.options, p.inputs, saved, {dq.data(), dk.data(), dv.data(), nullptr})
          .ok());
}

TEST(CpuAttentionBackward, MissingSavedLseIsAnError) {
  Case c;
  Problem p(c);
  ASSERT_TRUE(p.Forward().ok());
  Tensor dq(c.dtype, 16 * 2 * 8), dk(c.dtype, 16 * 2 * 8), dv(c.dtype, 16 * 2 * 8);
  const Status st = AttentionBackwardCpu(p.shape, c.options, p.inputs,
                                         {p.out.data(), p.out.data(), nullptr, nullptr},
                                         {dq.data(), dk.data(), dv.data(), nullptr});
  EXPECT_EQ(st.code(), Status::Code::kInvalidArgument);
}

}  // namespace
}  // namespace maxattn::testing
