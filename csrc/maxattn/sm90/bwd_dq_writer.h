// maxattn sm90: the backward's dQ writers, warps 1 and 2 of the producer
// warpgroup, one per consumer warpgroup. A writer walks the same steps as the
// consumers; per step it waits until its warpgroup has staged its dQ fragment
// (named barrier kBwdBarrierDqFull + wg), adds the slice into dq_accum with one
// bulk reduction (cp.reduce.async.bulk .add.f32, issued by lane 0), waits until
// the bulk unit has read the slice and hands it back (kBwdBarrierDqEmpty + wg).
// The consumers only arrive on the first barrier and meet the second one a
// whole step later, so neither the reduction's issue nor its read sits in
// their loop. In the deterministic mode the writer also waits for the
// reduction's turn (bwd_dq_order.h) -- a wait the consumers then see only if
// it outlasts their next step. One writer per warpgroup keeps the two
// warpgroups' turn chains independent, as when the consumers issued the
// reductions themselves: a single writer serving both in turn made the
// deterministic mode 23% slower at H = 64 (H100), whose short steps then waited
// for two reduction round trips each.
#ifndef MAXATTN_SM90_BWD_DQ_WRITER_H_
#define MAXATTN_SM90_BWD_DQ_WRITER_H_

#include "maxattn/sm90/barrier.h"
#include "maxattn/sm90/bwd_config.h"
#include "maxattn/sm90/bwd_dq_order.h"
#include "maxattn/sm90/bwd_epilogue.h"
#include "maxattn/sm90/tile_scheduler.h"

namespace maxattn::sm90 {

template <class Config>
struct BwdDqWriter {
  using SharedStorage = typename Config::SharedStorage;

  // Query blocks [m_lo, m_hi) of every head of the tile's group (non-empty), for
  // consumer warpgroup wg; order_table: the turns the consumers count
  // (deterministic mode only).
  __device__ static void Run(const BwdArgs& a, SharedStorage& smem, const BwdTile& tile, int m_lo, int m_hi,
                             const int* order_table, int wg, int lane) {
    constexpr int kBytes = Config::kDqSliceFloats * static_cast<int>(sizeof(float));
    const DqOrder<Config> order = a.dq_turns != nullptr ? DqOrder<Config>::View(order_table, m_lo) : DqOrder<Config>{};
    NamedBarrierArrive(kBwdBarrierDqEmpty + wg, kBwdDqHandoverThreads);  // the slice starts empty
    const int last_head = (tile.kv_head + 1) * a.group - 1;
    const float* slice = smem.dq[wg];
    for (int head = tile.kv_head * a.group; head <= last_head; ++head) {
      for (int m = m_lo; m < m_hi; ++m) {
        NamedBarrierSync(kBwdBarrierDqFull + wg, kBwdDqHandoverThreads);
        if (lane == 0) {
          float* dst = BwdEpilogue<Config>::GmemSlice(a, tile.batch, head, m, wg);
          if (order.active()) {
            int* counter = TurnCounter(a, tile.batch, head, m, 1, 0);
            order.InTurn(counter, m, wg, [&] {
              BulkReduceAddF32(dst, slice, kBytes);
              BulkCommit();
              BulkWaitAll();
            });
          } else {
            BulkReduceAddF32(dst, slice, kBytes);
            BulkCommit();
            BulkWaitRead();
          }
        }
        __syncwarp();
        // No hand-back after the last step: the consumers do not wait for it.
        if (head != last_head || m + 1 != m_hi) NamedBarrierArrive(kBwdBarrierDqEmpty + wg, kBwdDqHandoverThreads);
      }
    }
    if (lane == 0) BulkWaitAll();  // the reductions have written dq_accum before the CTA ends
  }
};

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_BWD_DQ_WRITER_H_
