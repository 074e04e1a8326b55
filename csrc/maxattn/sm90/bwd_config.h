// maxattn sm90: compile-time configuration of one backward kernel instance at
// head dim 64 or 128, and the backward's run-time arguments (head dim 256 has
// its own tiles: bwd_config_wide.h).
//
// One instance per (head dim 64 or 128, element type, soft cap or not); causal,
// window, padding, segment ids and GQA are run-time arguments, as in the
// forward. A CTA owns kBlockN = 128 keys of one KV head and walks the query
// blocks (kBlockM = 64 rows) that see them, for every query head of its GQA
// group, so dK and dV of the group are summed in registers and written once.
//
// Threads: warpgroup 0 produces (one thread issues the TMA loads: K and V
// once, then Q with its lse and dO with its D = rowsum(dO o O) per step into a
// two-stage pipeline; its warps 1 and 2 add the consumers' dQ into dq_accum:
// bwd_dq_writer.h); warpgroups 1 and 2 consume, each owning 64 of the keys:
//   S^T  = K Q^T, dP^T = V dO^T   (WGMMA, both operands in shared memory; keys
//                                  are the M dimension, so P^T and dS^T land in
//                                  registers in the layout the next GEMMs read)
//   P^T  = exp2(S^T * scale*log2(e) - lse*log2(e)), dS^T = P^T o (dP^T - D)
//   dV  += P^T dO,  dK += dS^T Q   (WGMMA with A from registers)
//   dQ   = dS K                    (dS^T stored to shared memory transposed by
//                                  stmatrix; both operands in shared memory)
// dQ is summed over the CTAs of a query block in an fp32 buffer by bulk
// reductions from shared memory (bwd_dq_writer.h) and converted by a post-pass.
#ifndef MAXATTN_SM90_BWD_CONFIG_H_
#define MAXATTN_SM90_BWD_CONFIG_H_

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "maxattn/sm90/kernel_config.h"

namespace maxattn::sm90 {

constexpr int kBwdBlockM = 64;  // query rows per step, every head dim
// Keys per CTA: 128, or 64 at head dim 256, where the dK and dV accumulators of
// 128 keys would not fit the consumers' registers (bwd_config_wide.h).
constexpr int BwdBlockN(int head_dim) { return head_dim == 256 ? 64 : 128; }
// The deterministic mode keeps one int per query block of a CTA's walk in shared
// memory, past SharedStorage: at most this many query blocks (T <= 384,000),
// which fits next to both instances' storage (the dQ staging slices included).
constexpr int kBwdMaxOrderedQueryBlocks = 6000;

// Turn counters of the deterministic mode per (batch, query head, query block):
// one (bwd_dq_order.h's turns count both warpgroups), or at head dim 256 one
// per (consumer warpgroup, dQ column half), whose adds are disjoint
// (bwd_mainloop_consumer_wide.h).
constexpr int BwdTurnCounters(int head_dim) { return head_dim == 256 ? 4 : 1; }

// Whether the backward has kernels for this head dim.
constexpr bool BwdSupportsHeadDim(int head_dim) { return head_dim == 64 || head_dim == 128 || head_dim == 256; }

template <int kHeadDim_, class Element_, bool kSoftcap_ = false>
struct BwdConfig {
  using Element = Element_;
  static constexpr bool kSoftcap = kSoftcap_;
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head dim 256: BwdWideConfig");

  static constexpr int kBlockM = kBwdBlockM;
  static constexpr int kBlockN = BwdBlockN(kHeadDim);
  static constexpr int kStages = 2;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  // dQ = dS K over the CTA's 128 keys: at H = 128 the two warpgroups split the
  // head dim (each 64 columns, after a barrier, since each needs the other's
  // dS); at H = 64 a 32-column half would not be a whole swizzle atom, so each
  // warpgroup multiplies its own 64 keys and both add their partial dQ.
  static constexpr bool kDqSplitKeys = kHeadDim == 64;
  // dq_accum slices per query block (bwd_epilogue.h): one per warpgroup at H = 128, one shared at H = 64.
  static constexpr int kDqSlices = kDqSplitKeys ? 1 : kConsumerWarpgroups;
  // dQ goes through a staging slice and a writer warp (false: added from registers, bwd_config_wide.h).
  static constexpr bool kDqFromRegisters = false;

  using BlockM = cute::Int<kBlockM>;
  using BlockN = cute::Int<kBlockN>;
  using HalfN = cute::Int<kBlockN / 2>;
  using HeadDim = cute::Int<kHeadDim>;
  using Stages = cute::Int<kStages>;

