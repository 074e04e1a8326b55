#include "maxattn/cudnn/ragged.h"

#include <algorithm>

#include <cub/block/block_scan.cuh>

namespace maxattn::cudnn {
namespace {

// One block per batch row: as many threads as a block has, since B blocks may be all the grid.
constexpr int kThreads = 1024;
// Rows are walked in tiles of kThreads * kTokensPerThread tokens: each thread
// loads its kTokensPerThread consecutive query and key ids of the tile at
// once (independent loads: the memory latency is paid once per tile).
constexpr int kTokensPerThread = 8;
constexpr int32_t kTile = kThreads * kTokensPerThread;

int64_t Round(int64_t bytes) { return (bytes + 255) / 256 * 256; }

// The runs of one row, in order of appearance (shared memory, max_segments each).
struct Runs {
  int32_t* start;
  int32_t* end;
  int32_t* id;
};

__device__ __forceinline__ int32_t Clamp(int32_t x, int32_t lo, int32_t hi) { return x < lo ? lo : x > hi ? hi : x; }

// The id of token t (0 = padding, also for t < 0 and t >= valid).
__device__ __forceinline__ int32_t IdAt(const int32_t* ids, int64_t t, int32_t valid) {
  return t >= 0 && t < valid ? ids[t] : 0;
}

// One row of ids as the block walks it: ids[t] for t < valid, 0 past it; len tokens.
struct IdRow {
  const int32_t* ids;
  int32_t len;
  int32_t valid;
};

// This thread's tokens [t0, t0 + kTokensPerThread) of one tile of a row
// (ids past the row are 0), and the id of token t0 - 1.
struct ThreadIds {
  int32_t t0;
  int32_t before;
  int32_t id[kTokensPerThread];
};

__device__ __forceinline__ ThreadIds LoadThreadIds(const IdRow& row, int32_t tile) {
  ThreadIds x;
  x.t0 = tile + static_cast<int32_t>(threadIdx.x) * kTokensPerThread;
  x.before = IdAt(row.ids, x.t0 - 1, row.valid);
#pragma unroll
  for (int k = 0; k < kTokensPerThread; ++k) x.id[k] = IdAt(row.ids, static_cast<int64_t>(x.t0) + k, row.valid);
  return x;
}

// Calls f(t, id) for each token t < row.len this thread holds, tile by tile.
template <class F>
__device__ __forceinline__ void ForEachToken(const IdRow& row, F&& f) {
  for (int32_t tile = 0; tile < row.len; tile += kTile) {
    const ThreadIds x = LoadThreadIds(row, tile);
#pragma unroll
    for (int k = 0; k < kTokensPerThread; ++k) {
      if (x.t0 + k >= row.len) break;
      f(x.t0 + k, x.id[k]);
    }
  }
}

__device__ __forceinline__ int32_t CountStarts(const ThreadIds& x) {
  int32_t starts = 0, prev = x.before;
#pragma unroll
  for (int k = 0; k < kTokensPerThread; ++k) {
    starts += x.id[k] != 0 && x.id[k] != prev;
    prev = x.id[k];
  }
  return starts;
}

// Records the runs of this thread's tokens whose index (r0 + 1 for the first
// run starting here) is below max_runs.
__device__ __forceinline__ void RecordRuns(const ThreadIds& x, int32_t len, int32_t r0, int32_t max_runs, Runs runs) {
  int32_t r = r0 - 1;  // the run that token t0 - 1 belongs to (if any)
  int32_t prev = x.before;
#pragma unroll
  for (int k = 0; k < kTokensPerThread; ++k) {
    const int32_t t = x.t0 + k, cur = x.id[k];
    if (t < len && cur != prev) {
      if (prev != 0 && r >= 0 && r < max_runs) runs.end[r] = t;
      if (cur != 0) {
        ++r;
        if (r < max_runs) {
          runs.start[r] = t;
          runs.id[r] = cur;
        }
      }
    }
    prev = cur;
  }
}

// Finds the runs of equal non-zero ids of the query row and the key row
// together (the first max_runs of each recorded in q_runs / kv_runs) and
// returns their counts. Per tile, one block scan over the threads' counts of
// run starts (query count in the low 16 bits, key count in the high: a tile
// has fewer than 2^16 tokens) gives each thread the index of its first run.
__device__ int2 FindRuns(const IdRow& q, const IdRow& kv, int32_t max_runs, Runs q_runs, Runs kv_runs) {
  using Scan = cub::BlockScan<int32_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  static_assert(kTile < (1 << 15), "two 16-bit counts per scanned int");
  int2 carry{0, 0};  // runs that start in earlier tiles
  const int32_t len = q.len > kv.len ? q.len : kv.len;
  for (int32_t tile = 0; tile < len; tile += kTile) {
    const ThreadIds xq = LoadThreadIds(q, tile);
    const ThreadIds xk = LoadThreadIds(kv, tile);
    int32_t first = 0, tile_runs = 0;
    Scan(scan_storage).ExclusiveSum(CountStarts(xq) | (CountStarts(xk) << 16), first, tile_runs);
    RecordRuns(xq, q.len, carry.x + (first & 0xffff), max_runs, q_runs);
    RecordRuns(xk, kv.len, carry.y + (first >> 16), max_runs, kv_runs);
    carry.x += tile_runs & 0xffff;
    carry.y += tile_runs >> 16;
    __syncthreads();  // scan_storage is reused by the next tile
  }
  // A row's last run, if it reaches the row's end, ends there.
  if (threadIdx.x == 0 && carry.x > 0 && carry.x <= max_runs && IdAt(q.ids, int64_t{q.len} - 1, q.valid) != 0) {
    q_runs.end[carry.x - 1] = q.len;
  }
  if (threadIdx.x == 1 && carry.y > 0 && carry.y <= max_runs && IdAt(kv.ids, int64_t{kv.len} - 1, kv.valid) != 0) {
    kv_runs.end[carry.y - 1] = kv.len;
  }
  __syncthreads();
  return carry;
}

template <typename Offset>
__device__ __forceinline__ void Put(void* array, int64_t i, int64_t value) {
  static_cast<Offset*>(array)[i] = static_cast<Offset>(value);
}

template <typename Offset>
__global__ void __launch_bounds__(kThreads) RaggedLayoutKernel(RaggedProblem p, RaggedLayout out) {
  extern __shared__ int32_t shared[];
  const int32_t M = p.max_segments;
  const Runs q_runs{shared, shared + M, shared + 2 * M};
  const Runs kv_runs{shared + 3 * M, shared + 4 * M, shared + 5 * M};
  const int32_t b = blockIdx.x;
  const int32_t T = p.rows.q_len, S = p.rows.kv_len;
  const int32_t* q_ids = p.q_segment_ids + static_cast<int64_t>(b) * T;
  const int32_t* kv_ids = p.kv_segment_ids + static_cast<int64_t>(b) * S;
  const int32_t q_valid = p.rows.q_seq_lengths ? Clamp(p.rows.q_seq_lengths[b], 0, T) : T;
  const int32_t kv_valid = p.rows.kv_seq_lengths ? Clamp(p.rows.kv_seq_lengths[b], 0, S) : S;

  const IdRow q_row{q_ids, T, q_valid}, kv_row{kv_ids, S, kv_valid};
  const int2 counts = FindRuns(q_row, kv_row, M, q_runs, kv_runs);
  const int32_t nq = counts.x, nk = counts.y;
  const bool banded = p.rows.causal || p.rows.window_left >= 0 || p.rows.window_right >= 0;
  // The dense diagonal of the row: key j is on it for query i iff j == i + d.
  const int32_t d = p.rows.bottom_right ? kv_valid - q_valid : 0;
  // Does the row keep the layout promise? Every thread checks its share.
  const bool counts_fit = nq <= M && nk == nq;
  const int32_t n = counts_fit ? nq : 0;
  bool keeps = counts_fit;
  for (int32_t m = threadIdx.x; m < n; m += blockDim.x) {
    keeps &= q_runs.id[m] == kv_runs.id[m];
    keeps &= !banded || q_runs.start[m] + d == kv_runs.start[m];
  }
  // No id in two runs (the pairing above makes the key row's ids the same list).
  for (int64_t pair = threadIdx.x; pair < static_cast<int64_t>(n) * n; pair += blockDim.x) {
    const int32_t i = static_cast<int32_t>(pair / n), j = static_cast<int32_t>(pair % n);
    keeps &= !(i < j && q_runs.id[i] == q_runs.id[j]);
  }
  const bool ok = __syncthreads_and(keeps) != 0;
  const int32_t live = ok ? nq : 0;

  for (int32_t m = threadIdx.x; m < M; m += blockDim.x) {
    const int64_t seq = static_cast<int64_t>(b) * M + m;
    const bool running = m < live;
    const int32_t qs = running ? q_runs.start[m] : T, ks = running ? kv_runs.start[m] : S;
    out.seq_len_q[seq] = running ? q_runs.end[m] - qs : 0;
    out.seq_len_kv[seq] = running ? kv_runs.end[m] - ks : 0;
    const int64_t q_tok = static_cast<int64_t>(b) * T + qs, k_tok = static_cast<int64_t>(b) * S + ks;
    Put<Offset>(out.offset_q, seq, q_tok * p.q_token);
    Put<Offset>(out.offset_o, seq, q_tok * p.o_token);
    Put<Offset>(out.offset_k, seq, k_tok * p.k_token);
    Put<Offset>(out.offset_v, seq, k_tok * p.v_token);
    Put<Offset>(out.offset_stats, seq, q_tok * p.rows.heads);
  }
  if (b == p.rows.batch - 1 && threadIdx.x == 0) {
    const int64_t end = static_cast<int64_t>(p.rows.batch) * M;
    Put<Offset>(out.offset_q, end, static_cast<int64_t>(p.rows.batch) * T * p.q_token);
    Put<Offset>(out.offset_o, end, static_cast<int64_t>(p.rows.batch) * T * p.o_token);
    Put<Offset>(out.offset_k, end, static_cast<int64_t>(p.rows.batch) * S * p.k_token);
    Put<Offset>(out.offset_v, end, static_cast<int64_t>(p.rows.batch) * S * p.v_token);
    Put<Offset>(out.offset_stats, end, static_cast<int64_t>(p.rows.batch) * p.rows.heads * T);
  }

  // Query rows: does the query see a key of its own run (the band, relative to
  // the run's start, cut to the key run's length)?
  ForEachToken(q_row, [&](int32_t t, int32_t id) {
    uint8_t code = kRowPoisoned;
    if (ok) {
      code = kRowEmpty;
      if (id != 0) {
        int32_t lo_m = 0, hi_m = live - 1;  // the last run starting at or before t
        while (lo_m < hi_m) {
          const int32_t mid = (lo_m + hi_m + 1) / 2;
          if (q_runs.start[mid] <= t) lo_m = mid;
          else hi_m = mid - 1;
        }
        const int64_t i = t - q_runs.start[lo_m];
        int64_t lo = 0, hi = kv_runs.end[lo_m] - kv_runs.start[lo_m] - 1;
        if (p.rows.causal && i < hi) hi = i;
        if (p.rows.window_right >= 0 && i + p.rows.window_right < hi) hi = i + p.rows.window_right;
        if (p.rows.window_left >= 0 && i - p.rows.window_left > lo) lo = i - p.rows.window_left;
        code = lo <= hi ? kRowVisible : kRowEmpty;
      }
    }
    out.q_rows[static_cast<int64_t>(b) * T + t] = code;
  });
  ForEachToken(kv_row, [&](int32_t t, int32_t id) { out.kv_rows[static_cast<int64_t>(b) * S + t] = ok && id != 0; });
}

// Each warp takes 32 consecutive rows: one code per lane, a ballot of the
// rows to zero, then the whole warp zeroes each of them in turn (16-byte
// stores when the rows allow it). Most rows usually keep their values, so the
// cost is one coalesced read of the codes.
__global__ void ZeroRowsExceptKernel(uint16_t* data, int64_t rows, int64_t row_elems, const uint8_t* code,
                                     uint8_t keep, bool vectorized) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r0 = (blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32) * 32; r0 < rows;
       r0 += warps * 32) {
    const int64_t r = r0 + lane;
    unsigned zero = __ballot_sync(0xffffffffu, r < rows && code[r] != keep);
    while (zero != 0) {
      const int64_t row = r0 + __ffs(zero) - 1;
      zero &= zero - 1;
      uint16_t* p = data + row * row_elems;
      if (vectorized) {
        uint4* v = reinterpret_cast<uint4*>(p);
        for (int64_t e = lane; e < row_elems / 8; e += 32) v[e] = uint4{0, 0, 0, 0};
      } else {
        for (int64_t e = lane; e < row_elems; e += 32) p[e] = 0;
      }
    }
  }
}

}  // namespace

