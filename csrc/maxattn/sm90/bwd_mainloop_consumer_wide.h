// maxattn sm90: a consumer warpgroup's main loop of the head-dim-256 backward
// (bwd_config_wide.h has the GEMM plan). The CTA's two consumer warpgroups
// share its 64 keys; per step (one query head, one block of 64 queries)
// warpgroup w:
//   1. issues S^T = K Q_w^T and dP^T = V dO_w^T for its 32 of the queries;
//      the step's mask is decided while they run;
//   2. S^T ready: mask (boundary tiles only), P^T from the lse (SoftmaxGrad),
//      stored to shared memory (stmatrix, one of two buffers);
//   3. dP^T ready: dS^T = P^T o (dP^T - D), stored next to P^T;
//   4. meets the other warpgroup (both halves of P^T and dS^T are in shared
//      memory: one named barrier per step), issues dQ = dS K for its 64
//      columns of the head dim's first half and dV += P^T dO for its 128;
//   5. that dQ retired: adds it into dq_accum from its registers while dV runs
//      (bwd_epilogue.h, ReduceDq), then the same for the second half with
//      dK += dS^T Q; dV and dK retired: releases the stages.
// The buffers alternate, so a step's stores never meet the other
// warpgroup's GEMMs of the step before: it passed this step's barrier only
// after they retired. dK and dV stay in registers for the whole walk and are
// stored once (bwd_epilogue.h, StoreDkDvByThreads).
// Deterministic mode (a.dq_turns set): before each of its two dQ adds a
// warpgroup waits until its counter of that (query block, warpgroup, half)
// has reached its turn -- the number of CTAs launched earlier whose walk
// includes the block, counted at the top of the step (bwd_dq_order.h) -- and
// releases it once its adds are done.
#ifndef MAXATTN_SM90_BWD_MAINLOOP_CONSUMER_WIDE_H_
#define MAXATTN_SM90_BWD_MAINLOOP_CONSUMER_WIDE_H_

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
struct BwdWideConsumer {
  using Element = typename Config::Element;
  using SharedStorage = typename Config::SharedStorage;
  using Pipeline = typename Config::Pipeline;
  using PipelineState = typename Config::PipelineState;

