// maxattn sm90: a consumer warpgroup's main loop. Per key block: S = Q K^T by
// WGMMA from shared memory, release the K stage, mask (boundary tiles only),
// online softmax, P converted to the element type in registers, O += P V by
// WGMMA with P from registers and V read MN-major from shared memory, release
// the V stage.
#ifndef MAXATTN_SM90_MAINLOOP_CONSUMER_H_
#define MAXATTN_SM90_MAINLOOP_CONSUMER_H_

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include "maxattn/sm90/epilogue.h"
#include "maxattn/sm90/gemm.h"
#include "maxattn/sm90/kernel_config.h"
#include "maxattn/sm90/mask.h"
#include "maxattn/sm90/softmax.h"
#include "maxattn/sm90/tile_scheduler.h"

namespace maxattn::sm90 {

template <class Config>
struct ConsumerMainloop {
  using Element = typename Config::Element;
  using SharedStorage = typename Config::SharedStorage;
  using Pipeline = typename Config::Pipeline;
  using PipelineState = typename Config::PipelineState;

  using MaxLogitShare = typename Epilogue<Config>::MaxLogitShare;

  template <int kVariant, bool kSoftcap>
  // state_k / state_v: the consumer read positions in the K and V pipelines,
  // carried from tile to tile by a persistent CTA. q_phase: parity of the Q
  // barrier for this tile (the count of earlier tiles that loaded Q).
  // carry (Config::kDeferMaxLogit): the previous tile's unpublished max_logit
  // share on entry, this tile's on exit (the caller publishes the last one).
  __device__ static void Run(const FwdArgs& args, const typename Config::TmaO& tma_o, SharedStorage& smem,
                             Pipeline& pipe_k, Pipeline& pipe_v,
                             const Tile& tile, const BlockMask& mask, int n_lo, int n_hi, int consumer_tid,
                             PipelineState& state_k, PipelineState& state_v, int q_phase, MaxLogitShare& carry) {
    using namespace cute;
    using BlockM = typename Config::BlockM;
    using BlockN = typename Config::BlockN;
    using HeadDim = typename Config::HeadDim;
    constexpr int kBlockM = Config::kBlockM;
    constexpr int kBlockN = Config::kBlockN;

    typename Config::TiledMmaS mma_s;
    typename Config::TiledMmaO mma_o;
    // Operand (descriptor) partitions depend only on the warpgroup: sliced at its first thread,
    // whose index comes through a shuffle so the compiler knows it is warp-uniform and keeps the
    // descriptors in uniform registers (from the thread index, each S WGMMA was preceded by a
    // per-thread descriptor computation and two R2UR). Accumulator coordinates need the thread.
    const int wg_first = __shfl_sync(0xffffffff, consumer_tid / 128, 0) * 128;
    auto wg_s = mma_s.get_thread_slice(wg_first);
    auto wg_o = mma_o.get_thread_slice(wg_first);
    auto thr_s = mma_s.get_thread_slice(consumer_tid);
    auto thr_o = mma_o.get_thread_slice(consumer_tid);

    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Config::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Config::SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Config::SmemLayoutVt{});
    Tensor tSrQ = wg_s.partition_fragment_A(sQ);   // descriptors
    Tensor tSrK = wg_s.partition_fragment_B(sK);   // (MMA, N, K, stage)
    Tensor tOrV = wg_o.partition_fragment_B(sVt);  // (MMA, H, N, stage)
    Tensor tSrS = partition_fragment_C(mma_s, Shape<BlockM, BlockN>{});
    Tensor tOrO = partition_fragment_C(mma_o, Shape<BlockM, HeadDim>{});
    Tensor tOrP = make_tensor<Element>(partition_shape_A(mma_o, Shape<BlockM, BlockN>{}));
    static_assert(decltype(size(tOrP))::value == decltype(size(tSrS))::value);