bool NeedsWideOffsets(const RaggedProblem& p) {
  const int64_t q_end = static_cast<int64_t>(p.rows.batch) * p.rows.q_len, k_end = static_cast<int64_t>(p.rows.batch) * p.rows.kv_len;
  const int64_t largest = std::max({q_end * p.q_token, q_end * p.o_token, k_end * p.k_token, k_end * p.v_token,
                                    q_end * p.rows.heads});
  return largest >= (int64_t{1} << 31);
}

int64_t RaggedLayoutBytes(const RaggedProblem& p) {
  const int64_t seqs = static_cast<int64_t>(p.rows.batch) * p.max_segments;
  const int64_t offset = p.wide_offsets ? 8 : 4;
  return 2 * Round(seqs * 4) + 5 * Round((seqs + 1) * offset) + Round(static_cast<int64_t>(p.rows.batch) * p.rows.q_len) +
         Round(static_cast<int64_t>(p.rows.batch) * p.rows.kv_len);
}

RaggedLayout CarveRaggedLayout(const RaggedProblem& p, void* scratch) {
  const int64_t seqs = static_cast<int64_t>(p.rows.batch) * p.max_segments;
  const int64_t offset = p.wide_offsets ? 8 : 4;
  char* at = static_cast<char*>(scratch);
  auto take = [&at](int64_t bytes) {
    void* x = at;
    at += Round(bytes);
    return x;
  };
  RaggedLayout l;
  l.seq_len_q = static_cast<int32_t*>(take(seqs * 4));
  l.seq_len_kv = static_cast<int32_t*>(take(seqs * 4));
  l.offset_q = take((seqs + 1) * offset);
  l.offset_k = take((seqs + 1) * offset);
  l.offset_v = take((seqs + 1) * offset);
  l.offset_o = take((seqs + 1) * offset);
  l.offset_stats = take((seqs + 1) * offset);
  l.q_rows = static_cast<uint8_t*>(take(static_cast<int64_t>(p.rows.batch) * p.rows.q_len));
  l.kv_rows = static_cast<uint8_t*>(take(static_cast<int64_t>(p.rows.batch) * p.rows.kv_len));
  return l;
}