  // Walks query blocks [m_lo, m_hi) of every head of the tile's group (none
  // when empty) and stores dK and dV of the tile's keys. launch_index: the
  // CTA's place in its row (deterministic mode).
  __device__ static void Run(const BwdArgs& a, SharedStorage& smem, Pipeline& pipe_q, Pipeline& pipe_do,
                             const BwdTile& tile, int m_lo, int m_hi, int launch_index, int consumer_tid) {
    using namespace cute;
    using BlockM = typename Config::BlockM;
    using BlockN = typename Config::BlockN;
    using HeadDim = typename Config::HeadDim;
    constexpr int kBlockN = Config::kBlockN;
    // Warp-uniform through a shuffle, so the GEMM descriptors live in uniform registers (as in
    // bwd_mainloop_consumer.h).
    const int wg = __shfl_sync(0xffffffff, consumer_tid / 128, 0);
    const int wg_tid = consumer_tid % 128;

    typename Config::TiledMmaSdP mma_sdp;
    typename Config::TiledMmadKV mma_dkv;
    typename Config::TiledMmadQ mma_dq;
    auto wg_sdp = mma_sdp.get_thread_slice(wg * 128);
    auto wg_dkv = mma_dkv.get_thread_slice(wg * 128);
    auto wg_dq = mma_dq.get_thread_slice(wg * 128);
    auto thr_sdp = mma_sdp.get_thread_slice(consumer_tid);
    auto thr_dkv = mma_dkv.get_thread_slice(consumer_tid);

    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Config::SmemLayoutQ{});
    Tensor sQt = make_tensor(make_smem_ptr(smem.q.data()), typename Config::SmemLayoutQt{});
    Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Config::SmemLayoutdO{});
    Tensor sdOt = make_tensor(make_smem_ptr(smem.dout.data()), typename Config::SmemLayoutdOt{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Config::SmemLayoutK{});
    constexpr int kHalfHElems = kBlockN * Config::kHeadDim / 2;
    Tensor sKt0 = make_tensor(make_smem_ptr(smem.k.data()), typename Config::SmemLayoutKtHalfH{});
    Tensor sKt1 = make_tensor(make_smem_ptr(smem.k.data() + kHalfHElems), typename Config::SmemLayoutKtHalfH{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Config::SmemLayoutV{});
    Tensor sPt = make_tensor(make_smem_ptr(smem.pt.data()), typename Config::SmemLayoutPt{});
    Tensor sdSt = make_tensor(make_smem_ptr(smem.dst.data()), typename Config::SmemLayoutdSt{});
    Tensor sdS = make_tensor(make_smem_ptr(smem.dst.data()), typename Config::SmemLayoutdS{});

    Tensor tSrK = wg_sdp.partition_fragment_A(sK);       // S^T: keys x head dim
    Tensor tSrQ = wg_sdp.partition_fragment_B(sQ);       // (MMA, N, K, stage): this warpgroup's queries
    Tensor tdPrV = wg_sdp.partition_fragment_A(sV);
    Tensor tdPrdO = wg_sdp.partition_fragment_B(sdO);
    Tensor tdVrPt = wg_dkv.partition_fragment_A(sPt);    // (MMA, M, K, buffer)
    Tensor tdVrdO = wg_dkv.partition_fragment_B(sdOt);   // (MMA, N, K, stage): this warpgroup's columns
    Tensor tdKrdSt = wg_dkv.partition_fragment_A(sdSt);
    Tensor tdKrQ = wg_dkv.partition_fragment_B(sQt);
    Tensor tdQrdS = wg_dq.partition_fragment_A(sdS);     // (MMA, M, K, buffer)
    Tensor tdQrK0 = wg_dq.partition_fragment_B(sKt0);   // this warpgroup's 64 columns of each half
    Tensor tdQrK1 = wg_dq.partition_fragment_B(sKt1);

    // P^T and dS^T from the S^T accumulator layout into their (key, query) tiles.
    auto copy_pds = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
    auto thr_copy_pds = copy_pds.get_thread_slice(consumer_tid);
    Tensor tPsPt = thr_copy_pds.partition_D(as_position_independent_swizzle_tensor(sPt));     // (CPY, M, N, buffer)
    Tensor tdSsdSt = thr_copy_pds.partition_D(as_position_independent_swizzle_tensor(sdSt));

    // Coordinates: (key, query) of the S^T elements, (key, column) of dK's and dV's.
    Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<BlockN, BlockM>{}));
    Tensor cS_rc = make_tensor(cS.data(), RowColLayout(cS.layout()));
    Tensor cdKV = thr_dkv.partition_C(make_identity_tensor(Shape<BlockN, HeadDim>{}));

    Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<BlockN, HeadDim>{});
    Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<BlockN, HeadDim>{});
    clear(tdVrdV);
    clear(tdKrdK);

    constexpr int kCols = decltype(size<1>(cS_rc))::value;  // queries per thread
    const SoftmaxGrad<Config::kSoftcap> grad{
        SoftmaxScales{a.scale, a.scale_log2, a.softcap, a.softcap_in, a.softcap_log2}};
    const int n0 = tile.n_block * kBlockN;

    if (m_lo < m_hi) {
      smem.barrier_k.wait(0);
      PipelineState state;
      int buffer = 0;
      for (int g = 0; g < a.group; ++g) {
        const int head = tile.kv_head * a.group + g;
        for (int m = m_lo; m < m_hi; ++m) {
          const int stage = static_cast<int>(state.index());
          Tensor tSrS = partition_fragment_C(mma_sdp, Shape<BlockN, BlockM>{});
          Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<BlockN, BlockM>{});
          pipe_q.consumer_wait(state);
          IssueGemm<true, false>(mma_sdp, tSrK, tSrQ(_, _, _, stage), tSrS);
          pipe_do.consumer_wait(state);
          smem.barrier_v.wait(0);  // V: only the first wait blocks (a flag would cost a register)
          IssueGemm<true, false>(mma_sdp, tdPrV, tdPrdO(_, _, _, stage), tdPrdP);
          // Deterministic mode: this step's turn, counted while the GEMMs run.
          int turn = 0;
          if (a.dq_turns != nullptr) {
            int count = EarlierWalksThrough<Config>(a, BlockMask::MakeRow(a, tile.batch), launch_index, m, wg_tid, 128);
            count = __reduce_add_sync(0xffffffffu, count);
            if (wg_tid % 32 == 0) smem.turn_partial[wg][wg_tid / 32] = count;
            NamedBarrierSync(kBwdBarrierWideTurn + wg, 128);
            turn = smem.turn_partial[wg][0] + smem.turn_partial[wg][1] + smem.turn_partial[wg][2] +
                   smem.turn_partial[wg][3];
          }
          const BwdScoreStep<Config> scores(a, tile.batch, m, n0);  // the mask, decided while the GEMMs run
          float stats[kCols];
          LoadColumnStats(stats, smem.lse_log2[stage], cS_rc);
          Tensor rP = make_tensor_like<Element>(tSrS);
          scores.Probabilities(a, grad, tSrS, rP, cS_rc, stats);
          copy(copy_pds, thr_copy_pds.retile_S(rP), tPsPt(_, _, _, buffer));
          LoadColumnStats(stats, smem.dpsum[stage], cS_rc);
          Tensor rdS = make_tensor_like<Element>(tdPrdP);
          scores.ScoreGrad(grad, tSrS, tdPrdP, rdS, stats);
          copy(copy_pds, thr_copy_pds.retile_S(rdS), tdSsdSt(_, _, _, buffer));

          // Both warpgroups' P^T and dS^T are in shared memory, visible to the tensor cores.
          cutlass::arch::fence_view_async_shared();
          NamedBarrierSync(kBwdBarrierDs, Config::kConsumerThreads);
          // dQ's two column halves in turn, each added while the tensor cores run dV or dK.
          float* dq_slice = BwdEpilogue<Config>::GmemSlice(a, tile.batch, head, m, wg);
          // Adds half h's fragment, in turn in the deterministic mode.
          auto add_dq = [&](const auto& frag, int h) {
            if (a.dq_turns == nullptr) {
              BwdEpilogue<Config>::ReduceDq(dq_slice, frag, wg_tid, h * decltype(size(frag))::value);
              return;
            }
            int* counter = TurnCounter(a, tile.batch, head, m, Config::kTurnCounters, wg * 2 + h);
            if (wg_tid == 0) WaitForCount(counter, turn);
            NamedBarrierSync(kBwdBarrierWideTurn + wg, 128);
            BwdEpilogue<Config>::ReduceDq(dq_slice, frag, wg_tid, h * decltype(size(frag))::value);
            __threadfence();  // this thread's adds, before the warpgroup's release
            NamedBarrierSync(kBwdBarrierWideTurn + wg, 128);
            if (wg_tid == 0) ReleaseCount(counter);
          };
          Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<BlockM, typename Config::HalfH>{});
          Tensor tdQrdS_b = tdQrdS(_, _, _, buffer);
          Tensor tdVrPt_b = tdVrPt(_, _, _, buffer);
          Tensor tdKrdSt_b = tdKrdSt(_, _, _, buffer);
          IssueGemm<true, false>(mma_dq, tdQrdS_b, tdQrK0, tdQrdQ);
          IssueGemm<false, false>(mma_dkv, tdVrPt_b, tdVrdO(_, _, _, stage), tdVrdV);
          warpgroup_wait<1>();
          warpgroup_fence_operand(tdQrdQ);
          add_dq(tdQrdQ, 0);
          IssueGemm<true, false>(mma_dq, tdQrdS_b, tdQrK1, tdQrdQ);
          IssueGemm<false, false>(mma_dkv, tdKrdSt_b, tdKrQ(_, _, _, stage), tdKrdK);
          warpgroup_wait<1>();
          warpgroup_fence_operand(tdQrdQ);
          add_dq(tdQrdQ, 1);
          warpgroup_wait<0>();
          warpgroup_fence_operand(tdVrdV);
          warpgroup_fence_operand(tdKrdK);
          pipe_do.consumer_release(state);
          pipe_q.consumer_release(state);
          ++state;
          buffer ^= 1;
        }
      }
    }
    // Both warpgroups' last GEMMs have read Q and dO: their shared memory stages dV and dK.
    NamedBarrierSync(kBwdBarrierDs, Config::kConsumerThreads);
    BwdEpilogue<Config>::StoreDkDvByThreads(a, tile, tdKrdK, tdVrdV, cdKV, smem.dout.data(), smem.q.data(),
                                            consumer_tid);
  }
};

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_BWD_MAINLOOP_CONSUMER_WIDE_H_
