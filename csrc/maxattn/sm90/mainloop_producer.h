// maxattn sm90: the producer. Warp 0 runs it and one elected lane issues
// every TMA load of a tile: Q once (completing on its own transaction
// barrier), then K and V of each key block into the next stage of their
// pipelines, in the order the consumers use them (last key block first, so the
// masked diagonal blocks come first). The other lanes follow the loop, which
// keeps its coordinates warp-uniform (uniform registers, as the TMA
// instructions read them) instead of moving them over before every load.
// Out-of-range rows (T, S not multiples of the tile) are zero-filled by TMA.
#ifndef MAXATTN_SM90_MAINLOOP_PRODUCER_H_
#define MAXATTN_SM90_MAINLOOP_PRODUCER_H_

#include <cute/tensor.hpp>

#include "maxattn/sm90/kernel_config.h"
#include "maxattn/sm90/tile_scheduler.h"

namespace maxattn::sm90 {

template <class Config>
struct ProducerMainloop {
  using SharedStorage = typename Config::SharedStorage;
  using Pipeline = typename Config::Pipeline;
  using PipelineState = typename Config::PipelineState;

  // Called by all of warp 0. state: the producer write position, carried
  // across tiles; q_loads: how many earlier tiles of this CTA loaded Q (the
  // parity to wait on before overwriting it); issue: this lane issues the
  // copies (elect_one_sync: the pipelines' leader, threadIdx.x == 0, which
  // does their expect-tx in producer_acquire).
  __device__ static void Run(const FwdParams<Config>& p, SharedStorage& smem, Pipeline& pipe_k,
                             Pipeline& pipe_v, const Tile& tile, int n_lo, int n_hi, PipelineState& state,
                             int q_loads, bool issue) {
    using namespace cute;
    const FwdArgs& a = p.args;
    constexpr int H = Config::kHeadDim;
    Tensor mQ = p.tma_q.get_tma_tensor(make_shape(a.q_len, H, a.heads, a.batch));
    Tensor mK = p.tma_k.get_tma_tensor(make_shape(a.kv_len, H, a.kv_heads, a.batch));
    Tensor mV = p.tma_v.get_tma_tensor(make_shape(a.kv_len, H, a.kv_heads, a.batch));
    Tensor gQ = local_tile(mQ(_, _, tile.head, tile.batch), Shape<typename Config::BlockM, typename Config::HeadDim>{},
                           make_coord(tile.m_block, _0{}));
    Tensor gK = local_tile(mK(_, _, tile.kv_head, tile.batch),
                           Shape<typename Config::BlockN, typename Config::HeadDim>{}, make_coord(_, _0{}));
    Tensor gV = local_tile(mV(_, _, tile.kv_head, tile.batch),
                           Shape<typename Config::BlockN, typename Config::HeadDim>{}, make_coord(_, _0{}));
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Config::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Config::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Config::SmemLayoutV{});
    auto [tQg, tQs] = tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    auto [tKg, tKs] = tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVg, tVs] = tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));

    if (q_loads > 0) smem.barrier_q_empty.wait(static_cast<uint32_t>((q_loads - 1) & 1));
    if (issue) {
      smem.barrier_q.arrive_and_expect_tx(Config::kBytesQ);
      copy(p.tma_q.with(reinterpret_cast<uint64_t&>(smem.barrier_q), 0), tQg, tQs);
    }

    for (int nb = n_hi - 1; nb >= n_lo; --nb) {
      pipe_k.producer_acquire(state);
      if (issue) copy(p.tma_k.with(*pipe_k.producer_get_barrier(state), 0), tKg(_, nb), tKs(_, state.index()));
      pipe_v.producer_acquire(state);
      if (issue) copy(p.tma_v.with(*pipe_v.producer_get_barrier(state), 0), tVg(_, nb), tVs(_, state.index()));
      ++state;
    }
  }
};

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_MAINLOOP_PRODUCER_H_
