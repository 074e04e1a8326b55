// maxattn sm90: the backward's deterministic mode -- dQ tiles added in a fixed
// order (BwdArgs::dq_turns set).
//
// dQ of one (batch, query head, query block) is the sum of one tile from each
// CTA whose key block that query block sees, added into the fp32 accumulator by
// atomics. Float addition does not associate, so by default the last bits of
// dQ depend on the order in which the CTAs get there. In this mode the adds of
// a query block follow one order: CTAs in launch order (blockIdx.x within the
// (KV head, batch) row; the key blocks are launched last first, see
// tile_scheduler.h), and within a CTA consumer warpgroup 0, then 1. Each
// (b, head, query block) has a counter in global memory, zeroed on the stream;
// the warpgroup's dQ writer warp (bwd_dq_writer.h), before it issues its
// reduction, waits until the counter equals that turn, runs the reduction to
// completion, fences, and increments the counter (release).
//
// A warpgroup's turn for query block m is kConsumerWarpgroups * (the number of
// CTAs launched before its CTA whose walk includes m) + its index. Walks are
// QueryBlockRange's, so each CTA counts them from the same function: at its
// start, the consumers (Count) evaluate it for every earlier key block of the row and
// mark the part inside their own walk in a difference array in shared memory,
// which a prefix sum turns into the count per query block. The turns are then
// exactly the adds that will happen, in every mask case.
//
// The head-dim-256 kernel has no shared memory for that table: each consumer
// warpgroup counts the turn of the step's query block itself
// (EarlierWalksThrough, a strided share per thread of the earlier key blocks,
// summed over the warpgroup), while the step's first GEMMs run.
//
// A CTA only ever waits for CTAs launched before its own, and the
// hardware dispatches a grid's blocks in order, so those are resident or done:
// the waits cannot deadlock.
#ifndef MAXATTN_SM90_BWD_DQ_ORDER_H_
#define MAXATTN_SM90_BWD_DQ_ORDER_H_

#include <cuda_runtime.h>

#include "maxattn/sm90/barrier.h"
#include "maxattn/sm90/bwd_config.h"
#include "maxattn/sm90/mask.h"
#include "maxattn/sm90/tile_scheduler.h"

namespace maxattn::sm90 {

// Calls walk(lo, hi) with the query-block walk [lo, hi) of each CTA launched
// before the x-th of the tile's row, taking every `threads`-th from `tid`
// (key blocks launched last first: BwdStaticScheduler). `row`:
// BlockMask::MakeRow of the tile's batch row. The one definition of which
// earlier CTAs add to a query block, for both ways of counting turns below.
template <class Config, class Walk>
__device__ __forceinline__ void ForEachEarlierWalk(const BwdArgs& a, const BlockMask& row, int x, int tid,
                                                   int threads, const Walk& walk) {
  for (int earlier = tid; earlier < x; earlier += threads) {
    const int n_block = BwdStaticScheduler::KeyBlock(a, earlier, true);
    int lo = 0, hi = 0;
    row.template QueryBlockRange<Config::kBlockM, Config::kBlockN>(a, n_block * Config::kBlockN, &lo, &hi);
    walk(lo, hi);
  }
}

template <class Config>
class DqOrder {
 public:
  // Inactive: adds run at once.
  DqOrder() = default;

  // Counts the turns of a CTA whose walk is [m_lo, m_hi) (non-empty), launched
  // x-th in its row, into table (m_hi - m_lo + 1 ints of shared memory). Run by
  // all consumer threads, before their first dQ hand-over to the writer warps
  // (which reads the table through View).
  __device__ static void Count(const BwdArgs& a, const BwdTile& tile, int x, int m_lo, int m_hi, int* table,
                               int consumer_tid) {
    constexpr int kThreads = Config::kConsumerThreads;
    const int len = m_hi - m_lo;
    for (int i = consumer_tid; i <= len; i += kThreads) table[i] = 0;
    NamedBarrierSync(kBwdBarrierDs, kThreads);
    ForEachEarlierWalk<Config>(a, BlockMask::MakeRow(a, tile.batch), x, consumer_tid, kThreads, [&](int lo, int hi) {
      lo = max(lo, m_lo);
      hi = min(hi, m_hi);
      if (lo < hi) {
        atomicAdd(&table[lo - m_lo], 1);
        atomicAdd(&table[hi - m_lo], -1);
      }
    });
    NamedBarrierSync(kBwdBarrierDs, kThreads);
    if (consumer_tid == 0) {
      int run = 0;
      for (int i = 0; i < len; ++i) {
        run += table[i];
        table[i] = run;
      }
    }
    NamedBarrierSync(kBwdBarrierDs, kThreads);
  }

  // The turns Count wrote for the walk starting at m_lo.
  __device__ static DqOrder View(const int* table, int m_lo) {
    DqOrder order;
    order.table_ = table;
    order.m_lo_ = m_lo;
    return order;
  }

  __device__ bool active() const { return table_ != nullptr; }

  // Runs add() -- warpgroup wg's reduction of its dQ slice into query block m,
  // issued and completed by the calling thread -- in its turn on `counter`
  // (the (b, head, m) counter). One thread of the warpgroup calls it.
  template <class Add>
  __device__ void InTurn(int* counter, int m, int wg, const Add& add) const {
    const int turn = table_[m - m_lo_] * Config::kConsumerWarpgroups + wg;
    WaitForCount(counter, turn);
    asm volatile("fence.proxy.async.global;" ::: "memory");  // the earlier adds, seen by the bulk unit
    add();
    asm volatile("fence.proxy.async.global;" ::: "memory");  // this reduction's writes before the release
    __threadfence();
    ReleaseCount(counter);
  }

 private:
  const int* table_ = nullptr;  // per query block of the walk: earlier CTAs that add to it
  int m_lo_ = 0;
};

// This thread's share of a turn without the table: how many of the CTAs
// launched before the x-th of its row, taking every `threads`-th from `tid`,
// walk query block m. `row`: BlockMask::MakeRow of the tile's batch row.
template <class Config>
__device__ int EarlierWalksThrough(const BwdArgs& a, const BlockMask& row, int x, int m, int tid, int threads) {
  int count = 0;
  ForEachEarlierWalk<Config>(a, row, x, tid, threads, [&](int lo, int hi) { count += lo <= m && m < hi; });
  return count;
}

// The turn counter of (batch, query head, query block m) in BwdArgs::dq_turns
// ([B, N, num_m_blocks, BwdTurnCounters(H)]), its `slot`-th of `counters`.
__device__ __forceinline__ int* TurnCounter(const BwdArgs& a, int batch, int head, int m, int counters, int slot) {
  return a.dq_turns + ((static_cast<int64_t>(batch) * a.heads + head) * a.num_m_blocks + m) * counters + slot;
}

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_BWD_DQ_ORDER_H_
