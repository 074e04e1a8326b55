// maxattn sm90: compile-time configuration of one forward kernel instance.
//
// One instance per (head dim, element type, soft cap or not). Everything else
// (causal, alignment, window, padding lengths, segment ids, lse / max_logit
// requested) is a run-time argument, so the whole backend is twelve kernels.
//
// Threads: warpgroup 0 is the producer (one elected thread issues TMA loads);
// warpgroups 1 and 2 are consumers, each owning 64 of the tile's 128 query
// rows, running WGMMA for S = Q K^T (both operands in shared memory) and
// O += P V (P from registers, V from shared memory read MN-major).
#ifndef MAXATTN_SM90_KERNEL_CONFIG_H_
#define MAXATTN_SM90_KERNEL_CONFIG_H_

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
// The 64 x 80 atom (FwdScoreAtom); after cute/tensor.hpp, which declares what these headers use.
#include <cute/arch/mma_sm90_gmma_ext.hpp>
#include <cute/atom/mma_traits_sm90_gmma_ext.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "maxattn/sm90/segments.h"

namespace maxattn::sm90 {

// Consumer loop variants: kPlain (S, softmax, PV in order), kOverlap (the
// softmax of one key block overlaps P V of the previous), kPingPong (kOverlap,
// and the two consumer warpgroups take turns issuing their GEMMs),
// kPersistent / kPersistentPingPong (kOverlap / kPingPong in a persistent CTA
// that takes its tiles one after another from a global counter,
// tile_scheduler.h). Instantiated: ForwardVariant(head dim, soft cap) below, one
// loop per (head dim, soft cap); the others passed the harness but were slower, so
// they are not compiled (see NOTES.md).
enum ConsumerVariant : int { kPlain = 0, kOverlap = 1, kPingPong = 2, kPersistent = 3, kPersistentPingPong = 4 };

constexpr bool IsPersistent(int variant) { return variant == kPersistent || variant == kPersistentPingPong; }

// The loop of each forward instance (NOTES.md has the measurements):
// - persistent overlap without a soft cap at every head dim: at H=128 the fastest on
//   every row; at H=64 11% faster than the static grid (persistent ping-pong 4% behind
//   it), at H=256 9% faster (H100, "Eighth session");
// - with a soft cap, persistent ping-pong at H=128, where the two MUFU ops per score
//   entry make the softmax longer than a warpgroup's GEMMs and the turns keep the
//   tensor cores fed (11% faster than overlap on an H100); persistent overlap at H=64
//   and H=256, 11% and 9% faster than the static-grid overlap loop (persistent
//   ping-pong: 3-4% and 2% faster than static; H100, "Ninth session").
// -DMAXATTN_SM90_H<64|128|256>[_SOFTCAP]_VARIANT=n overrides one for experiments.
#ifndef MAXATTN_SM90_H64_VARIANT
#define MAXATTN_SM90_H64_VARIANT kPersistent
#endif
#ifndef MAXATTN_SM90_H64_SOFTCAP_VARIANT
#define MAXATTN_SM90_H64_SOFTCAP_VARIANT kPersistent
#endif
#ifndef MAXATTN_SM90_H128_VARIANT
#define MAXATTN_SM90_H128_VARIANT kPersistent
#endif
#ifndef MAXATTN_SM90_H128_SOFTCAP_VARIANT
#define MAXATTN_SM90_H128_SOFTCAP_VARIANT kPersistentPingPong
#endif
#ifndef MAXATTN_SM90_H256_VARIANT
#define MAXATTN_SM90_H256_VARIANT kPersistent
#endif
#ifndef MAXATTN_SM90_H256_SOFTCAP_VARIANT
#define MAXATTN_SM90_H256_SOFTCAP_VARIANT kPersistent
#endif
constexpr int ForwardVariant(int head_dim, bool softcap) {
  if (head_dim == 64) return softcap ? MAXATTN_SM90_H64_SOFTCAP_VARIANT : MAXATTN_SM90_H64_VARIANT;
  if (head_dim == 128) return softcap ? MAXATTN_SM90_H128_SOFTCAP_VARIANT : MAXATTN_SM90_H128_VARIANT;
  return softcap ? MAXATTN_SM90_H256_SOFTCAP_VARIANT : MAXATTN_SM90_H256_VARIANT;
}

// How many of every 4 columns of a thread's score tile the forward's softmax exponentiates on the
// FMA pipe (Exp2Poly, softmax.h) instead of the MUFU unit, per instance. A soft cap adds a second
// MUFU op per score entry (tanh): at H=128, 2 of 4 on the FMA pipe are 3.0-3.7% faster on all four
// timed rows (ncu, H100, "Ninth session"); at H=64 and H=256 they are 4% and 6% slower (at H=64 the
// FMA pipe is the busier one already). Without a cap, 1 of 4 cost 7-10% (H200, 2026-12-04).
// -DMAXATTN_SM90_H<64|128|256>[_SOFTCAP]_EXP2_POLY=n overrides one for experiments.
#ifndef MAXATTN_SM90_H64_EXP2_POLY
#define MAXATTN_SM90_H64_EXP2_POLY 0
#endif
#ifndef MAXATTN_SM90_H64_SOFTCAP_EXP2_POLY
#define MAXATTN_SM90_H64_SOFTCAP_EXP2_POLY 0
#endif
#ifndef MAXATTN_SM90_H128_EXP2_POLY
#define MAXATTN_SM90_H128_EXP2_POLY 0
#endif
#ifndef MAXATTN_SM90_H128_SOFTCAP_EXP2_POLY
#define MAXATTN_SM90_H128_SOFTCAP_EXP2_POLY 2
#endif
#ifndef MAXATTN_SM90_H256_EXP2_POLY
#define MAXATTN_SM90_H256_EXP2_POLY 0
#endif
#ifndef MAXATTN_SM90_H256_SOFTCAP_EXP2_POLY
#define MAXATTN_SM90_H256_SOFTCAP_EXP2_POLY 0
#endif
constexpr int ForwardExp2Poly(int head_dim, bool softcap) {
  if (head_dim == 64) return softcap ? MAXATTN_SM90_H64_SOFTCAP_EXP2_POLY : MAXATTN_SM90_H64_EXP2_POLY;
  if (head_dim == 128) return softcap ? MAXATTN_SM90_H128_SOFTCAP_EXP2_POLY : MAXATTN_SM90_H128_EXP2_POLY;
  return softcap ? MAXATTN_SM90_H256_SOFTCAP_EXP2_POLY : MAXATTN_SM90_H256_EXP2_POLY;
}

// Persistent forwards: publish a tile's max_logit (the warp's shuffles, vote and atomic) while the
// CTA's next tile waits for its first S = Q K^T, instead of under the tile's last P V GEMM, which at
// H = 64 is too short to hide them (max_logit cost +0.8% there, ncu, "Seventeenth session"). Each
// consumer thread carries its unreduced share (three registers) from one tile to the next; the last
// share is published when the CTA runs out of tiles. Not at H = 256, where those registers raise the
// consumers' spills from 24/28 to 58/64 bytes (stores/loads). An experiment, off by default until
// timed: -DMAXATTN_SM90_DEFER_MAX_LOGIT=1 (with it off every instance's SASS is main's, byte for byte).
#ifndef MAXATTN_SM90_DEFER_MAX_LOGIT
#define MAXATTN_SM90_DEFER_MAX_LOGIT 0
#endif

// The forward's online softmax moves a row's exponent offset only when the row maximum has grown
// past it by more than 2^8 (softmax.h, kLazyRescaleLog2), so that most key blocks skip the rescale
// of O (one multiply per accumulator element: 64 per thread and key block at H = 128, ~13% of the
// loop's instructions) and the exponent of the correction. Not at H = 256 (spills 24/28 -> 44/60
// bytes). Off by default until timed: -DMAXATTN_SM90_LAZY_RESCALE=1 (with it off every instance's
// SASS is main's, byte for byte).
#ifndef MAXATTN_SM90_LAZY_RESCALE
#define MAXATTN_SM90_LAZY_RESCALE 0
#endif

// Whether a kernel for a head dim (with or without a soft cap) takes its tiles from FwdArgs::tile_counter.
constexpr bool UsesTileCounter(int head_dim) {
  return IsPersistent(ForwardVariant(head_dim, false)) || IsPersistent(ForwardVariant(head_dim, true));
}

// Keys per tile for a head dim (the host sizes the segment summaries with it). Head dim 256 takes
// 80, as FlashAttention-3 does: two K/V stages of 40 KB each still fit next to Q's 64 KB (H = 256
// stores O from registers), and a tile's fixed work per key block (O rescale, row reductions,
// pipeline hand-overs) covers 1.25x the keys of 64.
constexpr int KeyBlockSize(int head_dim) { return head_dim <= 128 ? 128 : 80; }
constexpr int kQueryBlockSize = 128;

// S = Q K^T's WGMMA atom for one warpgroup's 64 queries against kBlockN keys: CuTe's selector,
// except at 80 keys (head dim 256), which it serves only under CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
// (which would widen its choice for every other shape too); without it, it splits such a block
// into 64 x 16 atoms, each reading the Q tile from shared memory again. So 80 names its atom.
template <class Element, int kBlockN, int kHeadDim>
struct FwdScoreAtom {
  using type = decltype(cute::GMMA::ss_op_selector<Element, Element, float,
                                                   cute::Shape<cute::_64, cute::Int<kBlockN>, cute::Int<kHeadDim>>>());
};
template <class Element, int kHeadDim>
struct FwdScoreAtom<Element, 80, kHeadDim> {
  using type = std::conditional_t<
      std::is_same_v<Element, cutlass::bfloat16_t>,
      cute::SM90::GMMA::MMA_64x80x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::K>,
      cute::SM90::GMMA::MMA_64x80x16_F32F16F16_SS<cute::GMMA::Major::K, cute::GMMA::Major::K>>;
};

// Global tensors seen by TMA: (sequence, head dim, head, batch), head dim contiguous.
using GmemLayout = cute::Layout<cute::Shape<int32_t, int32_t, int32_t, int32_t>,
                                cute::Stride<int64_t, cute::_1, int64_t, int64_t>>;
// The GmemLayout of a [batch, len, heads, head_dim] array.
inline GmemLayout MakeGmemLayout(int len, int head_dim, int heads, int batch) {
  const int64_t row = static_cast<int64_t>(heads) * head_dim;
  return GmemLayout(cute::make_shape(len, head_dim, heads, batch),
                    cute::make_stride(row, cute::_1{}, int64_t{head_dim}, row * len));
}
template <class Element>
using GmemTensorOf =
    decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}));
