// maxattn sm90: visibility of (query i, key j) pairs, per tile and per element.
//
// Same rule as attention.h: with q_valid / kv_valid the padding lengths and
// d = 0 (top-left) or kv_valid - q_valid (bottom-right),
//   visible(i, j) = i < q_valid && j < kv_valid && (!causal || j <= i + d)
//                   && (wl < 0 || j >= i + d - wl) && (wr < 0 || j <= i + d + wr)
//                   && (no segment ids || (qseg[i] != 0 && qseg[i] == kvseg[j])).
// Segment ids narrow the key-block range through the pre-pass summaries and
// are compared element-wise only where a tile is not one id on both sides
// (segments.h). Rows i >= q_valid are not masked by Apply: the forward's epilogue writes them
// as fully masked (out 0, lse -inf) and leaves them out of max_logit. The backward masks them
// (ApplyTransposed), and its pre-pass gives them an lse of +inf as well.
//
// The forward walks the key blocks of one query block (KeyBlockRange, Apply on S with
// queries as rows); the backward walks the query blocks of one key block (QueryBlockRange,
// ApplyTransposed on S^T with keys as rows). Both read the same fields, so the rule has
// one owner.
#ifndef MAXATTN_SM90_MASK_H_
#define MAXATTN_SM90_MASK_H_

#include <climits>

#include <cute/tensor.hpp>

#include "maxattn/sm90/kernel_config.h"