  // S^T and dP^T: M = keys (64 per warpgroup), N = queries, K = head dim.
  using TiledMmaSdP = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, cute::Shape<HalfN, BlockM, HeadDim>>(),
      cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
  // dV and dK: M = keys (64 per warpgroup), N = head dim, K = queries; A (P^T
  // or dS^T) from registers, B (dO^T or Q^T) read MN-major from shared memory.
  using MmadKVAtom = decltype(cute::GMMA::rs_op_selector<Element, Element, float, cute::Shape<HalfN, HeadDim, BlockM>,
                                                         cute::GMMA::Major::K, cute::GMMA::Major::MN>());
  using TiledMmadKV =
      decltype(cute::make_tiled_mma(MmadKVAtom{}, cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
  // One warpgroup's share of dK and dV: the thread layout of their stmatrix staging (bwd_epilogue.h;
  // sm90_layout_check emulates the instruction on these views).
  using TiledMmadKVWarpgroup = decltype(cute::make_tiled_mma(MmadKVAtom{}));
  using CopyAtomdKVStaging = cute::Copy_Atom<cute::SM90_U32x4_STSM_N, Element>;
  // dQ: M = queries, N = head dim, K = keys; A = dS (K-major), B = K^T (MN-major).
  using DqAtomShape = std::conditional_t<kDqSplitKeys, cute::Shape<BlockM, HeadDim, HalfN>,
                                         cute::Shape<BlockM, cute::Int<kHeadDim / 2>, BlockN>>;
  using DqWarpgroups = std::conditional_t<kDqSplitKeys, cute::Layout<cute::Shape<cute::_1, cute::_1, cute::_1>>,
                                          cute::Layout<cute::Shape<cute::_1, cute::_2, cute::_1>>>;
  using TiledMmadQ = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, DqAtomShape, cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
      DqWarpgroups{}));

  // Shared memory: 128-byte swizzled tiles with the last dimension contiguous,
  // as TMA writes them (Q, dO, K, V: head dim; dS: keys); the transposed views
  // (Q^T, dO^T, K^T) are the MN-major operands of the dK, dV and dQ GEMMs.
  using SwizzleAtom = cute::GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ = decltype(cute::tile_to_shape(SwizzleAtom{}, cute::Shape<BlockM, HeadDim, Stages>{}));
  using SmemLayoutdO = SmemLayoutQ;
  using SmemLayoutK = decltype(cute::tile_to_shape(SwizzleAtom{}, cute::Shape<BlockN, HeadDim>{}));
  using SmemLayoutV = SmemLayoutK;
  using SmemLayoutdS = decltype(cute::tile_to_shape(SwizzleAtom{}, cute::Shape<BlockM, BlockN, cute::_2>{}));
  using SmemLayoutQt = decltype(cute::composition(
      SmemLayoutQ{}, cute::make_ordered_layout(cute::Shape<HeadDim, BlockM, Stages>{},
                                               cute::Step<cute::_2, cute::_1, cute::_3>{})));
  using SmemLayoutdOt = SmemLayoutQt;
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutK{}, cute::make_ordered_layout(cute::Shape<HeadDim, BlockN>{}, cute::Step<cute::_2, cute::_1>{})));
  using SmemLayoutdSt = decltype(cute::composition(
      SmemLayoutdS{}, cute::make_ordered_layout(cute::Shape<BlockN, BlockM, cute::_2>{},
                                                cute::Step<cute::_2, cute::_1, cute::_3>{})));
  // kDqSplitKeys: one warpgroup's 64 keys of dS (one buffer) and of K^T; a
  // whole swizzle atom column, so the slice starts at a multiple of 1024 bytes.
  using SmemLayoutdSHalf = decltype(cute::tile_to_shape(SwizzleAtom{}, cute::Shape<BlockM, HalfN>{}));
  using SmemLayoutKHalf = decltype(cute::tile_to_shape(SwizzleAtom{}, cute::Shape<HalfN, HeadDim>{}));
  using SmemLayoutKtHalf = decltype(cute::composition(
      SmemLayoutKHalf{}, cute::make_ordered_layout(cute::Shape<HeadDim, HalfN>{}, cute::Step<cute::_2, cute::_1>{})));

  // dK and dV leave by TMA (bwd_epilogue.h, StoreDkDv): each consumer warpgroup stages its
  // kBlockN / 2 keys of each, swizzled as the operand tiles, in its half of a released Q (dV) and
  // dO (dK) region.
  static constexpr bool kTmaStoreDkDv = true;
  using SmemLayoutdKVHalf = decltype(cute::tile_to_shape(SwizzleAtom{}, cute::Shape<HalfN, HeadDim>{}));
  static constexpr int kSmemdKVHalfElems = cute::cosize_v<SmemLayoutdKVHalf>;
  static_assert(kConsumerWarpgroups * kSmemdKVHalfElems <= cute::cosize_v<SmemLayoutQ>, "staging fits a Q region");

  // One consumer warpgroup's dQ fragment: 64 x 64 fp32 (at H = 128 its column
  // half, at H = 64 its partial sum over its keys), staged for the bulk reduction.
  static constexpr int kDqSliceFloats = kBlockM * kHeadDim / kDqSlices;
  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesKV = kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesRowStats = kBlockM * sizeof(float);  // lse or D of one query block

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename Pipeline::PipelineState;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutdO>> dout;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutV>> v;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutdS>> ds;
    alignas(128) float dq[kConsumerWarpgroups][kDqSliceFloats];  // bwd_epilogue.h: staged dQ fragments
    alignas(128) float lse_log2[kStages][kBlockM];  // with Q
    alignas(128) float dpsum[kStages][kBlockM];     // D - dlse, with dO
    alignas(16) typename Pipeline::SharedStorage pipe_q;
    alignas(16) typename Pipeline::SharedStorage pipe_do;
    // K and V of the CTA's key block, on barriers of their own: the first S^T needs only K.
    alignas(8) cutlass::arch::ClusterTransactionBarrier barrier_k;
    alignas(8) cutlass::arch::ClusterTransactionBarrier barrier_v;
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
  // With the deterministic mode's turn table (bwd_dq_order.h): one int per query block, and one more.
  static constexpr int SmemBytes(bool ordered, int num_m_blocks) {
    return kSmemBytes + (ordered ? (num_m_blocks + 1) * static_cast<int>(sizeof(int)) : 0);
  }
  static_assert(SmemBytes(true, kBwdMaxOrderedQueryBlocks) <= 227 * 1024, "shared memory budget of one SM90 CTA");

  using GmemTensor = GmemTensorOf<Element>;
  using TmaQ = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{},
                                            cute::take<0, 2>(SmemLayoutQ{}),
                                            cute::Shape<BlockM, HeadDim>{}, cute::_1{}));
  using TmaKV = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutK{},
                                             cute::Shape<BlockN, HeadDim>{}, cute::_1{}));
  using TmadKV = decltype(cute::make_tma_copy(cute::SM90_TMA_STORE{}, GmemOutTensorOf<Element>{}, SmemLayoutdKVHalf{},
                                              cute::Shape<HalfN, HeadDim>{}, cute::_1{}));
};