template <class Element>
using GmemOutTensorOf = decltype(cute::make_tensor(cute::make_gmem_ptr(static_cast<Element*>(nullptr)), GmemLayout{}));

// Named barriers of the forward (barrier.h): the ping-pong turns 2 + w, the out staging of
// consumer warpgroup w kFwdBarrierOut + w.
constexpr int kFwdBarrierOut = 4;

// One tile of the forward: a query block of one (head, batch) row, as the
// schedulers of tile_scheduler.h hand them out.
struct Tile {
  int m_block;
  int head;
  int kv_head;
  int batch;
};

// A persistent CTA's next tile as its producer thread hands it to the consumers
// (fwd_kernel.h): the sequence index (>= num_tiles: none left), and for a tile
// the tile itself and its key-block range [n_lo, n_hi), decoded once by the
// producer rather than again by every consumer thread (a tile's decode is four
// integer divisions by run-time values, on the consumers' path into the tile).
struct TileSlot {
  int index;
  int n_lo;
  int n_hi;
  int unused;
  Tile tile;
};

// kSoftcap_: the logit soft cap's softmax (softmax.h). Its own instance, so
// that the plain kernel keeps its registers (one kernel with both loops
// spilled at H=128).
template <int kHeadDim_, class Element_, int kVariant_ = kOverlap, bool kSoftcap_ = false>
struct FwdConfig {
  using Element = Element_;
  static constexpr int kVariant = kVariant_;
  static constexpr bool kSoftcap = kSoftcap_;
  static constexpr bool kPersistentGrid = IsPersistent(kVariant);
  static constexpr bool kDeferMaxLogit = kPersistentGrid && kHeadDim_ <= 128 && MAXATTN_SM90_DEFER_MAX_LOGIT != 0;
  static constexpr bool kLazyRescale = kHeadDim_ <= 128 && MAXATTN_SM90_LAZY_RESCALE != 0;
  // The loop each tile runs.
  static constexpr int kTileLoop = kVariant == kPersistent ? kOverlap
                                   : kVariant == kPersistentPingPong ? kPingPong : kVariant;
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head dim 64, 128 or 256");
  static constexpr int kExp2Poly = ForwardExp2Poly(kHeadDim, kSoftcap);