cudaError_t LaunchRaggedLayout(const RaggedProblem& p, const RaggedLayout& layout, cudaStream_t stream) {
  if (p.rows.batch == 0) return cudaSuccess;
  if (p.max_segments <= 0) return cudaErrorInvalidValue;
  const size_t shared = static_cast<size_t>(6) * p.max_segments * sizeof(int32_t);
  if (p.wide_offsets) {
    RaggedLayoutKernel<int64_t><<<p.rows.batch, kThreads, shared, stream>>>(p, layout);
  } else {
    RaggedLayoutKernel<int32_t><<<p.rows.batch, kThreads, shared, stream>>>(p, layout);
  }
  return cudaGetLastError();
}

cudaError_t LaunchZeroRowsExcept(void* data, int64_t rows, int64_t row_elems, const uint8_t* code, uint8_t keep,
                                 cudaStream_t stream) {
  if (rows == 0 || row_elems == 0) return cudaSuccess;
  constexpr int kZeroThreads = 256;
  constexpr int64_t kRowsPerBlock = kZeroThreads;  // 32 rows per warp
  const int64_t blocks = std::min<int64_t>((rows + kRowsPerBlock - 1) / kRowsPerBlock, 4096);
  const bool vectorized = row_elems % 8 == 0 && reinterpret_cast<uintptr_t>(data) % 16 == 0;
  ZeroRowsExceptKernel<<<static_cast<unsigned>(blocks), kZeroThreads, 0, stream>>>(
      static_cast<uint16_t*>(data), rows, row_elems, code, keep, vectorized);
  return cudaGetLastError();
}

}  // namespace maxattn::cudnn
