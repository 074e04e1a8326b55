// maxattn sm90: what the backward's consumers write to global memory.
//
// dQ, every step (StageDq here, then a bulk reduction issued by the dQ writer
// warp: bwd_dq_writer.h): the warpgroup's dQ fragment (fp32,
// not yet scaled) goes to its 16 KB slice of shared memory, and one bulk
// reduction (cp.reduce.async.bulk .add.f32) adds
// the slice into its tile of dq_accum -- whole 128-byte lines in L2 instead of
// 8-byte vector atomics per thread (which kept L2 70% busy and the Q loads
// late: bench/RESULTS.md, 2026-12-05). The slice is in "fragment order":
// element i of thread t sits at (i / 4) * 512 + t * 4 + i % 4, so the float4
// stores of a warp are contiguous (no bank conflicts); dq_accum's tiles keep
// that order and the post-pass (BwdPostpassKernel) maps it back to (row,
// column) with the same thread slice of the dQ GEMM. At H = 128 the two
// warpgroups own column halves (tile = their two slices); at H = 64 both add a
// partial sum of the whole 64 x 64 tile (both slices go to the same tile).
// At H = 256 (ReduceDq, bwd_config_wide.h) there is no room to stage: each
// thread adds its 64 x 128 half's fragment straight from its registers, one
// 16-byte vector reduction per four elements, into the same fragment order.
// StoreDkDv, once per CTA (head dims 64 and 128): dV and scale * dK of each
// consumer warpgroup's keys, converted in registers, staged by stmatrix in the
// 128-byte swizzle of the operand tiles and stored by TMA (rows past S clipped
// there). StoreDkDvByThreads (head dim 256, whose warpgroups split the columns):
// staged by 4-byte stores and stored in 16-byte pieces of whole rows by every
// consumer thread.
#ifndef MAXATTN_SM90_BWD_EPILOGUE_H_
#define MAXATTN_SM90_BWD_EPILOGUE_H_

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include "maxattn/sm90/barrier.h"
#include "maxattn/sm90/bwd_config.h"
#include "maxattn/sm90/gemm.h"
#include "maxattn/sm90/tile_scheduler.h"

namespace maxattn::sm90 {

// dst[0, 4) += {a, b, c, d}, one 16-byte reduction (REDG.E.ADD.F32x4) that
// returns nothing. atomicAdd(float4*) with its result unused may still compile
// to ATOMG, which waits for its reply: it did in a build where a __threadfence
// followed the adds in the same loop (bench/RESULTS.md, eleventh session).
__device__ __forceinline__ void RedAddF32x4(float* dst, float a, float b, float c, float d) {
  asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
}

// One thread: dst[0, bytes/4) += src[0, bytes/4) (fp32) by the bulk-copy unit,
// in the current bulk group (16-byte aligned, bytes a multiple of 16).
__device__ __forceinline__ void BulkReduceAddF32(float* dst, const float* src, int bytes) {
  const uint32_t smem = static_cast<uint32_t>(__cvta_generic_to_shared(src));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst), "r"(smem),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void BulkCommit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// The issuing thread's bulk groups have finished reading shared memory.
__device__ __forceinline__ void BulkWaitRead() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// ... and finished writing global memory.
__device__ __forceinline__ void BulkWaitAll() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

template <class Config>
struct BwdEpilogue {
  using Element = typename Config::Element;

  static constexpr int kSliceFloats = Config::kDqSliceFloats;  // one warpgroup's fragment: 128 threads x 32

  // Position of element i of warpgroup thread t in a slice (fragment order).
  __host__ __device__ static constexpr int SliceIndex(int t, int i) { return (i / 4) * 512 + t * 4 + i % 4; }

  // The warpgroup's dQ fragment into its slice (wg_tid: 0..127).
  template <class TensorDq>
  __device__ static void StageDq(float* slice, const TensorDq& dq, int wg_tid) {
    using namespace cute;
    static_assert(decltype(size(dq))::value * 128 == kSliceFloats, "32 floats per thread");
    CUTE_UNROLL
    for (int i = 0; i < size(dq); i += 4) {
      *reinterpret_cast<float4*>(slice + SliceIndex(wg_tid, i)) = make_float4(dq(i), dq(i + 1), dq(i + 2), dq(i + 3));
    }
  }

