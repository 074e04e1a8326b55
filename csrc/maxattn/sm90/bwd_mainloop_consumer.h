// maxattn sm90: a backward consumer warpgroup's main loop (bwd_config.h has
// the GEMM plan). Per step, for one query head and one block of kBlockM
// queries against the warpgroup's 64 keys:
//   1. issue S^T = K Q^T and dP^T = V dO^T; the step's mask is decided while
//      they run;
//   2. S^T ready: mask (boundary tiles only), P^T from the lse (SoftmaxGrad);
//   3. dP^T ready: dS^T = P^T o (dP^T - D); dS^T to shared memory (stmatrix,
//      transposed into dS's keys-contiguous layout, one of two buffers);
//   4. issue dV += P^T dO; make dS visible to the tensor cores (proxy fence,
//      named barrier); issue dQ = dS K and dK += dS^T Q;
//   5. dV and dQ retired: release the dO stage; once its dQ writer warp has
//      read the previous one, stage dQ in this warpgroup's shared slice and
//      hand it over (the writer adds it into dq_accum: bwd_dq_writer.h);
//      dK retired: release the Q stage.
// dK and dV stay in registers for the whole walk and are stored once
// (bwd_epilogue.h).
#ifndef MAXATTN_SM90_BWD_MAINLOOP_CONSUMER_H_
#define MAXATTN_SM90_BWD_MAINLOOP_CONSUMER_H_

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "maxattn/sm90/barrier.h"
#include "maxattn/sm90/bwd_config.h"
#include "maxattn/sm90/bwd_dq_order.h"
#include "maxattn/sm90/bwd_epilogue.h"
#include "maxattn/sm90/bwd_score_step.h"
#include "maxattn/sm90/gemm.h"
#include "maxattn/sm90/softmax.h"
#include "maxattn/sm90/tile_scheduler.h"

namespace maxattn::sm90 {

template <class Config>
struct BwdConsumer {
  using Element = typename Config::Element;
  using SharedStorage = typename Config::SharedStorage;
  using Pipeline = typename Config::Pipeline;
  using PipelineState = typename Config::PipelineState;

