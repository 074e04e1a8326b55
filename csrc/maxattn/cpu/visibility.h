// Masking helpers: which (i, j) of one (b, n) are visible (see attention.h),
// at three granularities: a whole tile (to skip work), a row interval (the
// geometric part: padding, causal, window) and single elements (segment ids,
// dense mask).
#ifndef MAXATTN_CPU_VISIBILITY_H_
#define MAXATTN_CPU_VISIBILITY_H_

#include <algorithm>
#include <cstdint>

#include "maxattn/attention.h"

namespace maxattn::cpu {

// Strides of a broadcastable [b', n', t', s'] operand; 0 along broadcast dims.
struct BroadcastStrides {
  int64_t b = 0, n = 0, t = 0, s = 0;
  BroadcastStrides() = default;
  BroadcastStrides(const BroadcastDims& d, const AttentionShape& shape);
  int64_t Offset(int64_t bi, int64_t ni, int64_t ti, int64_t si) const {
    return bi * b + ni * n + ti * t + si * s;
  }
};

enum class TileClass { kInvisible, kFull, kPartial };

// Visibility for one batch row b (all heads): geometry plus per-element data.
class RowVisibility {
 public:
  RowVisibility(const AttentionShape& shape, const AttentionOptions& options,
                const AttentionInputs& inputs, int64_t b);

  int64_t q_valid() const { return q_valid_; }
  int64_t kv_valid() const { return kv_valid_; }

  // Half-open interval [lo, hi) of j allowed by padding/causal/window for row
  // i (empty when lo >= hi). Rows beyond q_valid get an empty interval.
  void RowRange(int64_t i, int64_t* lo, int64_t* hi) const {
    if (i >= q_valid_) {
      *lo = *hi = 0;
      return;
    }
    int64_t l = 0, h = kv_valid_;
    const int64_t diag = i + offset_;
    if (causal_) h = std::min(h, diag + 1);
    if (window_left_ >= 0) l = std::max(l, diag - window_left_);
    if (window_right_ >= 0) h = std::min(h, diag + window_right_ + 1);
    *lo = l;
    *hi = h;
  }

  // Union of RowRange over rows [i0, i1): the kv range that tiles of these rows touch.
  void RowsRange(int64_t i0, int64_t i1, int64_t* lo, int64_t* hi) const;

  // Classifies the tile rows [i0, i1) x cols [j0, j1) for head n.
  TileClass Classify(int64_t i0, int64_t i1, int64_t j0, int64_t j1) const;

  // Whether element checks beyond RowRange are needed (segment ids / mask).
  bool HasElementMask() const { return qseg_ != nullptr || mask_ != nullptr; }

  // Per-element part of the predicate (call only inside RowRange).
  bool ElementVisible(int64_t n, int64_t i, int64_t j) const {
    if (qseg_ != nullptr) {
      const int32_t sq = qseg_[i];
      if (sq == 0 || sq != kvseg_[j]) return false;
    }
    if (mask_ != nullptr && !mask_[mask_strides_.Offset(0, n, i, j)]) return false;
    return true;
  }

  // vis[jj] = visible(n, i, j0 + jj) for jj in [0, cols).
  void RowMask(int64_t n, int64_t i, int64_t j0, int64_t cols, bool* vis) const;

 private:
  int64_t q_valid_ = 0, kv_valid_ = 0, offset_ = 0;
  bool causal_ = false;
  int64_t window_left_ = -1, window_right_ = -1;
  const int32_t* qseg_ = nullptr;   // row b of q_segment_ids, or null
  const int32_t* kvseg_ = nullptr;  // row b of kv_segment_ids
  const bool* mask_ = nullptr;      // mask at batch b (n/t/s strides below)
  BroadcastStrides mask_strides_;
};

}  // namespace maxattn::cpu

#endif  // MAXATTN_CPU_VISIBILITY_H_