  // The warpgroup's dQ fragment added into its dq_accum slice from registers
  // (the kDqFromRegisters configs): red.global.add.v4.f32 in fragment order, so
  // a warp's instruction covers 512 contiguous bytes.
  // dq: the fragment's elements [first, first + size(dq)) (a GEMM of part of the columns).
  template <class TensorDq>
  __device__ static void ReduceDq(float* gmem_slice, const TensorDq& dq, int wg_tid, int first) {
    using namespace cute;
    static_assert(decltype(size(dq))::value % 4 == 0, "whole float4");
    CUTE_UNROLL
    for (int i = 0; i < size(dq); i += 4) {
      RedAddF32x4(gmem_slice + SliceIndex(wg_tid, first + i), dq(i), dq(i + 1), dq(i + 2), dq(i + 3));
    }
  }

  // The dq_accum slice of warpgroup wg in query block m_block of (batch, head).
  __device__ static float* GmemSlice(const BwdArgs& a, int batch, int head, int m_block, int wg) {
    constexpr int kTileFloats = Config::kBlockM * Config::kHeadDim;
    const int64_t tile = (static_cast<int64_t>(batch) * a.heads + head) * a.num_m_blocks + m_block;
    return a.dq_accum + tile * kTileFloats + (Config::kDqSplitKeys ? 0 : wg * kSliceFloats);
  }

  // Offset of (row, col) in a kBlockN x H staging tile of dK or dV: rows of H
  // elements whose 16-byte chunks are swizzled (chunk c of row r at c ^ (r % 8)),
  // so a warp's fragment stores (8 rows, 4 lanes each) and its 16-byte row
  // reads (8 lanes per 128 bytes) both hit 32 distinct banks.
  __device__ static int StagingOffset(int row, int col) {
    return row * Config::kHeadDim + (((col / 8) ^ (row % 8)) * 8) + col % 8;
  }

  // dk, dv: the warpgroup's (key, head dim) accumulators, fragments of TiledMmadKV (dk is scaled in
  // place). stage_k, stage_v: Q / dO regions free for the consumers (the caller synchronised both
  // warpgroups); warpgroup wg stages in their wg-th halves. Its first thread issues both TMA stores
  // and waits until they have read shared memory (the CTA ends after this).
  template <class TensorAcc>
  __device__ static void StoreDkDv(const BwdArgs& a, const typename Config::TmadKV& tma_dk,
                                   const typename Config::TmadKV& tma_dv, const BwdTile& tile, TensorAcc& dk,
                                   const TensorAcc& dv, Element* stage_k, Element* stage_v, int wg) {
    using namespace cute;
    using HalfN = Int<Config::kBlockN / 2>;
    using HeadDim = typename Config::HeadDim;
    cutlass::NumericArrayConverter<Element, float, 2> convert;
    CUTE_UNROLL
    for (int i = 0; i < size(dk); ++i) dk(i) *= a.scale;
    Tensor rdK = make_tensor<Element>(dk.layout());
    Tensor rdV = make_tensor<Element>(dv.layout());
    ConvertFragment(dk, rdK, convert);
    ConvertFragment(dv, rdV, convert);
    Tensor sdK = make_tensor(make_smem_ptr(stage_k + wg * Config::kSmemdKVHalfElems),
                             typename Config::SmemLayoutdKVHalf{});
    Tensor sdV = make_tensor(make_smem_ptr(stage_v + wg * Config::kSmemdKVHalfElems),
                             typename Config::SmemLayoutdKVHalf{});
    // The thread index read anew (as the forward's out staging does): derived from the consumer
    // index, the staging offsets may be computed before the walk and kept in registers across it.
    int tid = 0;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    auto copy_kv = make_tiled_copy_C(typename Config::CopyAtomdKVStaging{}, typename Config::TiledMmadKVWarpgroup{});
    auto thr_copy = copy_kv.get_thread_slice(tid % 128);
    copy(copy_kv, thr_copy.retile_S(rdK), thr_copy.partition_D(sdK));
    copy(copy_kv, thr_copy.retile_S(rdV), thr_copy.partition_D(sdV));
    tma_store_fence();  // the staged rows are visible to the TMA unit
    NamedBarrierSync(kBwdBarrierDsWarpgroup + wg, 128);
    if (tid % 128 == 0) {
      const auto shape = make_shape(a.kv_len, int32_t{Config::kHeadDim}, a.kv_heads, a.batch);
      const auto block = make_coord(tile.n_block * Config::kConsumerWarpgroups + wg, _0{});
      Tensor gdK = local_tile(tma_dk.get_tma_tensor(shape)(_, _, tile.kv_head, tile.batch), Shape<HalfN, HeadDim>{},
                              block);
      Tensor gdV = local_tile(tma_dv.get_tma_tensor(shape)(_, _, tile.kv_head, tile.batch), Shape<HalfN, HeadDim>{},
                              block);
      auto cta_dk = tma_dk.get_slice(0);
      auto cta_dv = tma_dv.get_slice(0);
      copy(tma_dk, cta_dk.partition_S(sdK), cta_dk.partition_D(gdK));
      copy(tma_dv, cta_dv.partition_S(sdV), cta_dv.partition_D(gdV));
      tma_store_arrive();
      tma_store_wait<0>();
    }
  }