  static constexpr int kBlockM = kQueryBlockSize;
  static constexpr int kBlockN = KeyBlockSize(kHeadDim);
  static constexpr int kStages = kHeadDim <= 64 ? 4 : 2;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;

  using BlockM = cute::Int<kBlockM>;
  using BlockN = cute::Int<kBlockN>;
  using HeadDim = cute::Int<kHeadDim>;
  using Stages = cute::Int<kStages>;

  // Warpgroups tile the M (query) dimension; each runs 64-row atoms.
  using WarpgroupLayout = cute::Layout<cute::Shape<cute::Int<kConsumerWarpgroups>, cute::_1, cute::_1>>;
  static_assert(kBlockM / kConsumerWarpgroups == 64, "one 64-row WGMMA atom per warpgroup");
  using TiledMmaS =
      decltype(cute::make_tiled_mma(typename FwdScoreAtom<Element, kBlockN, kHeadDim>::type{}, WarpgroupLayout{}));
  // P V's WGMMA atom: P from registers, V read MN-major from shared memory.
  using MmaOAtom = decltype(cute::GMMA::rs_op_selector<
                            Element, Element, float,
                            cute::Shape<cute::Int<kBlockM / kConsumerWarpgroups>, HeadDim, BlockN>,
                            cute::GMMA::Major::K, cute::GMMA::Major::MN>());
  using TiledMmaO = decltype(cute::make_tiled_mma(MmaOAtom{}, WarpgroupLayout{}));

