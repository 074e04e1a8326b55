// maxattn sm90: the segment-id pre-pass of segments.h. One warp per block of
// keys (summary and run ends), then one per block of queries, which scans the
// key summaries of its row: O(ceil(T / block_m) * ceil(S / block_n))
// comparisons per row; for the backward, one more per key block scanning the
// query summaries.
#include "maxattn/sm90/segments.h"

#include <climits>
#include <string>

namespace maxattn::sm90 {
namespace {

constexpr int kWarps = 8;  // blocks summarised per CTA
constexpr unsigned kFull = 0xffffffffu;

struct IdRange {
  int lo = INT_MAX;
  int hi = INT_MIN;
  int uniform = 0;
};

// The ids of rows [start, start + size) of one sequence (valid below `valid`),
// reduced over the warp: every lane returns the same summary.
__device__ IdRange SummarizeBlock(const int32_t* ids, int start, int size, int valid) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  int lo = INT_MAX, hi = INT_MIN;
  bool full = true;
  for (int i = start + lane; i < start + size; i += 32) {
    const int id = i < valid ? ids[i] : 0;
    if (id != 0) {
      lo = min(lo, id);
      hi = max(hi, id);
    } else {
      full = false;
    }
  }
  IdRange r;
  r.lo = __reduce_min_sync(kFull, lo);
  r.hi = __reduce_max_sync(kFull, hi);
  r.uniform = __all_sync(kFull, full) && r.lo == r.hi ? r.lo : 0;
  return r;
}

__device__ int Valid(const int32_t* lens, int b, int len) {
  return lens == nullptr ? len : min(max(lens[b], 0), len);
}

// run_end of the keys [start, start + size) below `valid`: one ballot word
// per 32 keys says where a run ends (the next key has another id, is the
// block's end or the valid length's); each key's run ends after the first
// such key at or after it.
__device__ void RunEnds(const int32_t* ids, int start, int size, int valid, int32_t* run_end) {
  constexpr int kMaxWords = 4;  // block_n <= 128
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int stop = min(start + size, valid);
  uint32_t ends[kMaxWords];
#pragma unroll
  for (int w = 0; w < kMaxWords; ++w) {
    const int k = start + w * 32 + lane;
    bool last = false;
    if (k < stop) last = k + 1 == stop || ids[k + 1] != ids[k];
    ends[w] = __ballot_sync(kFull, last);
  }
#pragma unroll
  for (int w = 0; w < kMaxWords; ++w) {
    const int k = start + w * 32 + lane;
    if (k >= stop) continue;
    int end = stop;  // unreachable fallback: the key at stop - 1 always ends a run
    bool found = false;
#pragma unroll
    for (int v = w; v < kMaxWords; ++v) {
      const uint32_t m = v == w ? ends[v] & (~0u << lane) : ends[v];
      if (!found && m != 0) {
        end = start + v * 32 + __ffs(static_cast<int>(m));  // one past the run's last key
        found = true;
      }
    }
    run_end[k] = end;
  }
}

__global__ void KeyBlocksKernel(SegmentSummaryArgs a, int num_n_blocks) {
  const int nb = static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x / 32);
  const int b = static_cast<int>(blockIdx.y);
  if (nb >= num_n_blocks) return;  // whole warps leave together
  const int64_t row = static_cast<int64_t>(b) * a.kv_len;
  const int valid = Valid(a.kv_lens, b, a.kv_len);
  const IdRange r = SummarizeBlock(a.kv_ids + row, nb * a.block_n, a.block_n, valid);
  RunEnds(a.kv_ids + row, nb * a.block_n, a.block_n, valid, a.kv_run_end + row);
  if (threadIdx.x % 32 == 0) a.key_blocks[static_cast<int64_t>(b) * num_n_blocks + nb] = {r.lo, r.hi, r.uniform, 0};
}

