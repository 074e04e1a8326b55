#include "maxattn/cpu/visibility.h"

namespace maxattn::cpu {

BroadcastStrides::BroadcastStrides(const BroadcastDims& d, const AttentionShape& shape) {
  // Row-major over [d.b, d.n, d.t, d.s]; a size-1 dim gets stride 0 (it is
  // either broadcast or only ever indexed at 0).
  (void)shape;
  s = d.s == 1 ? 0 : 1;
  t = d.t == 1 ? 0 : d.s;
  n = d.n == 1 ? 0 : d.t * d.s;
  b = d.b == 1 ? 0 : d.n * d.t * d.s;
}

RowVisibility::RowVisibility(const AttentionShape& shape, const AttentionOptions& options,
                             const AttentionInputs& inputs, int64_t b) {
  q_valid_ = shape.q_len;
  kv_valid_ = shape.kv_len;
  if (inputs.q_seq_lengths != nullptr) {
    q_valid_ = std::clamp<int64_t>(inputs.q_seq_lengths[b], 0, shape.q_len);
  }
  if (inputs.kv_seq_lengths != nullptr) {
    kv_valid_ = std::clamp<int64_t>(inputs.kv_seq_lengths[b], 0, shape.kv_len);
  }
  offset_ = options.alignment == CausalAlignment::kBottomRight ? kv_valid_ - q_valid_ : 0;
  causal_ = options.causal;
  window_left_ = options.window_left;
  window_right_ = options.window_right;
  if (inputs.q_segment_ids != nullptr && inputs.kv_segment_ids != nullptr) {
    qseg_ = inputs.q_segment_ids + b * shape.q_len;
    kvseg_ = inputs.kv_segment_ids + b * shape.kv_len;
  }
  if (inputs.mask != nullptr) {
    mask_strides_ = BroadcastStrides(inputs.mask_dims, shape);
    mask_ = inputs.mask + mask_strides_.Offset(b, 0, 0, 0);
  }
}

void RowVisibility::RowsRange(int64_t i0, int64_t i1, int64_t* lo, int64_t* hi) const {
  i1 = std::min(i1, q_valid_);
  if (i0 >= i1) {
    *lo = *hi = 0;
    return;
  }
  // lo is non-decreasing and hi non-decreasing in i: take the first row's lo
  // and the last row's hi.
  int64_t l0, h0, l1, h1;
  RowRange(i0, &l0, &h0);
  RowRange(i1 - 1, &l1, &h1);
  *lo = l0;
  *hi = h1;
  if (*lo >= *hi) *lo = *hi = 0;
}

TileClass RowVisibility::Classify(int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
  if (i0 >= q_valid_ || j0 >= kv_valid_ || i0 >= i1 || j0 >= j1) return TileClass::kInvisible;
  int64_t lo_first, hi_first, lo_last, hi_last;
  const int64_t last = std::min(i1, q_valid_) - 1;
  RowRange(i0, &lo_first, &hi_first);
  RowRange(last, &lo_last, &hi_last);
  // Invisible when every row's range misses [j0, j1): ranges move right with i.
  if (hi_last <= j0 || lo_first >= j1) return TileClass::kInvisible;
  const bool all_rows = i1 <= q_valid_;
  const bool geometric_full = all_rows && lo_last <= j0 && hi_first >= j1;
  return (geometric_full && !HasElementMask()) ? TileClass::kFull : TileClass::kPartial;
}

void RowVisibility::RowMask(int64_t n, int64_t i, int64_t j0, int64_t cols, bool* vis) const {
  int64_t lo, hi;
  RowRange(i, &lo, &hi);
  for (int64_t jj = 0; jj < cols; ++jj) {
    const int64_t j = j0 + jj;
    vis[jj] = j >= lo && j < hi && (!HasElementMask() || ElementVisible(n, i, j));
  }
}

}  // namespace maxattn::cpu
