// maxattn sm90: the backward's dQ writer, one warp of the producer warpgroup.
// It walks the same steps as the consumers; per step and consumer warpgroup it
// waits until the warpgroup has staged its dQ fragment (named barrier
// kBwdBarrierDqFull + wg), adds the slice into dq_accum with one bulk
// reduction (cp.reduce.async.bulk .add.f32, issued by lane 0), waits until the
// bulk unit has read the slice and hands it back (kBwdBarrierDqEmpty + wg).
// The consumers only arrive on the first barrier and meet the second one a
// whole step later, so neither the reduction's issue nor its read sits in
// their loop. In the deterministic mode the writer also waits for the
// reduction's turn (bwd_dq_order.h) -- a wait the consumers then see only if
// it outlasts their next step.
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

  // Query blocks [m_lo, m_hi) of every head of the tile's group (non-empty);
  // order_table: the turns the consumers count (deterministic mode only).
  __device__ static void Run(const BwdArgs& a, SharedStorage& smem, const BwdTile& tile, int m_lo, int m_hi,
                             const int* order_table, int lane) {
    constexpr int kWarpgroups = Config::kConsumerWarpgroups;
    constexpr int kBytes = Config::kDqSliceFloats * static_cast<int>(sizeof(float));
    const DqOrder<Config> order = a.dq_turns != nullptr ? DqOrder<Config>::View(order_table, m_lo) : DqOrder<Config>{};
    // The slices start empty.
    for (int wg = 0; wg < kWarpgroups; ++wg) NamedBarrierArrive(kBwdBarrierDqEmpty + wg, kBwdDqHandoverThreads);
    const int last_head = (tile.kv_head + 1) * a.group - 1;
    for (int head = tile.kv_head * a.group; head <= last_head; ++head) {
      for (int m = m_lo; m < m_hi; ++m) {
        for (int wg = 0; wg < kWarpgroups; ++wg) {
          NamedBarrierSync(kBwdBarrierDqFull + wg, kBwdDqHandoverThreads);
          if (lane == 0) {
            float* dst = BwdEpilogue<Config>::GmemSlice(a, tile.batch, head, m, wg);
            const float* slice = smem.dq[wg];
            if (order.active()) {
              int* counter = a.dq_turns + (static_cast<int64_t>(tile.batch) * a.heads + head) * a.num_m_blocks + m;
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
    }
    if (lane == 0) BulkWaitAll();  // the reductions have written dq_accum before the CTA ends
  }
};

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_BWD_DQ_WRITER_H_
