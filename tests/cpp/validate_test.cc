#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "maxattn/attention.h"

namespace maxattn {
namespace {

AttentionShape Good() { return AttentionShape{2, 8, 8, 6, 2, 16, 16}; }

void ExpectInvalid(const Status& st, const std::string& needle) {
  EXPECT_EQ(st.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
}

TEST(Validate, AcceptsGood) {
  EXPECT_TRUE(ValidateShapeAndOptions(Good(), {}, {}).ok());
  EXPECT_TRUE(ValidateShapeAndOptions(AttentionShape{0, 0, 0, 0, 0, 0, 0}, {}, {}).ok());
}

TEST(Validate, NegativeSizes) {
  AttentionShape s = Good();
  s.q_len = -1;
  ExpectInvalid(ValidateShapeAndOptions(s, {}, {}), "q_len (-1) must be >= 0");
  s = Good();
  s.head_dim_v = -3;
  ExpectInvalid(ValidateShapeAndOptions(s, {}, {}), "head_dim_v (-3)");
}

TEST(Validate, HeadGrouping) {
  AttentionShape s = Good();
  s.num_kv_heads = 4;
  ExpectInvalid(ValidateShapeAndOptions(s, {}, {}),
                "num_q_heads (6) must be a multiple of num_kv_heads (4)");
  s.num_kv_heads = 0;
  ExpectInvalid(ValidateShapeAndOptions(s, {}, {}), "num_kv_heads (0) must be >= 1");
}

TEST(Validate, BroadcastDims) {
  float bias = 0;
  bool mask = true;
  AttentionInputs in;
  in.bias = &bias;
  in.bias_dims = BroadcastDims{2, 3, 8, 8};
  ExpectInvalid(ValidateShapeAndOptions(Good(), {}, in), "bias_dims.n (3) must be 1 or num_q_heads (6)");
  in.bias_dims = BroadcastDims{1, 6, 1, 8};
  EXPECT_TRUE(ValidateShapeAndOptions(Good(), {}, in).ok());
  in.mask = &mask;
  in.mask_dims = BroadcastDims{1, 1, 1, 7};
  ExpectInvalid(ValidateShapeAndOptions(Good(), {}, in), "mask_dims.s (7) must be 1 or kv_len (8)");
}

TEST(Validate, Options) {
  AttentionOptions o;
  o.window_left = -2;
  ExpectInvalid(ValidateShapeAndOptions(Good(), o, {}), "window_left (-2)");
  o = {};
  o.window_right = -7;
  ExpectInvalid(ValidateShapeAndOptions(Good(), o, {}), "window_right (-7)");
  o = {};
  o.softcap = std::numeric_limits<float>::infinity();
  ExpectInvalid(ValidateShapeAndOptions(Good(), o, {}), "softcap");
  o.softcap = std::numeric_limits<float>::quiet_NaN();
  ExpectInvalid(ValidateShapeAndOptions(Good(), o, {}), "softcap");
  o = {};
  o.alignment = static_cast<CausalAlignment>(5);
  ExpectInvalid(ValidateShapeAndOptions(Good(), o, {}), "alignment (5)");
  AttentionInputs in;
  in.dtype = static_cast<DType>(9);
  ExpectInvalid(ValidateShapeAndOptions(Good(), {}, in), "dtype (9)");
  int32_t seg = 1;
  in = {};
  in.q_segment_ids = &seg;
  ExpectInvalid(ValidateShapeAndOptions(Good(), {}, in), "kv_segment_ids");
}

TEST(Validate, BackendsReturnTheStatus) {
  AttentionShape s = Good();
  s.num_kv_heads = 4;
  EXPECT_EQ(AttentionForwardCpu(s, {}, {}, {}).code(), Status::Code::kInvalidArgument);
  EXPECT_EQ(AttentionBackwardCpu(s, {}, {}, {}, {}).code(), Status::Code::kInvalidArgument);
}

}  // namespace
}  // namespace maxattn
