// maxattn sm90: the warp-specialised forward kernel and its host launcher.
// Included only by the per-head-dim instantiation files (fwd_hdim*.cu).
#ifndef MAXATTN_SM90_FWD_KERNEL_H_
#define MAXATTN_SM90_FWD_KERNEL_H_

#include <cuda_runtime.h>

#include <string>

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "maxattn/attention.h"
#include "maxattn/sm90/kernel_config.h"
#include "maxattn/sm90/launch.h"
#include "maxattn/sm90/mainloop_consumer.h"
#include "maxattn/sm90/mainloop_producer.h"
#include "maxattn/sm90/mask.h"
#include "maxattn/sm90/problem.h"
#include "maxattn/sm90/tile_scheduler.h"

namespace maxattn::sm90 {

template <class Config>
__global__ void __launch_bounds__(Config::kThreads, 1) FwdKernel(const __grid_constant__ FwdParams<Config> p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Pipeline = typename Config::Pipeline;
  using SharedStorage = typename Config::SharedStorage;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);

  const int warp = cutlass::canonical_warp_idx_sync();
  const int warpgroup = cutlass::canonical_warp_group_idx();
  if (warp == 0 && cute::elect_one_sync()) {
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
    if constexpr (Config::kTmaStoreOut) cute::prefetch_tma_descriptor(p.tma_o.get_tma_descriptor());
  }

  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = Config::kBytesKV;
  pipe_params.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = Config::kConsumerThreads;
  Pipeline pipe_k(smem.pipe_k, pipe_params, cute::Shape<cute::_1, cute::_1, cute::_1>{});
  Pipeline pipe_v(smem.pipe_v, pipe_params, cute::Shape<cute::_1, cute::_1, cute::_1>{});
  // Persistent grids: tiles (TileSlot) from the producer thread to the consumers.
  typename Config::TilePipeline::Params tile_params;
  tile_params.role = warpgroup == 0 ? Config::TilePipeline::ThreadCategory::Producer
                                    : Config::TilePipeline::ThreadCategory::Consumer;
  tile_params.producer_arv_count = 1;
  tile_params.consumer_arv_count = Config::kConsumerThreads;
  typename Config::TilePipeline pipe_tile(smem.pipe_tile, tile_params);
  if (threadIdx.x == 0) {
    smem.barrier_q.init(1);
    smem.barrier_q_empty.init(Config::kConsumerThreads);
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  auto tile_at = [&](int index) {
    if constexpr (Config::kPersistentGrid) return PersistentLongestFirstScheduler::Get(p.args, index);
    else return StaticLongestFirstScheduler::Get(p.args);
  };
  // The tile at a sequence index and its key-block range (none past the last tile).
  auto slot_at = [&](int index) {
    TileSlot slot{index, 0, 0, 0, Tile{}};
    if (index < p.args.num_tiles) {
      slot.tile = tile_at(index);
      BlockMask::Make(p.args, slot.tile.batch, slot.tile.m_block)
          .template KeyBlockRange<Config::kBlockM, Config::kBlockN>(slot.tile.m_block * Config::kBlockM, &slot.n_lo,
                                                                    &slot.n_hi);
    }
    return slot;
  };
  // Tiles with an empty key range load nothing and skip the Q barriers, on
  // both sides alike, so only loaded tiles count towards the phases.
  int q_loads = 0;
  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Config::kProducerRegs>();
    if (warp == 0) {  // the whole warp, so that the loop's values stay warp-uniform (mainloop_producer.h)
      const bool issue = cute::elect_one_sync();
      const int issuer = __ffs(__ballot_sync(0xffffffffu, issue)) - 1;
      typename Config::PipelineState state = cutlass::make_producer_start_state<Pipeline>();
      auto produce = [&](const Tile& tile, int n_lo, int n_hi) {
        if (n_lo >= n_hi) return;
        ProducerMainloop<Config>::Run(p, smem, pipe_k, pipe_v, tile, n_lo, n_hi, state, q_loads, issue);
        ++q_loads;
      };
      if constexpr (Config::kPersistentGrid) {
        auto tile_state = cutlass::make_producer_start_state<typename Config::TilePipeline>();
        for (int index = static_cast<int>(blockIdx.x);;) {
          const TileSlot slot = slot_at(index);
          pipe_tile.producer_acquire(tile_state);
          if (issue) {  // the tile pipeline expects one producer arrival
            smem.tile_slot[tile_state.index()] = slot;
            pipe_tile.producer_commit(tile_state);
          }
          ++tile_state;
          if (index >= p.args.num_tiles) break;  // the consumers stop on it too
          produce(slot.tile, slot.n_lo, slot.n_hi);
          index = __shfl_sync(0xffffffffu, issue ? PersistentLongestFirstScheduler::Next(p.args) : 0, issuer);
        }
      } else {
        const TileSlot slot = slot_at(0);
        produce(slot.tile, slot.n_lo, slot.n_hi);
      }
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Config::kConsumerRegs>();
    typename Config::PipelineState state_k, state_v;
    typename ConsumerMainloop<Config>::MaxLogitShare max_logit_carry;  // Config::kDeferMaxLogit
    auto consume = [&](const Tile& tile, int n_lo, int n_hi) {
      const BlockMask mask = BlockMask::Make(p.args, tile.batch, tile.m_block);
      ConsumerMainloop<Config>::template Run<Config::kTileLoop, Config::kSoftcap>(
          p.args, p.tma_o, smem, pipe_k, pipe_v, tile, mask, n_lo, n_hi, static_cast<int>(threadIdx.x) - 128,
          state_k, state_v, q_loads & 1, max_logit_carry);
      if (n_lo < n_hi) ++q_loads;
    };
    if constexpr (Config::kPersistentGrid) {
      typename Config::TilePipeline::PipelineState tile_state;
      for (;;) {
        pipe_tile.consumer_wait(tile_state);
        const TileSlot slot = smem.tile_slot[tile_state.index()];
        pipe_tile.consumer_release(tile_state);
        ++tile_state;
        if (slot.index >= p.args.num_tiles) break;
        consume(slot.tile, slot.n_lo, slot.n_hi);
      }
      // The last tile's max_logit share, when the shares are carried to the next tile.
      if constexpr (Config::kDeferMaxLogit) Epilogue<Config>::PublishPending(p.args, max_logit_carry);
      // The last out stores have read shared memory before the CTA exits.
      if constexpr (Config::kTmaStoreOut) {
        if (threadIdx.x % 128 == 0) cute::tma_store_wait<0>();
      }
    } else {
      const TileSlot slot = slot_at(0);
      consume(slot.tile, slot.n_lo, slot.n_hi);
    }
  }
#endif
}

template <int kHeadDim, class Element, int kVariant, bool kSoftcap>
Status LaunchForward(const FwdArgs& args, const void* q, const void* k, const void* v, cudaStream_t stream) {
  using namespace cute;
  using Config = FwdConfig<kHeadDim, Element, kVariant, kSoftcap>;
  auto gmem = [](const void* ptr, int len, int heads, int batch) {
    return make_tensor(make_gmem_ptr(static_cast<const Element*>(ptr)), MakeGmemLayout(len, kHeadDim, heads, batch));
  };
  FwdParams<Config> p;
  p.tma_q = make_tma_copy(SM90_TMA_LOAD{}, gmem(q, args.q_len, args.heads, args.batch),
                          typename Config::SmemLayoutQ{}, Shape<typename Config::BlockM, typename Config::HeadDim>{},
                          _1{});
  p.tma_k = make_tma_copy(SM90_TMA_LOAD{}, gmem(k, args.kv_len, args.kv_heads, args.batch),
                          take<0, 2>(typename Config::SmemLayoutK{}),
                          Shape<typename Config::BlockN, typename Config::HeadDim>{}, _1{});
  p.tma_v = make_tma_copy(SM90_TMA_LOAD{}, gmem(v, args.kv_len, args.kv_heads, args.batch),
                          take<0, 2>(typename Config::SmemLayoutV{}),
                          Shape<typename Config::BlockN, typename Config::HeadDim>{}, _1{});
  if constexpr (Config::kTmaStoreOut) {
    auto out = make_tensor(make_gmem_ptr(static_cast<Element*>(args.out)),
                           MakeGmemLayout(args.q_len, kHeadDim, args.heads, args.batch));
    p.tma_o = make_tma_copy(SM90_TMA_STORE{}, out, typename Config::SmemLayoutOHalf{},
                            Shape<typename Config::WarpgroupRows, typename Config::HeadDim>{}, _1{});
  }
  p.args = args;
  if constexpr (Config::kPersistentGrid) {
    p.args.section_heads = PersistentLongestFirstScheduler::SectionHeads(args, kHeadDim, sizeof(Element));
  }

  auto kernel = &FwdKernel<Config>;
  MAXATTN_RETURN_IF_ERROR(CudaStatus(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Config::kSmemBytes),
      "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)"));
  dim3 grid = StaticLongestFirstScheduler::Grid(args);
  if constexpr (Config::kPersistentGrid) {
    int device = 0, num_sms = 0;
    MAXATTN_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&device), "cudaGetDevice"));
    MAXATTN_RETURN_IF_ERROR(CudaStatus(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device),
                                       "cudaDeviceGetAttribute(multiProcessorCount)"));
    grid = PersistentLongestFirstScheduler::Grid(args, num_sms);
  }
  kernel<<<grid, Config::kThreads, Config::kSmemBytes, stream>>>(p);
  return CudaStatus(cudaGetLastError(), "forward kernel launch");
}

}  // namespace maxattn::sm90

#define MAXATTN_SM90_INSTANTIATE_FORWARD(H, ELEMENT, VARIANT, SOFTCAP)                        \
  template ::maxattn::Status maxattn::sm90::LaunchForward<H, ELEMENT, VARIANT, SOFTCAP>(         \
      const FwdArgs&, const void*, const void*, const void*, cudaStream_t)

#endif  // MAXATTN_SM90_FWD_KERNEL_H_