namespace maxattn::sm90 {

__host__ __device__ __forceinline__ int FloorDiv(int a, int b) {  // b > 0
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

struct BlockMask {
  int q_valid = 0;
  int kv_valid = 0;
  int diag = 0;  // d
  bool causal = false;
  int window_left = -1;
  int window_right = -1;
  // With segment ids: the batch row and the query block's summary. The id
  // arrays are found from the kernel arguments when needed (constant bank),
  // which keeps three pointers out of the consumers' registers.
  bool segments = false;
  int batch = 0;
  QueryBlockKeys q_block{0, 0, 0, 0};

  // The mask of a query block (its segment summary included).
  __device__ static BlockMask Make(const ProblemArgs& args, int batch, int m_block) {
    return MakeRow(args, batch).ForQueryBlock(args, m_block);
  }

  // This row's mask for one of its query blocks.
  __device__ BlockMask ForQueryBlock(const ProblemArgs& args, int m_block) const {
    BlockMask m = *this;
    if (m.segments) m.q_block = args.query_blocks[static_cast<int64_t>(batch) * args.num_m_blocks + m_block];
    return m;
  }

  // The mask of a batch row, without a query block's summary.
  __device__ static BlockMask MakeRow(const ProblemArgs& args, int batch) {
    BlockMask m;
    m.batch = batch;
    m.segments = args.q_segment_ids != nullptr;
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
    int n_lo = FloorDiv(j_lo, kBlockN), n_hi = FloorDiv(j_hi, kBlockN) + 1;
    if (segments) {
      n_lo = max(n_lo, q_block.n_lo);
      n_hi = min(n_hi, q_block.n_hi);
      if (n_hi <= n_lo) return;
    }
    *lo = n_lo;
    *hi = n_hi;
  }

  // Query blocks [lo, hi) with a valid row that sees some key of the key block
  // starting at n0 (the dual of KeyBlockRange). Empty when nothing does.
  template <int kBlockM, int kBlockN>
  __device__ void QueryBlockRange(const ProblemArgs& args, int n0, int* lo, int* hi) const {
    *lo = 0;
    *hi = 0;
    if (n0 >= kv_valid || q_valid <= 0) return;
    const int j_max = min(n0 + kBlockN, kv_valid) - 1;
    int i_lo = 0;                       // first row that sees a key of the block
    if (causal) i_lo = max(i_lo, n0 - diag);
    if (window_right >= 0) i_lo = max(i_lo, n0 - diag - window_right);
    int i_hi = q_valid - 1;             // last one
    if (window_left >= 0) i_hi = min(i_hi, j_max - diag + window_left);
    if (i_hi < i_lo) return;
    int m_lo = i_lo / kBlockM, m_hi = i_hi / kBlockM + 1;
    if (segments) {
      const KeyBlockQueries k = args.key_block_queries[static_cast<int64_t>(batch) * args.num_n_blocks + n0 / kBlockN];
      m_lo = max(m_lo, k.m_lo);
      m_hi = min(m_hi, k.m_hi);
      if (m_hi <= m_lo) return;
    }
    *lo = m_lo;
    *hi = m_hi;
  }

  // True when some entry of the (m0, n0) tile must be masked element-wise.
  template <int kBlockM, int kBlockN>
  __host__ __device__ bool TileNeedsMask(const ProblemArgs& args, int m0, int n0) const {
    const int i_max = m0 + kBlockM - 1;
    const int j_max = n0 + kBlockN - 1;
    bool need = j_max >= kv_valid;
    if (causal) need |= j_max > m0 + diag;
    if (window_left >= 0) need |= n0 < i_max + diag - window_left;
    if (window_right >= 0) need |= j_max > m0 + diag + window_right;
    return need || SegmentsNeedMask<kBlockN>(args, n0 / kBlockN);
  }

  // TileNeedsMask's tests but segment ids', solved for the key block once per query block: the
  // key blocks [lo, hi) of the query block at m0 are masked by nothing else, so the forward's
  // walk decides a block by two compares (sm90_layout_check compares the two forms).
  template <int kBlockM, int kBlockN>
  __host__ __device__ void UnmaskedKeyBlocks(int m0, int* lo, int* hi) const {
    int j_last = kv_valid - 1;  // the last key that no rule hides from a row of the block
    if (causal) j_last = j_last < m0 + diag ? j_last : m0 + diag;
    if (window_right >= 0) j_last = j_last < m0 + diag + window_right ? j_last : m0 + diag + window_right;
    *hi = FloorDiv(j_last + 1, kBlockN);  // (nb + 1) * kBlockN - 1 <= j_last
    *lo = 0;
    if (window_left >= 0) {
      const int j_first = m0 + kBlockM - 1 + diag - window_left;  // the first key every row sees
      if (j_first > 0) *lo = (j_first + kBlockN - 1) / kBlockN;  // nb * kBlockN >= j_first
    }
  }

  // With segment ids: whether key block n_block of the row is not one id on both sides (the
  // pre-pass summaries, segments.h). False without them.
  template <int kBlockN>
  __host__ __device__ bool SegmentsNeedMask(const ProblemArgs& args, int n_block) const {
    if (!segments) return false;
    const int key_uniform = args.key_blocks[static_cast<int64_t>(batch) * args.num_n_blocks + n_block].uniform;
    return q_block.uniform == 0 || key_uniform != q_block.uniform;
  }

  // Sets invisible entries of a (row, col) view of the S accumulator to -inf.
  // coords holds the (row, col) of each element inside the tile; a column's
  // position is the same in every row of the view.
  template <int kBlockN, class TensorS, class TensorC>
  __device__ void Apply(const ProblemArgs& args, TensorS& s, const TensorC& coords, int m0, int n0) const {
    using namespace cute;
    constexpr int kRows = decltype(size<0>(s))::value;
    int j_lo[kRows], j_hi[kRows], id[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int i = m0 + get<0>(coords(r, 0));
      j_hi[r] = kv_valid - 1;
      if (causal) j_hi[r] = min(j_hi[r], i + diag);
      if (window_right >= 0) j_hi[r] = min(j_hi[r], i + diag + window_right);
      j_lo[r] = window_left >= 0 ? i + diag - window_left : 0;
      if (segments) {  // a padding row (id 0) sees nothing
        id[r] = i < q_valid ? __ldg(args.q_segment_ids + static_cast<int64_t>(batch) * args.q_len + i) : 0;
        if (id[r] == 0) j_hi[r] = -1;
      }
    }
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s); ++c) {
      const int j = n0 + get<1>(coords(0, c));
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        if (j > j_hi[r] || j < j_lo[r]) s(r, c) = -INFINITY;
      }
    }
    if (segments) {
      // The key block as runs of equal ids (segments.h: run_end), walked in
      // order; each run whose id is not the row's is masked like a window.
      // The walk is the same for every thread (no divergence) and keeps the
      // ids out of registers: two uniform loads per run.
      const int64_t row = static_cast<int64_t>(batch) * args.kv_len;
      const int end = min(n0 + kBlockN, kv_valid);
      for (int run = n0; run < end;) {
        const int run_id = __ldg(args.kv_segment_ids + row + run);
        const int run_next = __ldg(args.kv_run_end + row + run);
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          if (run_id == id[r]) continue;
          CUTE_UNROLL
          for (int c = 0; c < size<1>(s); ++c) {
            const int j = n0 + get<1>(coords(0, c));
            if (j >= run && j < run_next) s(r, c) = -INFINITY;
          }
        }
        run = run_next;
      }
    }
  }

  // Apply for S^T: a (row, col) view whose rows are keys and columns queries
  // (the backward's tile), coords holding each element's (key, query) in the
  // tile. The same rule from the key's side: row j sees the queries
  // [i_lo(j), i_hi(j)] (causal: i >= j - d; window: j - d - wr <= i <=
  // j - d + wl), none when j >= kv_valid, and no query i >= q_valid (unlike
  // Apply: the backward has no epilogue that drops those rows); with segment
  // ids the query's id must be the key's, and not 0. The ids of a key are
  // loaded once per row, those of a query once per column (only tiles on a
  // segment boundary get here). Hidden entries become `hidden`: -inf for raw
  // scores, 0 for probabilities (the backward without a soft cap masks P).
  // The tile is kBlockN keys from n0 by kBlockM queries from m0: when it lies
  // inside both valid lengths and no left window or segment ids apply, only the
  // lower bound can hide (the causal diagonal, a right window), one compare per
  // element instead of two.
  template <int kBlockM, int kBlockN, class TensorS, class TensorC>
  __device__ void ApplyTransposed(const ProblemArgs& args, TensorS& s, const TensorC& coords, int m0, int n0,
                                  float hidden) const {
    using namespace cute;
    constexpr int kRows = decltype(size<0>(s))::value;
    int i_lo[kRows], i_hi[kRows], id[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int j = n0 + get<0>(coords(r, 0));
      i_lo[r] = causal ? j - diag : INT_MIN;
      if (window_right >= 0) i_lo[r] = max(i_lo[r], j - diag - window_right);
      i_hi[r] = window_left >= 0 ? min(j - diag + window_left, q_valid - 1) : q_valid - 1;
      if (j >= kv_valid) i_hi[r] = INT_MIN;
      if (segments) {
        id[r] = j < kv_valid ? __ldg(args.kv_segment_ids + static_cast<int64_t>(batch) * args.kv_len + j) : 0;
      }
    }
    // One loop per case, so that the common one (no segment ids) runs as compares and selects
    // without a per-column test of `segments` and its loads.
    auto apply = [&](auto with_segments, auto with_upper) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        const int i = m0 + get<1>(coords(0, c));
        int q_id = 0;
        if constexpr (decltype(with_segments)::value) {
          q_id = i < q_valid ? __ldg(args.q_segment_ids + static_cast<int64_t>(batch) * args.q_len + i) : 0;
        }
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          bool hide = i < i_lo[r];
          if constexpr (decltype(with_upper)::value) hide |= i > i_hi[r];
          if constexpr (decltype(with_segments)::value) hide |= (q_id == 0) | (q_id != id[r]);
          s(r, c) = hide ? hidden : s(r, c);
        }
      }
    };
    if (segments) apply(cute::true_type{}, cute::true_type{});
    else if (window_left >= 0 || m0 + kBlockM > q_valid || n0 + kBlockN > kv_valid)
      apply(cute::false_type{}, cute::true_type{});
    else apply(cute::false_type{}, cute::false_type{});
  }
};

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_MASK_H_