    Tensor tScS = thr_s.partition_C(make_identity_tensor(Shape<BlockM, BlockN>{}));
    Tensor tOcO = thr_o.partition_C(make_identity_tensor(Shape<BlockM, HeadDim>{}));
    Tensor s_rc = make_tensor(tSrS.data(), RowColLayout(tSrS.layout()));
    Tensor sc_rc = make_tensor(tScS.data(), RowColLayout(tScS.layout()));
    Tensor o_rc = make_tensor(tOrO.data(), RowColLayout(tOrO.layout()));
    Tensor oc_rc = make_tensor(tOcO.data(), RowColLayout(tOcO.layout()));

    constexpr int kRows = decltype(size<0>(s_rc))::value;
    const SoftmaxScales scales{args.scale, args.scale_log2, args.softcap, args.softcap_in, args.softcap_log2};
    OnlineSoftmax<kRows, kSoftcap, Config::kExp2Poly, Config::kLazyRescale> softmax(scales);
    clear(tOrO);

    const int m0 = tile.m_block * kBlockM;
    // This tile's max_logit: published now, or (kDeferMaxLogit) kept in `carry`
    // until the next tile's first S GEMM is in flight. flush: a share may still
    // be pending (a tile with no key block has no such wait); publish it first.
    auto max_logit = [&](bool flush) {
      if constexpr (Config::kDeferMaxLogit) {
        if (args.max_logit == nullptr) return;
        if (flush) Epilogue<Config>::PublishPending(args, carry);
        carry = Epilogue<Config>::ThreadMaxLogit(args, tile, mask, softmax, oc_rc);
      } else {
        Epilogue<Config>::MaxLogit(args, tile, mask, softmax, oc_rc);
      }
    };
    bool max_logit_done = false;
    if (n_lo < n_hi) {
      smem.barrier_q.wait(static_cast<uint32_t>(q_phase));
      cutlass::NumericArrayConverter<Element, float, 2> convert;
      float correction[kRows];
      // Mask (boundary tiles only) and softmax of the block at key n0. The soft-capped softmax
      // has a select that only masked tiles need, so it comes in two instances; the plain one
      // has none and one instance.
      auto mask_and_update = [&](bool need_mask, int n0) {
        if constexpr (kSoftcap) {
          if (need_mask) {
            mask.template Apply<kBlockN>(args, s_rc, sc_rc, m0, n0);
            softmax.template Update<true>(s_rc, correction);
          } else {
            softmax.template Update<false>(s_rc, correction);
          }
        } else {
          if (need_mask) mask.template Apply<kBlockN>(args, s_rc, sc_rc, m0, n0);
          softmax.template Update<false>(s_rc, correction);
        }
      };
      // Which key blocks need the mask, decided by two compares per block (and the segment
      // summaries, with segment ids) rather than by TileNeedsMask's four rules.
      int clear_lo, clear_hi;
      mask.template UnmaskedKeyBlocks<kBlockM, kBlockN>(m0, &clear_lo, &clear_hi);
      auto needs_mask = [&](int nb) {
        return nb < clear_lo || nb >= clear_hi || mask.template SegmentsNeedMask<kBlockN>(args, nb);
      };
      if constexpr (kVariant == kPlain) {
        // Plain order: S, softmax, PV, one block at a time.
        for (int nb = n_hi - 1; nb >= n_lo; --nb) {
          pipe_k.consumer_wait(state_k);
          IssueGemm<true, false>(mma_s, tSrQ, tSrK(_, _, _, state_k.index()), tSrS);
          warpgroup_wait<0>();
          warpgroup_fence_operand(tSrS);
          pipe_k.consumer_release(state_k);
          const int n0 = nb * kBlockN;
          mask_and_update(needs_mask(nb), n0);
          softmax.Rescale(o_rc, correction);
          ConvertFragment(tSrS, tOrP, convert);
          pipe_v.consumer_wait(state_v);
          IssueGemm<false, true>(mma_o, tOrP, tOrV(_, _, _, state_v.index()), tOrO);
          warpgroup_wait<0>();
          warpgroup_fence_operand(tOrO);
          pipe_v.consumer_release(state_v);
          ++state_k;
          ++state_v;
        }
      } else {
        // Intra-warpgroup overlap: the softmax of block n runs while the
        // tensor cores do P V of block n+1. O is rescaled only after that
        // GEMM has retired, and P is overwritten only then.
        // kPingPong: named barriers 2 + w say "warpgroup w may issue its
        // GEMMs"; each warpgroup waits for its turn, issues, and hands the
        // turn to the other. Warpgroup 1 opens the first turn for warpgroup 0
        // and skips handing over after its last GEMM, so the arrivals on each
        // barrier match its waits.
        // The turns balance within each tile, so a persistent CTA keeps them
        // from tile to tile (fwd_kernel.h).
        constexpr bool kTurns = kVariant == kPingPong;
        const int wg = consumer_tid / 128;
        if constexpr (kTurns) {
          if (wg == 1) NamedBarrierArrive(2, Config::kConsumerThreads);
        }
        int nb = n_hi - 1;
        pipe_k.consumer_wait(state_k);
        if constexpr (kTurns) NamedBarrierSync(2 + wg, Config::kConsumerThreads);
        IssueGemm<true, false>(mma_s, tSrQ, tSrK(_, _, _, state_k.index()), tSrS);
        if constexpr (kTurns) NamedBarrierArrive(3 - wg, Config::kConsumerThreads);
        // Decided while the GEMM runs (with segment ids it reads a summary).
        bool need_mask = needs_mask(nb);
        // The previous tile's max_logit, under this GEMM.
        if constexpr (Config::kDeferMaxLogit) Epilogue<Config>::PublishPending(args, carry);
        warpgroup_wait<0>();
        warpgroup_fence_operand(tSrS);
        pipe_k.consumer_release(state_k);
        ++state_k;
        mask_and_update(need_mask, nb * kBlockN);
        ConvertFragment(tSrS, tOrP, convert);
        for (nb = n_hi - 2; nb >= n_lo; --nb) {
          pipe_k.consumer_wait(state_k);
          pipe_v.consumer_wait(state_v);
          if constexpr (kTurns) NamedBarrierSync(2 + wg, Config::kConsumerThreads);
          IssueGemm<true, false>(mma_s, tSrQ, tSrK(_, _, _, state_k.index()), tSrS);
          IssueGemm<false, true>(mma_o, tOrP, tOrV(_, _, _, state_v.index()), tOrO);
          if constexpr (kTurns) NamedBarrierArrive(3 - wg, Config::kConsumerThreads);
          const int n0 = nb * kBlockN;
          need_mask = needs_mask(nb);
          warpgroup_wait<1>();
          warpgroup_fence_operand(tSrS);
          pipe_k.consumer_release(state_k);
          ++state_k;
          mask_and_update(need_mask, n0);
          warpgroup_wait<0>();
          warpgroup_fence_operand(tOrO);
          warpgroup_fence_operand(tOrP);
          pipe_v.consumer_release(state_v);
          ++state_v;
          softmax.Rescale(o_rc, correction);
          ConvertFragment(tSrS, tOrP, convert);
        }
        pipe_v.consumer_wait(state_v);
        if constexpr (kTurns) NamedBarrierSync(2 + wg, Config::kConsumerThreads);
        IssueGemm<false, true>(mma_o, tOrP, tOrV(_, _, _, state_v.index()), tOrO);
        if constexpr (kTurns) {
          if (wg == 0) NamedBarrierArrive(3, Config::kConsumerThreads);
        }
        // The row maxima are final: max_logit while the last GEMM runs (the
        // previous tile's went out under this tile's first S GEMM).
        max_logit(false);
        max_logit_done = true;
        warpgroup_wait<0>();
        warpgroup_fence_operand(tOrO);
        pipe_v.consumer_release(state_v);
        ++state_v;
      }
      // Q of this tile is no longer read: the producer may load the next one.
      smem.barrier_q_empty.arrive();
    }
    if (!max_logit_done) max_logit(true);
    softmax.Finalize();
    Epilogue<Config>::Store(args, tma_o, smem.o.data(), tile, mask, softmax, tOrO, oc_rc, consumer_tid);
  }
};

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_MAINLOOP_CONSUMER_H_
