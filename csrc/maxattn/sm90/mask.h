// maxattn sm90: visibility of (query i, key j) pairs, per tile and per element.
//
// Same rule as attention.h: with q_valid / kv_valid the padding lengths and
// d = 0 (top-left) or kv_valid - q_valid (bottom-right),
//   visible(i, j) = i < q_valid && j < kv_valid && (!causal || j <= i + d)
//                   && (wl < 0 || j >= i + d - wl) && (wr < 0 || j <= i + d + wr).
// Rows i >= q_valid are not masked here: the epilogue writes them as fully
// masked (out 0, lse -inf) and leaves them out of max_logit.
#ifndef MAXATTN_SM90_MASK_H_
#define MAXATTN_SM90_MASK_H_

#include <cute/tensor.hpp>

#include "maxattn/sm90/kernel_config.h"

namespace maxattn::sm90 {

__device__ __forceinline__ int FloorDiv(int a, int b) {  // b > 0
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

struct BlockMask {
  int q_valid = 0;
  int kv_valid = 0;
  int diag = 0;  // d
  bool causal = false;
  int window_left = -1;
  int window_right = -1;

  __device__ static BlockMask Make(const FwdArgs& args, int batch) {
    BlockMask m;
    m.q_valid = args.q_len;
    m.kv_valid = args.kv_len;
    if (args.q_lens != nullptr) m.q_valid = min(max(args.q_lens[batch], 0), args.q_len);
    if (args.kv_lens != nullptr) m.kv_valid = min(max(args.kv_lens[batch], 0), args.kv_len);
    m.diag = args.bottom_right ? m.kv_valid - m.q_valid : 0;
    m.causal = args.causal;
    m.window_left = args.window_left;
    m.window_right = args.window_right;
    return m;
  }

  // Key blocks [lo, hi) that hold a visible entry for some valid row of the
  // query block starting at m0. Empty (lo >= hi) when the block sees nothing.
  template <int kBlockM, int kBlockN>
  __device__ void KeyBlockRange(int m0, int* lo, int* hi) const {
    *lo = 0;
    *hi = 0;
    if (m0 >= q_valid || kv_valid <= 0) return;
    const int i_max = min(m0 + kBlockM, q_valid) - 1;
    int j_hi = kv_valid - 1;  // last visible key over the block's valid rows
    if (causal) j_hi = min(j_hi, i_max + diag);
    if (window_right >= 0) j_hi = min(j_hi, i_max + diag + window_right);
    int j_lo = 0;
    if (window_left >= 0) j_lo = max(j_lo, m0 + diag - window_left);
    if (j_hi < j_lo) return;
    *lo = FloorDiv(j_lo, kBlockN);
    *hi = FloorDiv(j_hi, kBlockN) + 1;
  }

  // True when some entry of the (m0, n0) tile must be masked element-wise.
  template <int kBlockM, int kBlockN>
  __device__ bool TileNeedsMask(int m0, int n0) const {
    const int i_max = m0 + kBlockM - 1;
    const int j_max = n0 + kBlockN - 1;
    bool need = j_max >= kv_valid;
    if (causal) need |= j_max > m0 + diag;
    if (window_left >= 0) need |= n0 < i_max + diag - window_left;
    if (window_right >= 0) need |= j_max > m0 + diag + window_right;
    return need;
  }

  // Sets invisible entries of a (row, col) view of the S accumulator to -inf.
  // coords holds the (row, col) of each element inside the tile.
  template <class TensorS, class TensorC>
  __device__ void Apply(TensorS& s, const TensorC& coords, int m0, int n0) const {
    using namespace cute;
    CUTE_UNROLL
    for (int r = 0; r < size<0>(s); ++r) {
      const int i = m0 + get<0>(coords(r, 0));
      int j_hi = kv_valid - 1;
      if (causal) j_hi = min(j_hi, i + diag);
      if (window_right >= 0) j_hi = min(j_hi, i + diag + window_right);
      const int j_lo = window_left >= 0 ? i + diag - window_left : 0;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        const int j = n0 + get<1>(coords(r, c));
        if (j > j_hi || j < j_lo) s(r, c) = -INFINITY;
      }
    }
  }
};

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_MASK_H_