__global__ void QueryBlocksKernel(SegmentSummaryArgs a, int num_m_blocks, int num_n_blocks) {
  const int mb = static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x / 32);
  const int b = static_cast<int>(blockIdx.y);
  if (mb >= num_m_blocks) return;
  const IdRange q = SummarizeBlock(a.q_ids + static_cast<int64_t>(b) * a.q_len, mb * a.block_m, a.block_m,
                                   Valid(a.q_lens, b, a.q_len));
  const KeyBlockIds* keys = a.key_blocks + static_cast<int64_t>(b) * num_n_blocks;
  int first = INT_MAX, last = -1;
  if (q.lo <= q.hi) {
    for (int nb = static_cast<int>(threadIdx.x % 32); nb < num_n_blocks; nb += 32) {
      const KeyBlockIds k = keys[nb];
      if (k.lo <= q.hi && q.lo <= k.hi) {
        first = min(first, nb);
        last = max(last, nb);
      }
    }
  }
  first = __reduce_min_sync(kFull, first);
  last = __reduce_max_sync(kFull, last);
  if (threadIdx.x % 32 == 0) {
    const bool any = first <= last;
    a.query_blocks[static_cast<int64_t>(b) * num_m_blocks + mb] = {any ? first : 0, any ? last + 1 : 0, q.uniform,
                                                                   0};
  }
}

// For each key block, the hull of the query blocks whose key range holds it.
__global__ void KeyBlockQueriesKernel(SegmentSummaryArgs a, int num_m_blocks, int num_n_blocks) {
  const int nb = static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x / 32);
  const int b = static_cast<int>(blockIdx.y);
  if (nb >= num_n_blocks) return;
  const QueryBlockKeys* queries = a.query_blocks + static_cast<int64_t>(b) * num_m_blocks;
  int first = INT_MAX, last = -1;
  for (int mb = static_cast<int>(threadIdx.x % 32); mb < num_m_blocks; mb += 32) {
    const QueryBlockKeys q = queries[mb];
    if (q.n_lo <= nb && nb < q.n_hi) {
      first = min(first, mb);
      last = max(last, mb);
    }
  }
  first = __reduce_min_sync(kFull, first);
  last = __reduce_max_sync(kFull, last);
  if (threadIdx.x % 32 == 0) {
    const bool any = first <= last;
    a.key_block_queries[static_cast<int64_t>(b) * num_n_blocks + nb] = {any ? first : 0, any ? last + 1 : 0};
  }
}

Status Launched(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return Status::Ok();
  return Status::Internal(std::string("sm90 attention: ") + what + " launch: " + cudaGetErrorName(err) + " (" +
                          cudaGetErrorString(err) + ")");
}

}  // namespace

Status SummarizeSegments(const SegmentSummaryArgs& args, cudaStream_t stream) {
  if (args.block_n > 128 || args.block_m > 128) return Status::Internal("sm90 attention: segment blocks above 128");
  const int num_n_blocks = (args.kv_len + args.block_n - 1) / args.block_n;
  const int num_m_blocks = (args.q_len + args.block_m - 1) / args.block_m;
  const dim3 key_grid((num_n_blocks + kWarps - 1) / kWarps, args.batch);
  KeyBlocksKernel<<<key_grid, kWarps * 32, 0, stream>>>(args, num_n_blocks);
  MAXATTN_RETURN_IF_ERROR(Launched("segment key-block summary"));
  const dim3 query_grid((num_m_blocks + kWarps - 1) / kWarps, args.batch);
  QueryBlocksKernel<<<query_grid, kWarps * 32, 0, stream>>>(args, num_m_blocks, num_n_blocks);
  MAXATTN_RETURN_IF_ERROR(Launched("segment query-block summary"));
  if (args.key_block_queries == nullptr) return Status::Ok();
  KeyBlockQueriesKernel<<<key_grid, kWarps * 32, 0, stream>>>(args, num_m_blocks, num_n_blocks);
  return Launched("segment key-block queries");
}

}  // namespace maxattn::sm90