  // Walks query blocks [m_lo, m_hi) of every head of the tile's group (none
  // when empty) and stores dK and dV of the tile's keys. launch_index and
  // order_table: the CTA's place in its row and shared memory for the turns
  // of the deterministic mode (a.dq_turns set).
  __device__ static void Run(const BwdParams<Config>& p, SharedStorage& smem, Pipeline& pipe_q, Pipeline& pipe_do,
                             const BwdTile& tile, int m_lo, int m_hi, int launch_index, int* order_table,
                             int consumer_tid) {
    const BwdArgs& a = p.args;
    using namespace cute;
    using BlockM = typename Config::BlockM;
    using BlockN = typename Config::BlockN;
    using HeadDim = typename Config::HeadDim;
    constexpr int kBlockM = Config::kBlockM;
    constexpr int kBlockN = Config::kBlockN;
    constexpr bool kSplitKeys = Config::kDqSplitKeys;
    // The warpgroup index through a shuffle, so the compiler knows it is warp-uniform: the GEMMs'
    // shared-memory descriptors then live in uniform registers. Derived from the thread index they
    // were built per thread and moved over (R2UR) before every WGMMA: four extra instructions and a
    // dependency stall per WGMMA of the S^T and dP^T GEMMs.
    const int wg = __shfl_sync(0xffffffff, consumer_tid / 128, 0);
    const int wg_tid = consumer_tid % 128;

    typename Config::TiledMmaSdP mma_sdp;
    typename Config::TiledMmadKV mma_dkv;
    typename Config::TiledMmadQ mma_dq;
    // Operand (descriptor) partitions depend only on the warpgroup: sliced at its first thread.
    // Accumulator coordinates need the thread itself.
    auto wg_sdp = mma_sdp.get_thread_slice(wg * 128);
    auto wg_dkv = mma_dkv.get_thread_slice(wg * 128);
    auto wg_dq = mma_dq.get_thread_slice(kSplitKeys ? 0 : wg * 128);
    auto thr_sdp = mma_sdp.get_thread_slice(consumer_tid);

    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Config::SmemLayoutQ{});
    Tensor sQt = make_tensor(make_smem_ptr(smem.q.data()), typename Config::SmemLayoutQt{});
    Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Config::SmemLayoutdO{});
    Tensor sdOt = make_tensor(make_smem_ptr(smem.dout.data()), typename Config::SmemLayoutdOt{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Config::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Config::SmemLayoutV{});
    Tensor sdSt = make_tensor(make_smem_ptr(smem.ds.data()), typename Config::SmemLayoutdSt{});

    Tensor tSrK = wg_sdp.partition_fragment_A(sK);     // S^T: keys x head dim
    Tensor tSrQ = wg_sdp.partition_fragment_B(sQ);     // (MMA, N, K, stage)
    Tensor tdPrV = wg_sdp.partition_fragment_A(sV);
    Tensor tdPrdO = wg_sdp.partition_fragment_B(sdO);
    Tensor tdVrdO = wg_dkv.partition_fragment_B(sdOt);  // (MMA, H, queries, stage)
    Tensor tdKrQ = wg_dkv.partition_fragment_B(sQt);
    // dQ's operands: dS (queries x keys, one of two buffers) and K^T; with
    // kSplitKeys only this warpgroup's 64 keys of each.
    auto dq_operands = [&] {
      if constexpr (kSplitKeys) {
        constexpr int kHalf = kBlockM * (kBlockN / 2);
        Tensor sdS0 = make_tensor(make_smem_ptr(smem.ds.data() + wg * kHalf), typename Config::SmemLayoutdSHalf{});
        Tensor sdS1 = make_tensor(make_smem_ptr(smem.ds.data() + kBlockM * kBlockN + wg * kHalf),
                                  typename Config::SmemLayoutdSHalf{});
        Tensor sKt = make_tensor(make_smem_ptr(smem.k.data() + wg * (kBlockN / 2) * Config::kHeadDim),
                                 typename Config::SmemLayoutKtHalf{});
        return make_tuple(wg_dq.partition_fragment_A(sdS0), wg_dq.partition_fragment_A(sdS1),
                          wg_dq.partition_fragment_B(sKt));
      } else {
        Tensor sdS = make_tensor(make_smem_ptr(smem.ds.data()), typename Config::SmemLayoutdS{});
        Tensor sKt = make_tensor(make_smem_ptr(smem.k.data()), typename Config::SmemLayoutKt{});
        Tensor tdQrdS = wg_dq.partition_fragment_A(sdS);  // (MMA, M, K, buffer)
        return make_tuple(tdQrdS(_, _, _, 0), tdQrdS(_, _, _, 1), wg_dq.partition_fragment_B(sKt));
      }
    }();
    auto tdQrdS0 = get<0>(dq_operands);
    auto tdQrdS1 = get<1>(dq_operands);
    auto tdQrK = get<2>(dq_operands);

    // dS^T from the S^T accumulator layout into dS's shared memory, transposed.
    auto copy_ds = make_tiled_copy_C(Copy_Atom<SM90_U16x8_STSM_T, Element>{}, mma_sdp);
    auto thr_copy_ds = copy_ds.get_thread_slice(consumer_tid);
    Tensor tdSsdS = thr_copy_ds.partition_D(as_position_independent_swizzle_tensor(sdSt));  // (CPY, M, N, buffer)

    // Coordinates: (key, query) of the S^T elements (dQ's are the post-pass's).
    Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<BlockN, BlockM>{}));
    Tensor cS_rc = make_tensor(cS.data(), RowColLayout(cS.layout()));

    Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<BlockN, HeadDim>{});
    Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<BlockN, HeadDim>{});
    clear(tdVrdV);
    clear(tdKrdK);

    constexpr int kCols = decltype(size<1>(cS_rc))::value;  // queries per thread
    const SoftmaxGrad<Config::kSoftcap> grad{
        SoftmaxScales{a.scale, a.scale_log2, a.softcap, a.softcap_in, a.softcap_log2}};
    const int n0 = tile.n_block * kBlockN;

    if (m_lo < m_hi) {
      if (a.dq_turns != nullptr) DqOrder<Config>::Count(a, tile, launch_index, m_lo, m_hi, order_table, consumer_tid);
      smem.barrier_k.wait(0);
      PipelineState state;
      int buffer = 0;
      for (int g = 0; g < a.group; ++g) {
        for (int m = m_lo; m < m_hi; ++m) {
          const int stage = static_cast<int>(state.index());
          Tensor tSrS = partition_fragment_C(mma_sdp, Shape<BlockN, BlockM>{});
          Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<BlockN, BlockM>{});
          pipe_q.consumer_wait(state);
          IssueGemm<true, false>(mma_sdp, tSrK, tSrQ(_, _, _, stage), tSrS);
          pipe_do.consumer_wait(state);
          smem.barrier_v.wait(0);  // V: only the first wait blocks (a flag would cost a register)
          IssueGemm<true, false>(mma_sdp, tdPrV, tdPrdO(_, _, _, stage), tdPrdP);
          const BwdScoreStep<Config> scores(a, tile.batch, m, n0);  // the mask, decided while the GEMMs run
          float stats[kCols];
          LoadColumnStats(stats, smem.lse_log2[stage], cS_rc);
          Tensor rP = make_tensor_like<Element>(tSrS);
          scores.Probabilities(a, grad, tSrS, rP, cS_rc, stats);
          LoadColumnStats(stats, smem.dpsum[stage], cS_rc);
          Tensor rdS = make_tensor_like<Element>(tdPrdP);
          scores.ScoreGrad(grad, tSrS, tdPrdP, rdS, stats);
          copy(copy_ds, thr_copy_ds.retile_S(rdS), tdSsdS(_, _, _, buffer));

          // P^T and dS^T as the A operands of dV and dK: the accumulator and the
          // A-register layouts hold the same elements in the same order.
          Tensor tdVrP = make_tensor(rP.data(), make_layout(partition_shape_A(mma_dkv, Shape<BlockN, BlockM>{})));
          Tensor tdKrdS = make_tensor(rdS.data(), make_layout(partition_shape_A(mma_dkv, Shape<BlockN, BlockM>{})));
          IssueGemm<false, true>(mma_dkv, tdVrP, tdVrdO(_, _, _, stage), tdVrdV);
          cutlass::arch::fence_view_async_shared();
          if constexpr (kSplitKeys) NamedBarrierSync(kBwdBarrierDsWarpgroup + wg, 128);
          else NamedBarrierSync(kBwdBarrierDs, Config::kConsumerThreads);
          Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<BlockM, HeadDim>{});
          if (buffer == 0) IssueGemm<true, false>(mma_dq, tdQrdS0, tdQrK, tdQrdQ);
          else IssueGemm<true, false>(mma_dq, tdQrdS1, tdQrK, tdQrdQ);
          IssueGemm<false, true>(mma_dkv, tdKrdS, tdKrQ(_, _, _, stage), tdKrdK);

          warpgroup_wait<1>();
          warpgroup_fence_operand(tdVrdV);
          warpgroup_fence_operand(tdQrdQ);
          pipe_do.consumer_release(state);
          // The writer warp has read the slice's previous contents; stage this
          // step's dQ and hand it over (bwd_dq_writer.h adds it into dq_accum).
          NamedBarrierSync(kBwdBarrierDqEmpty + wg, kBwdDqHandoverThreads);
          BwdEpilogue<Config>::StageDq(smem.dq[wg], tdQrdQ, wg_tid);
          cutlass::arch::fence_view_async_shared();
          NamedBarrierArrive(kBwdBarrierDqFull + wg, kBwdDqHandoverThreads);
          warpgroup_wait<0>();
          warpgroup_fence_operand(tdKrdK);
          pipe_q.consumer_release(state);
          ++state;
          buffer ^= 1;
        }
      }
    }
    // Both warpgroups' last GEMMs have read Q and dO: their shared memory stages dV and dK.
    NamedBarrierSync(kBwdBarrierDs, Config::kConsumerThreads);
    BwdEpilogue<Config>::StoreDkDv(a, p.tma_dk, p.tma_dv, tile, tdKrdK, tdVrdV, smem.dout.data(), smem.q.data(), wg);
  }
};

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_BWD_MAINLOOP_CONSUMER_H_