  // One warpgroup's share of P V: the thread layout of the out tile's stmatrix staging (epilogue.h;
  // sm90_layout_check emulates the instruction on these views).
  using TiledMmaOWarpgroup = decltype(cute::make_tiled_mma(MmaOAtom{}));
  using CopyAtomOStaging = cute::Copy_Atom<cute::SM90_U32x4_STSM_N, Element>;

  // Shared memory: 128-byte swizzled K-major tiles (head dim contiguous), as TMA
  // writes them; V is read through a transposed (MN-major) view for P V.
  using SwizzleAtom = cute::GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ = decltype(cute::tile_to_shape(SwizzleAtom{}, cute::Shape<BlockM, HeadDim>{}));
  using SmemLayoutK = decltype(cute::tile_to_shape(SwizzleAtom{}, cute::Shape<BlockN, HeadDim, Stages>{}));
  using SmemLayoutV = SmemLayoutK;
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutV{}, cute::make_ordered_layout(cute::Shape<HeadDim, BlockN, Stages>{},
                                               cute::Step<cute::_2, cute::_1, cute::_3>{})));

  // Persistent grids stage the normalised O in shared memory and store it by TMA, one 64-row
  // half per consumer warpgroup (epilogue.h); the others store from registers, and so does
  // H=256, whose 64 KB of staging do not fit next to Q (64 KB) and the K/V stages (128 KB).
  static constexpr bool kTmaStoreOut = kPersistentGrid && kHeadDim <= 128;
  using WarpgroupRows = cute::Int<kBlockM / kConsumerWarpgroups>;
  using SmemLayoutOHalf = decltype(cute::tile_to_shape(SwizzleAtom{}, cute::Shape<WarpgroupRows, HeadDim>{}));
  static constexpr int kSmemOHalfElems = cute::cosize_v<SmemLayoutOHalf>;
  static constexpr int kSmemOElems = kTmaStoreOut ? kConsumerWarpgroups * kSmemOHalfElems : 8;

  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesKV = kBlockN * kHeadDim * sizeof(Element);

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename Pipeline::PipelineState;
  // Persistent grids: the producer thread hands each tile index to the
  // consumers through two shared-memory slots.
  using TilePipeline = cutlass::PipelineAsync<2>;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutV>> v;
    alignas(1024) cute::array_aligned<Element, kSmemOElems> o;
    alignas(16) typename Pipeline::SharedStorage pipe_k;
    alignas(16) typename Pipeline::SharedStorage pipe_v;
    alignas(8) cutlass::arch::ClusterTransactionBarrier barrier_q;
    alignas(8) cutlass::arch::ClusterBarrier barrier_q_empty;
    alignas(16) typename TilePipeline::SharedStorage pipe_tile;
    alignas(16) TileSlot tile_slot[2];
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "shared memory budget of one SM90 CTA");

  using GmemTensor = GmemTensorOf<Element>;
  using TmaQ = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQ{},
                                            cute::Shape<BlockM, HeadDim>{}, cute::_1{}));
  using TmaKV = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{},
                                             cute::take<0, 2>(SmemLayoutK{}),
                                             cute::Shape<BlockN, HeadDim>{}, cute::_1{}));
  using TmaO = decltype(cute::make_tma_copy(cute::SM90_TMA_STORE{}, GmemOutTensorOf<Element>{}, SmemLayoutOHalf{},
                                            cute::Shape<WarpgroupRows, HeadDim>{}, cute::_1{}));
};