  // dk, dv: the (key, head dim) accumulators; coords: each element's (key,
  // column) in the kBlockN x H tile. Stages dV and scale * dK in shared memory
  // (stage_k, stage_v: kBlockN * H elements each, free for the consumers: the
  // caller synchronised them), then all consumer threads store whole 16-byte
  // pieces of the rows j < S (per-thread 4-byte stores from the fragments used
  // half of each 32-byte sector: ncu on the H100, 2026-12-05).
  template <class TensorAcc, class TensorC>
  __device__ static void StoreDkDvByThreads(const BwdArgs& a, const BwdTile& tile, const TensorAcc& dk,
                                            const TensorAcc& dv, const TensorC& coords, Element* stage_k,
                                            Element* stage_v, int consumer_tid) {
    using namespace cute;
    constexpr int kChunks = Config::kHeadDim / 8;  // 16-byte pieces per row
    cutlass::NumericArrayConverter<Element, float, 2> convert;
    CUTE_UNROLL
    for (int i = 0; i < size(dk); i += 2) {
      const int offset = StagingOffset(get<0>(coords(i)), get<1>(coords(i)));
      cutlass::Array<float, 2> pair;
      pair[0] = dv(i);
      pair[1] = dv(i + 1);
      *reinterpret_cast<cutlass::Array<Element, 2>*>(stage_v + offset) = convert(pair);
      pair[0] = dk(i) * a.scale;
      pair[1] = dk(i + 1) * a.scale;
      *reinterpret_cast<cutlass::Array<Element, 2>*>(stage_k + offset) = convert(pair);
    }
    NamedBarrierSync(kBwdBarrierDs, Config::kConsumerThreads);
    Element* dk_out = static_cast<Element*>(a.dk);
    Element* dv_out = static_cast<Element*>(a.dv);
    const int n0 = tile.n_block * Config::kBlockN;
    constexpr int kPieces = Config::kBlockN * kChunks;  // per tensor
    for (int c = consumer_tid; c < 2 * kPieces; c += Config::kConsumerThreads) {
      const bool is_k = c >= kPieces;
      const int piece = is_k ? c - kPieces : c;
      const int row = piece / kChunks, chunk = piece % kChunks;
      if (n0 + row >= a.kv_len) continue;
      const int64_t offset =
          ((static_cast<int64_t>(tile.batch) * a.kv_len + n0 + row) * a.kv_heads + tile.kv_head) * Config::kHeadDim +
          chunk * 8;
      const Element* src = (is_k ? stage_k : stage_v) + StagingOffset(row, chunk * 8);
      *reinterpret_cast<uint4*>((is_k ? dk_out : dv_out) + offset) = *reinterpret_cast<const uint4*>(src);
    }
  }
};

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_BWD_EPILOGUE_H_
