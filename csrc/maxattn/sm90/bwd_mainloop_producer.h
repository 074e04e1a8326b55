// maxattn sm90: the backward's producer. Warp 0 runs it, one elected lane
// issues every load of a CTA (the warp's other lanes follow the loop, which
// keeps its coordinates warp-uniform: uniform registers, as the TMA
// instructions read them, instead of per-thread values moved over per load):
// K and V of its key block once, each on its own transaction barrier (V after
// the first Q stage), then per step (query head of the group, query block) Q
// with its lse*log2(e) into the next stage of pipe_q and dO with its D - dlse
// into the same stage of pipe_do, in the order the consumers use them. Q and
// dO rows past T are zero-filled by TMA; the row statistics are padded to
// t_pad by the pre-pass, so their 256-byte bulk copies never leave the buffer.
#ifndef MAXATTN_SM90_BWD_MAINLOOP_PRODUCER_H_
#define MAXATTN_SM90_BWD_MAINLOOP_PRODUCER_H_

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/tensor.hpp>

#include "maxattn/sm90/bwd_config.h"
#include "maxattn/sm90/tile_scheduler.h"

namespace maxattn::sm90 {

template <class Config>
struct BwdProducer {
  using SharedStorage = typename Config::SharedStorage;
  using Pipeline = typename Config::Pipeline;
  using PipelineState = typename Config::PipelineState;

  // Query blocks [m_lo, m_hi) of every head of the tile's group (non-empty).
  // Called by all of warp 0; the pipelines' leader (threadIdx.x == 0, their
  // expect-tx) is the lane that elect_one_sync picks, which issues the copies.
  __device__ static void Run(const BwdParams<Config>& p, SharedStorage& smem, Pipeline& pipe_q, Pipeline& pipe_do,
                             const BwdTile& tile, int m_lo, int m_hi) {
    using namespace cute;
    const BwdArgs& a = p.args;
    constexpr int H = Config::kHeadDim;
    using BlockM = typename Config::BlockM;
    using BlockN = typename Config::BlockN;
    using HeadDim = typename Config::HeadDim;

    Tensor mK = p.tma_k.get_tma_tensor(make_shape(a.kv_len, H, a.kv_heads, a.batch));
    Tensor mV = p.tma_v.get_tma_tensor(make_shape(a.kv_len, H, a.kv_heads, a.batch));
    Tensor gK = local_tile(mK(_, _, tile.kv_head, tile.batch), Shape<BlockN, HeadDim>{}, make_coord(_, _0{}));
    Tensor gV = local_tile(mV(_, _, tile.kv_head, tile.batch), Shape<BlockN, HeadDim>{}, make_coord(_, _0{}));
    // K and V seen with a trailing mode of one stage, so that they partition like the pipelined tiles.
    using SmemLayoutKV1 = decltype(tile_to_shape(typename Config::SwizzleAtom{}, Shape<BlockN, HeadDim, _1>{}));
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), SmemLayoutKV1{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), SmemLayoutKV1{});
    auto [tKg, tKs] = tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVg, tVs] = tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    const bool issue = cute::elect_one_sync();
    if (issue) {
      smem.barrier_k.arrive_and_expect_tx(Config::kBytesKV);
      copy(p.tma_k.with(reinterpret_cast<uint64_t&>(smem.barrier_k), 0), tKg(_, tile.n_block), tKs(_, 0));
    }
    // V after the first Q stage: the first S^T = K Q^T then waits for 48 of the first step's 96 KB
    // (H = 128), and dP^T = V dO^T, issued after it, for the rest.
    bool v_loaded = false;

    Tensor mQ = p.tma_q.get_tma_tensor(make_shape(a.q_len, H, a.heads, a.batch));
    Tensor mdO = p.tma_do.get_tma_tensor(make_shape(a.q_len, H, a.heads, a.batch));
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Config::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Config::SmemLayoutdO{});
    PipelineState state = cutlass::make_producer_start_state<Pipeline>();
    for (int g = 0; g < a.group; ++g) {
      const int head = tile.kv_head * a.group + g;
      Tensor gQ = local_tile(mQ(_, _, head, tile.batch), Shape<BlockM, HeadDim>{}, make_coord(_, _0{}));
      Tensor gdO = local_tile(mdO(_, _, head, tile.batch), Shape<BlockM, HeadDim>{}, make_coord(_, _0{}));
      auto [tQg, tQs] = tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto [tdOg, tdOs] =
          tma_partition(p.tma_do, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
      const int64_t stats_row = (static_cast<int64_t>(tile.batch) * a.heads + head) * a.t_pad;
      for (int m = m_lo; m < m_hi; ++m) {
        const int stage = static_cast<int>(state.index());
        pipe_q.producer_acquire(state);
        uint64_t* q_full = pipe_q.producer_get_barrier(state);
        if (issue) {
          copy(p.tma_q.with(*q_full, 0), tQg(_, m), tQs(_, stage));
          SM90_BULK_COPY_G2S::copy(a.lse_log2 + stats_row + m * Config::kBlockM, q_full, smem.lse_log2[stage],
                                   Config::kBytesRowStats);
        }
        if (!v_loaded) {
          if (issue) {
            smem.barrier_v.arrive_and_expect_tx(Config::kBytesKV);
            copy(p.tma_v.with(reinterpret_cast<uint64_t&>(smem.barrier_v), 0), tVg(_, tile.n_block), tVs(_, 0));
          }
          v_loaded = true;
        }
        pipe_do.producer_acquire(state);
        uint64_t* do_full = pipe_do.producer_get_barrier(state);
        if (issue) {
          copy(p.tma_do.with(*do_full, 0), tdOg(_, m), tdOs(_, stage));
          SM90_BULK_COPY_G2S::copy(a.dpsum + stats_row + m * Config::kBlockM, do_full, smem.dpsum[stage],
                                   Config::kBytesRowStats);
        }
        ++state;
      }
    }
  }
};

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_BWD_MAINLOOP_PRODUCER_H_
