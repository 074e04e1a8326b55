// maxattn sm90: compile-time configuration of the backward at head dim 256
// (one instance per element type and soft cap; masks, padding, segment ids,
// sinks and GQA are run-time arguments, as in bwd_config.h).
//
// At H = 128 a consumer warpgroup owns 64 keys and keeps their dK and dV
// (64 x 128 fp32 each) in registers. At H = 256 those would be 256 registers
// per thread, so here a CTA owns kBlockN = 64 keys and the two consumer
// warpgroups share them, splitting the work of a step of kBlockM = 64 queries
// two ways (warpgroup w = 0, 1):
//   S^T  = K Q_w^T, dP^T = V dO_w^T   (M = the 64 keys, N = w's 32 queries,
//                                     K = 256; both operands in shared memory)
//   P^T, dS^T of w's queries in registers, as at H = 128 (no fp32 exchange
//   between the warpgroups), stored to shared memory as the element type
//   (keys x queries, queries contiguous; two buffers, one barrier per step)
//   dV[:, w half] += P^T dO[:, w half]  (M = keys, N = 128 columns, K = 64
//   dK[:, w half] += dS^T Q[:, w half]   queries; A = P^T or dS^T read from
//                                        shared memory, K-major)
//   dQ = dS K, two GEMMs of 128 columns (M = queries, N = 64 per warpgroup,
//                                        K = keys; A = dS read MN-major from
//                                        dS^T)
// so each warpgroup holds 64 + 64 fp32 registers of dK and dV, and 32 of dQ
// at a time. Shared memory: Q and dO two stages of 32 KB each, K and V 32 KB
// each, P^T and dS^T two buffers of 8 KB each: 224 KB of the 227. No room is
// left for a dQ staging slice (32 KB per warpgroup), so each consumer thread
// adds its dQ fragment into dq_accum itself, by 16-byte vector reductions
// (red.global.add.v4.f32) in the fragment order of bwd_epilogue.h: a warp's
// instruction covers 512 contiguous bytes, whole lines in L2. Nor for the
// deterministic mode's turn table (bwd_dq_order.h): here each consumer
// warpgroup counts its turn per step (EarlierWalksThrough) and waits for it
// itself, with one counter per (warpgroup, dQ column half).
#ifndef MAXATTN_SM90_BWD_CONFIG_WIDE_H_
#define MAXATTN_SM90_BWD_CONFIG_WIDE_H_

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "maxattn/sm90/bwd_config.h"
#include "maxattn/sm90/kernel_config.h"

namespace maxattn::sm90 {

template <class Element_, bool kSoftcap_ = false>
struct BwdWideConfig {
  using Element = Element_;
  static constexpr bool kSoftcap = kSoftcap_;
  static constexpr int kHeadDim = 256;

  static constexpr int kBlockM = kBwdBlockM;
  static constexpr int kBlockN = BwdBlockN(kHeadDim);
  static_assert(kBlockM == 64 && kBlockN == 64, "the GEMM plan above");
  static constexpr int kStages = 2;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static constexpr bool kDqSplitKeys = false;  // the warpgroups split dQ's columns
  static constexpr int kDqSlices = kConsumerWarpgroups;
  static constexpr bool kDqFromRegisters = true;
  // dK and dV are stored by all consumer threads (bwd_epilogue.h, StoreDkDvByThreads): no TMA descriptor.
  static constexpr bool kTmaStoreDkDv = false;
  struct TmadKV {};
  static constexpr int kDqSliceFloats = kBlockM * kHeadDim / kDqSlices;  // 64 x 128 fp32 per warpgroup
  static constexpr int kTurnCounters = BwdTurnCounters(kHeadDim);  // per (warpgroup, column half)
  static_assert(kTurnCounters == kConsumerWarpgroups * 2);

  using BlockM = cute::Int<kBlockM>;
  using BlockN = cute::Int<kBlockN>;
  using HalfM = cute::Int<kBlockM / 2>;
  using HalfH = cute::Int<kHeadDim / 2>;
  using HeadDim = cute::Int<kHeadDim>;
  using Stages = cute::Int<kStages>;
  using Buffers = cute::_2;
  using SplitN = cute::Layout<cute::Shape<cute::_1, cute::_2, cute::_1>>;  // warpgroups side by side in N