// Named barriers of the backward (0 is __syncthreads): kBwdBarrierDs (256
// consumer threads: both warpgroups' dS are in shared memory; also the set-up
// of the deterministic mode's turns and the dK/dV staging), with kDqSplitKeys
// kBwdBarrierDsWarpgroup + w (128 threads: warpgroup w's are); the dQ
// hand-over between consumer warpgroup w and its dQ writer warp
// (bwd_dq_writer.h), 160 threads each: kBwdBarrierDqFull + w (w's slice is
// staged: the warpgroup arrives, the writer waits) and kBwdBarrierDqEmpty + w
// (the slice has been read: the writer arrives, the warpgroup waits before
// staging the next one).
constexpr int kBwdBarrierDs = 1;
constexpr int kBwdBarrierDsWarpgroup = 2;
constexpr int kBwdBarrierDqFull = 4;
constexpr int kBwdBarrierDqEmpty = 6;
constexpr int kBwdDqHandoverThreads = 128 + 32;

// Run-time arguments of the backward instances.
struct BwdArgs : ProblemArgs {
  float* dq_accum = nullptr;        // [B, N, num_m_blocks, kBlockM * H] fp32 tiles in fragment order
                                    // (bwd_epilogue.h), zeroed by the pre-pass
  void* dq = nullptr;               // [B, T, N, H]: written by the post-pass
  const float* lse_log2 = nullptr;  // [B, N, t_pad]: lse * log2(e); +inf for rows with no probability
  const float* dpsum = nullptr;     // [B, N, t_pad]: rowsum(dO o O) - dlse (0 past T)
  void* dk = nullptr;               // [B, S, K, H]
  void* dv = nullptr;               // [B, S, K, H]
  int t_pad = 0;                    // num_m_blocks * kBwdBlockM
  // Deterministic mode (bwd_dq_order.h): BwdTurnCounters(H) turn counters per
  // (b, query head, query block), [B, N, num_m_blocks, BwdTurnCounters(H)]
  // zeroed before the kernel. Null: dQ tiles are added in whatever order the
  // CTAs get there.
  int* dq_turns = nullptr;
  // (KV head, batch) rows per L2 section of the longest-first launch order
  // (BwdStaticScheduler::LongestFirst, tile_scheduler.h); 0: key blocks fastest
  // per row. Set by LaunchBackward.
  int section_rows = 0;
};

template <class Config>
struct BwdParams {
  typename Config::TmaQ tma_q;
  typename Config::TmaQ tma_do;
  typename Config::TmaKV tma_k;
  typename Config::TmaKV tma_v;
  typename Config::TmadKV tma_dk;  // set when Config::kTmaStoreDkDv
  typename Config::TmadKV tma_dv;
  BwdArgs args;
};

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_BWD_CONFIG_H_