// The problem every kernel of this backend (forward and backward) sees: sizes,
// the visibility rule's inputs (mask.h) and the softmax scales. Set on the host,
// read by BlockMask; the direction-specific records below extend it.
struct ProblemArgs {
  const int32_t* q_lens = nullptr;
  const int32_t* kv_lens = nullptr;
  // Segment ids [B, T] / [B, S] and their block summaries (segments.h), all
  // null without segment ids. The summaries are made for the tile sizes of the
  // kernel that reads them.
  const int32_t* q_segment_ids = nullptr;
  const int32_t* kv_segment_ids = nullptr;
  const int32_t* kv_run_end = nullptr;           // [B, S]
  const KeyBlockIds* key_blocks = nullptr;        // [B, num_n_blocks]
  const QueryBlockKeys* query_blocks = nullptr;   // [B, num_m_blocks]
  const KeyBlockQueries* key_block_queries = nullptr;  // [B, num_n_blocks] (backward)
  int block_m = 0;           // the kernel's query tile (rows of S)
  int block_n = 0;           // the kernel's key tile (columns of S)
  int num_m_blocks = 0;      // ceil(T / block_m)
  int num_n_blocks = 0;      // ceil(S / block_n)
  int batch = 0, q_len = 0, kv_len = 0, heads = 0, kv_heads = 0, group = 1;
  float scale = 1.0f;        // > 0
  float scale_log2 = 1.0f;   // scale * log2(e)
  float softcap = 0.0f;      // > 0: logits are softcap * tanh(s / softcap) (softmax.h)
  float softcap_in = 0.0f;   // scale / softcap
  float softcap_log2 = 0.0f; // softcap * log2(e)
  bool causal = false;
  bool bottom_right = false;
  int window_left = -1;      // < 0: unbounded (clamped on the host to T + S)
  int window_right = -1;
};

// Run-time arguments of the forward instances (the TMA descriptors are added
// per instance in FwdParams).
struct FwdArgs : ProblemArgs {
  void* out = nullptr;          // [B, T, N, H]
  float* lse = nullptr;         // [B, N, T] or null
  float* max_logit = nullptr;   // [B, N] or [1, N] or null; pre-filled with float_max.cuh's sentinel
  int max_logit_row_stride = 0;  // N, or 0 for [1, N] (the max over the batch rows)
  const float* sink_logits = nullptr;  // [N] per-head sink logit (epilogue.h), or null
  int* tile_counter = nullptr;  // persistent grids: tiles handed out after the first wave, zeroed per call
  int num_tiles = 0;            // num_m_blocks * heads * batch
  int section_heads = 1;        // persistent grids: (head, batch) rows per L2 section (tile_scheduler.h)
};

template <class Config>
struct FwdParams {
  typename Config::TmaQ tma_q;
  typename Config::TmaKV tma_k;
  typename Config::TmaKV tma_v;
  typename Config::TmaO tma_o;  // set when Config::kTmaStoreOut
  FwdArgs args;
};

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_KERNEL_CONFIG_H_
