// maxattn sm90: the warp-specialised backward kernel, its dQ post-pass and their host launcher.
// Included only by the per-head-dim instantiation files (bwd_hdim*.cu).
#ifndef MAXATTN_SM90_BWD_KERNEL_H_
#define MAXATTN_SM90_BWD_KERNEL_H_

#include <cuda_runtime.h>

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "maxattn/attention.h"
#include "maxattn/sm90/bwd_config.h"
#include "maxattn/sm90/bwd_config_wide.h"
#include "maxattn/sm90/bwd_dq_writer.h"
#include "maxattn/sm90/bwd_epilogue.h"
#include "maxattn/sm90/bwd_mainloop_consumer.h"
#include "maxattn/sm90/bwd_mainloop_consumer_wide.h"
#include "maxattn/sm90/bwd_mainloop_producer.h"
#include "maxattn/sm90/launch.h"
#include "maxattn/sm90/mask.h"
#include "maxattn/sm90/problem.h"
#include "maxattn/sm90/tile_scheduler.h"

namespace maxattn::sm90 {

// The configuration of the backward instance for a head dim.
template <int kHeadDim, class Element, bool kSoftcap>
using BwdConfigFor = std::conditional_t<kHeadDim == 256, BwdWideConfig<Element, kSoftcap>,
                                        BwdConfig<kHeadDim, Element, kSoftcap>>;

template <class Config>
__global__ void __launch_bounds__(Config::kThreads, 1) BwdKernel(const __grid_constant__ BwdParams<Config> p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Pipeline = typename Config::Pipeline;
  using SharedStorage = typename Config::SharedStorage;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);

  const int warp = cutlass::canonical_warp_idx_sync();
  const int warpgroup = cutlass::canonical_warp_group_idx();
  if (warp == 0 && cute::elect_one_sync()) {
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    if constexpr (Config::kTmaStoreDkDv) {
      cute::prefetch_tma_descriptor(p.tma_dk.get_tma_descriptor());
      cute::prefetch_tma_descriptor(p.tma_dv.get_tma_descriptor());
    }
  }