  // S^T and dP^T: M = keys, N = queries (32 per warpgroup), K = head dim.
  using TiledMmaSdP = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<BlockN, HalfM, HeadDim>>(), SplitN{}));
  // dV and dK: M = keys, N = head dim (128 per warpgroup), K = queries; A (P^T
  // or dS^T) K-major, B (dO^T or Q^T) MN-major, both from shared memory.
  using TiledMmadKV = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<BlockN, HalfH, BlockM>, cute::GMMA::Major::K,
                                 cute::GMMA::Major::MN>(),
      SplitN{}));
  // dQ: M = queries, N = head dim, K = keys; A = dS and B = K^T, both MN-major.
  // Two GEMMs per step, one per 128-column half h of the head dim, in which
  // warpgroup w owns columns 128 h + 64 w ... + 63: a warpgroup holds 32 fp32
  // registers of dQ at a time, not 64 (with 64, next to dK and dV, ptxas
  // spilled and serialised the WGMMAs). Over the whole H the MMA's C partition
  // is (values, 1, h), which is also how the post-pass maps dq_accum back.
  using TiledMmadQ = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<BlockM, cute::_64, BlockN>,
                                 cute::GMMA::Major::MN, cute::GMMA::Major::MN>(),
      SplitN{}));

  // Shared memory: 128-byte swizzled tiles with the last mode contiguous (Q,
  // dO, K, V: head dim, as TMA writes them; P^T and dS^T: queries); the
  // transposed views are the MN-major operands.
  using SwizzleAtom = cute::GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ = decltype(cute::tile_to_shape(SwizzleAtom{}, cute::Shape<BlockM, HeadDim, Stages>{}));
  using SmemLayoutdO = SmemLayoutQ;
  using SmemLayoutK = decltype(cute::tile_to_shape(SwizzleAtom{}, cute::Shape<BlockN, HeadDim>{}));
  using SmemLayoutV = SmemLayoutK;
  using SmemLayoutQt = decltype(cute::composition(
      SmemLayoutQ{}, cute::make_ordered_layout(cute::Shape<HeadDim, BlockM, Stages>{},
                                               cute::Step<cute::_2, cute::_1, cute::_3>{})));
  using SmemLayoutdOt = SmemLayoutQt;
  // K^T of one 128-column half of the head dim: 64 keys x 128 columns of K
  // start at half * 8192 elements (whole swizzle-atom columns).
  using SmemLayoutKHalfH = decltype(cute::tile_to_shape(SwizzleAtom{}, cute::Shape<BlockN, HalfH>{}));
  using SmemLayoutKtHalfH = decltype(cute::composition(
      SmemLayoutKHalfH{}, cute::make_ordered_layout(cute::Shape<HalfH, BlockN>{}, cute::Step<cute::_2, cute::_1>{})));
  // P^T and dS^T: (key, query, buffer); dS is the (query, key, buffer) view of dS^T's buffers.
  using SmemLayoutPt = decltype(cute::tile_to_shape(SwizzleAtom{}, cute::Shape<BlockN, BlockM, Buffers>{}));
  using SmemLayoutdSt = SmemLayoutPt;
  using SmemLayoutdS = decltype(cute::composition(
      SmemLayoutdSt{}, cute::make_ordered_layout(cute::Shape<BlockM, BlockN, Buffers>{},
                                                 cute::Step<cute::_2, cute::_1, cute::_3>{})));

  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesKV = kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesRowStats = kBlockM * sizeof(float);

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename Pipeline::PipelineState;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutdO>> dout;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutV>> v;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutPt>> pt;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutdSt>> dst;
    alignas(128) float lse_log2[kStages][kBlockM];  // with Q
    alignas(128) float dpsum[kStages][kBlockM];     // D - dlse, with dO
    int turn_partial[kConsumerWarpgroups][4];       // deterministic mode: a warp's share of its warpgroup's turn
    alignas(16) typename Pipeline::SharedStorage pipe_q;
    alignas(16) typename Pipeline::SharedStorage pipe_do;
    // K and V of the CTA's key block, on barriers of their own: the first S^T needs only K.
    alignas(8) cutlass::arch::ClusterTransactionBarrier barrier_k;
    alignas(8) cutlass::arch::ClusterTransactionBarrier barrier_v;
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
  // No turn table: the deterministic mode counts each turn when it needs it.
  static constexpr int SmemBytes(bool /*ordered*/, int /*num_m_blocks*/) { return kSmemBytes; }
  static_assert(kSmemBytes <= 227 * 1024, "shared memory budget of one SM90 CTA");

  using GmemTensor = GmemTensorOf<Element>;
  using TmaQ = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{},
                                            cute::take<0, 2>(SmemLayoutQ{}),
                                            cute::Shape<BlockM, HeadDim>{}, cute::_1{}));
  using TmaKV = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutK{},
                                             cute::Shape<BlockN, HeadDim>{}, cute::_1{}));
};

// Named barrier of consumer warpgroup w's turn in the deterministic mode (128
// threads): the ids of the head-dim-64/128 kernels' dQ hand-over to their
// writer warps, which this kernel does not have.
constexpr int kBwdBarrierWideTurn = kBwdBarrierDqFull;

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_BWD_CONFIG_WIDE_H_