  // Q and dO stages complete when their tile and their 256 bytes of row statistics have landed.
  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = Config::kBytesQ + Config::kBytesRowStats;
  pipe_params.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = Config::kConsumerThreads;
  Pipeline pipe_q(smem.pipe_q, pipe_params, cute::Shape<cute::_1, cute::_1, cute::_1>{});
  Pipeline pipe_do(smem.pipe_do, pipe_params, cute::Shape<cute::_1, cute::_1, cute::_1>{});
  if (threadIdx.x == 0) {
    smem.barrier_k.init(1);
    smem.barrier_v.init(1);
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  const bool ordered = p.args.dq_turns != nullptr;  // deterministic mode (bwd_dq_order.h)
  const BwdTile tile = BwdStaticScheduler::Get(p.args, p.args.section_rows, ordered);
  int m_lo = 0, m_hi = 0;
  BlockMask::MakeRow(p.args, tile.batch)
      .template QueryBlockRange<Config::kBlockM, Config::kBlockN>(p.args, tile.n_block * Config::kBlockN, &m_lo,
                                                                  &m_hi);
  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Config::kProducerRegs>();
    if (warp == 0) {
      if (m_lo < m_hi) BwdProducer<Config>::Run(p, smem, pipe_q, pipe_do, tile, m_lo, m_hi);
    }
    if constexpr (!Config::kDqFromRegisters) {
      if (warp >= 1 && warp <= Config::kConsumerWarpgroups && m_lo < m_hi) {  // warp w writes warpgroup w - 1's dQ
        const int* order_table = reinterpret_cast<const int*>(smem_raw + sizeof(SharedStorage));
        BwdDqWriter<Config>::Run(p.args, smem, tile, m_lo, m_hi, order_table, warp - 1,
                                 static_cast<int>(threadIdx.x) % 32);
      }
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Config::kConsumerRegs>();
    if constexpr (Config::kDqFromRegisters) {
      BwdWideConsumer<Config>::Run(p.args, smem, pipe_q, pipe_do, tile, m_lo, m_hi, static_cast<int>(blockIdx.x),
                                   static_cast<int>(threadIdx.x) - 128);
    } else {
      int* order_table = reinterpret_cast<int*>(smem_raw + sizeof(SharedStorage));
      BwdConsumer<Config>::Run(p, smem, pipe_q, pipe_do, tile, m_lo, m_hi, static_cast<int>(blockIdx.x),
                               order_table, static_cast<int>(threadIdx.x) - 128);
    }
  }
#endif
}

// After the main kernel, grid (num_m_blocks, N, B), one warpgroup per dQ slice
// (two at H = 128 and 256, one at H = 64): dq = scale * dq_accum. Each thread first
// loads its eight float4 of the slice (coalesced, all in flight at once: the
// fragment order of bwd_epilogue.h), maps them to (row, column) with the same
// thread slice of the dQ GEMM into a padded bf16/fp16 tile in shared memory,
// and the CTA then writes whole 16-byte pieces of each row of dq; rows >= T
// are padding of the last tile. (Loads and stores interleaved per element, as
// first written, took 3.5x the memory-bound time: 215 us at (4,2048,32,128).)
template <class Config>
__global__ void __launch_bounds__(Config::kDqSlices * 128) BwdPostpassKernel(const __grid_constant__ BwdArgs a) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using Element = typename Config::Element;
  using Epilogue = BwdEpilogue<Config>;
  constexpr int kBlockM = Config::kBlockM, kHeadDim = Config::kHeadDim;
  // 16 bytes of padding per row: the 8 rows of a warp's fragment stores hit distinct banks.
  constexpr int kPitch = kHeadDim + 8;
  constexpr int kVectors = Config::kDqSliceFloats / 128 / 4;  // float4 per thread: 8, or 16 at H = 256
  constexpr int kChunksPerRow = kHeadDim * static_cast<int>(sizeof(Element)) / 16;
  __shared__ alignas(16) Element tile[kBlockM * kPitch];
  const int w = static_cast<int>(threadIdx.x) / 128, t = static_cast<int>(threadIdx.x) % 128;
  const int m_block = static_cast<int>(blockIdx.x), head = static_cast<int>(blockIdx.y);
  const int batch = static_cast<int>(blockIdx.z);

  const float4* slice = reinterpret_cast<const float4*>(Epilogue::GmemSlice(a, batch, head, m_block, w));
  float4 x[kVectors];
  CUTE_UNROLL
  for (int j = 0; j < kVectors; ++j) x[j] = __ldcs(slice + Epilogue::SliceIndex(t, 4 * j) / 4);

  typename Config::TiledMmadQ mma_dq;
  auto thr = mma_dq.get_thread_slice(threadIdx.x);
  Tensor coords = thr.partition_C(make_identity_tensor(Shape<typename Config::BlockM, typename Config::HeadDim>{}));
  static_assert(decltype(size(coords))::value == 4 * kVectors, "one float4 per four fragment elements");
  cutlass::NumericArrayConverter<Element, float, 2> convert;
  CUTE_UNROLL
  for (int i = 0; i < size(coords); i += 2) {
    const float4& v = x[i / 4];
    cutlass::Array<float, 2> pair;
    pair[0] = (i % 4 == 0 ? v.x : v.z) * a.scale;
    pair[1] = (i % 4 == 0 ? v.y : v.w) * a.scale;
    *reinterpret_cast<cutlass::Array<Element, 2>*>(&tile[get<0>(coords(i)) * kPitch + get<1>(coords(i))]) =
        convert(pair);
  }
  __syncthreads();

  Element* dq = static_cast<Element*>(a.dq);
  for (int c = static_cast<int>(threadIdx.x); c < kBlockM * kChunksPerRow; c += Config::kDqSlices * 128) {
    const int r = c / kChunksPerRow, piece = c % kChunksPerRow;
    const int row = m_block * kBlockM + r;
    if (row >= a.q_len) break;  // rows grow with c
    const int64_t offset = ((static_cast<int64_t>(batch) * a.q_len + row) * a.heads + head) * kHeadDim + piece * 8;
    *reinterpret_cast<uint4*>(dq + offset) = *reinterpret_cast<const uint4*>(&tile[r * kPitch + piece * 8]);
  }
#endif
}

template <int kHeadDim, class Element, bool kSoftcap>
Status LaunchBackward(const BwdArgs& args, const void* q, const void* k, const void* v, const void* dout,
                      cudaStream_t stream) {
  using namespace cute;
  using Config = BwdConfigFor<kHeadDim, Element, kSoftcap>;
  auto gmem = [](const void* ptr, int len, int heads, int batch) {
    return make_tensor(make_gmem_ptr(static_cast<const Element*>(ptr)), MakeGmemLayout(len, kHeadDim, heads, batch));
  };
  using TileQ = Shape<typename Config::BlockM, typename Config::HeadDim>;
  using TileKV = Shape<typename Config::BlockN, typename Config::HeadDim>;
  BwdParams<Config> p;
  p.tma_q = make_tma_copy(SM90_TMA_LOAD{}, gmem(q, args.q_len, args.heads, args.batch),
                          take<0, 2>(typename Config::SmemLayoutQ{}), TileQ{}, _1{});
  p.tma_do = make_tma_copy(SM90_TMA_LOAD{}, gmem(dout, args.q_len, args.heads, args.batch),
                           take<0, 2>(typename Config::SmemLayoutdO{}), TileQ{}, _1{});
  p.tma_k = make_tma_copy(SM90_TMA_LOAD{}, gmem(k, args.kv_len, args.kv_heads, args.batch),
                          typename Config::SmemLayoutK{}, TileKV{}, _1{});
  p.tma_v = make_tma_copy(SM90_TMA_LOAD{}, gmem(v, args.kv_len, args.kv_heads, args.batch),
                          typename Config::SmemLayoutV{}, TileKV{}, _1{});
  if constexpr (Config::kTmaStoreDkDv) {
    auto out = [&](void* ptr) {
      return make_tensor(make_gmem_ptr(static_cast<Element*>(ptr)),
                         MakeGmemLayout(args.kv_len, kHeadDim, args.kv_heads, args.batch));
    };
    using TileKVHalf = Shape<Int<Config::kBlockN / 2>, typename Config::HeadDim>;
    p.tma_dk = make_tma_copy(SM90_TMA_STORE{}, out(args.dk), typename Config::SmemLayoutdKVHalf{}, TileKVHalf{}, _1{});
    p.tma_dv = make_tma_copy(SM90_TMA_STORE{}, out(args.dv), typename Config::SmemLayoutdKVHalf{}, TileKVHalf{}, _1{});
  }
  p.args = args;
  p.args.section_rows = BwdStaticScheduler::LongestFirst(args, kHeadDim, args.dq_turns != nullptr)
                             ? BwdStaticScheduler::SectionRows(args, kHeadDim, sizeof(Element))
                             : 0;

  // The turn table fits: Sm90BackwardUnsupportedReason bounds num_m_blocks by kBwdMaxOrderedQueryBlocks.
  const int smem_bytes = Config::SmemBytes(args.dq_turns != nullptr, args.num_m_blocks);
  auto kernel = &BwdKernel<Config>;
  MAXATTN_RETURN_IF_ERROR(CudaStatus(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes),
      "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)"));
  kernel<<<BwdStaticScheduler::Grid(args), Config::kThreads, smem_bytes, stream>>>(p);
  MAXATTN_RETURN_IF_ERROR(CudaStatus(cudaGetLastError(), "backward kernel launch"));
  const dim3 post_grid(static_cast<unsigned>(args.num_m_blocks), static_cast<unsigned>(args.heads),
                       static_cast<unsigned>(args.batch));
  BwdPostpassKernel<Config><<<post_grid, Config::kDqSlices * 128, 0, stream>>>(args);
  return CudaStatus(cudaGetLastError(), "backward post-pass launch");
}

}  // namespace maxattn::sm90

#define MAXATTN_SM90_INSTANTIATE_BACKWARD(H, ELEMENT, SOFTCAP)                                 \
  template ::maxattn::Status maxattn::sm90::LaunchBackward<H, ELEMENT, SOFTCAP>(                \
      const BwdArgs&, const void*, const void*, const void*, const void*, cudaStream_t)

#endif  // MAXATTN_SM90_BWD_KERNEL_H_
