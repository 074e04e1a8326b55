// maxattn sm90: normalises O and writes out, lse and this tile's max_logit.
//
// Per row: sum == 0 (nothing visible) or a padded row (i >= q_valid) gives
// out 0 and lse -inf; a NaN sum (a NaN logit was visible) gives NaN for out,
// lse and the row's max logit. With a sink logit z (args.sink_logits[n]) the
// denominator gains exp(z): with L the logit of the row maximum and
// M = max(L, z), lse = M + log(sum * exp(L - M) + exp(z - M)) and out =
// acc * exp(L - lse); an empty row has out 0 and lse z (-inf for z = -inf:
// the vanilla case). The sink never enters max_logit. The raw row maxima times the scale are the
// row's max logits (scale > 0, so max(scale*s) == scale*max(s) in fp32); each
// warp reduces its rows by shuffles and issues one atomic max into
// max_logit[b, n] (max_logit[0, n] for the max over the batch rows;
// float_max.cuh), also when it sees nothing, while its last
// P V GEMM is in flight: no barrier between the consumer warpgroups, and the
// reduction's latency is hidden behind the tensor cores. (Experiment,
// kernel_config.h's MAXATTN_SM90_DEFER_MAX_LOGIT: a persistent CTA takes the
// thread's share there and reduces and publishes it under its next tile's first
// S GEMM instead.)
#ifndef MAXATTN_SM90_EPILOGUE_H_
#define MAXATTN_SM90_EPILOGUE_H_

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include "maxattn/float_max.cuh"
#include "maxattn/sm90/barrier.h"
#include "maxattn/sm90/gemm.h"
#include "maxattn/sm90/kernel_config.h"
#include "maxattn/sm90/mask.h"
#include "maxattn/sm90/softmax.h"
#include "maxattn/sm90/tile_scheduler.h"

namespace maxattn::sm90 {

using ::maxattn::AtomicMaxFloat;

template <class Config>
struct Epilogue {
  using Element = typename Config::Element;

  // This thread's share of a tile's max_logit, before the warp reduces it:
  // the largest raw row maximum of its valid rows, and whether one of them
  // saw a NaN logit. The row maxima are quad-uniform (QuadMax) and never NaN
  // (fmaxf drops NaN); a NaN logit shows in the thread's partial row sum
  // only, which suffices: the quad's four threads all enter the warp's vote.
  // Branch-free per row (a `continue` made the compiler keep the flag in a
  // byte and merge it with PRMTs). The row maxima are final after the last
  // softmax update, so the consumer takes this while its last P V GEMM runs
  // (mainloop_consumer.h).
  struct MaxLogitShare {
    float raw_max = -INFINITY;
    bool nan = false;
    // The max_logit element it goes to (b * row stride + n: below 2^31, since B * N * 64 bf16
    // elements of q fit the device); -1: nothing (Config::kDeferMaxLogit's carry).
    int slot = -1;
  };

  // The max_logit element of a tile: max_logit[b, n], or max_logit[0, n] for
  // the max over the batch rows (row stride 0).
  __device__ static int64_t MaxLogitSlot(const FwdArgs& args, const Tile& tile) {
    return static_cast<int64_t>(tile.batch) * args.max_logit_row_stride + tile.head;
  }

  template <class Softmax, class TensorC>
  __device__ static MaxLogitShare ThreadMaxLogit(const FwdArgs& args, const Tile& tile, const BlockMask& mask,
                                                 const Softmax& softmax, const TensorC& oc) {
    using namespace cute;
    MaxLogitShare share;
    share.slot = static_cast<int>(MaxLogitSlot(args, tile));
    const int m0 = tile.m_block * Config::kBlockM;
    CUTE_UNROLL
    for (int r = 0; r < size<0>(oc); ++r) {
      const bool valid = m0 + get<0>(oc(r, 0)) < mask.q_valid;
      const float row_max = softmax.row_max[r];
      const float sum = softmax.row_sum[r];
      share.nan = share.nan | (valid & (sum != sum) & (row_max != INFINITY));
      share.raw_max = valid ? fmaxf(share.raw_max, row_max) : share.raw_max;
    }
    return share;
  }

  // The warp's shares of one tile reduced (three shuffles across the quads and
  // one vote) into one atomic max into *dst (the tile's MaxLogitSlot;
  // float_max.cuh), issued also when the warp saw nothing (the buffer starts
  // below -inf). The scale is applied once, to the warp's maximum (scale > 0,
  // so max(scale * s) == scale * max(s) in fp32). Every lane issues the
  // reduction: the compiler merges the warp's into one (REDUX, one REDG)
  // without the divergent branch a lane-0 test costs.
  __device__ static void PublishMaxLogit(const FwdArgs& args, float* dst, const MaxLogitShare& share) {
    const bool nan = __any_sync(0xffffffffu, share.nan);
    float warp_max = share.raw_max;
    CUTE_UNROLL
    for (int offset = 16; offset >= 4; offset /= 2) {
      warp_max = fmaxf(warp_max, __shfl_xor_sync(0xffffffffu, warp_max, offset));
    }
    AtomicMaxFloat(dst, nan ? __int_as_float(0x7fffffff) : warp_max * args.scale);
  }

  // A carried share (Config::kDeferMaxLogit), if any, published; the carry is
  // empty after. The test reads the slot through a shuffle so that the compiler
  // knows it is warp-uniform: behind a per-thread test it could not merge the
  // warp's atomics (REDUX, one REDG) and each lane issued its own REDG.
  __device__ static void PublishPending(const FwdArgs& args, MaxLogitShare& carry) {
    if (__shfl_sync(0xffffffffu, carry.slot, 0) >= 0) PublishMaxLogit(args, args.max_logit + carry.slot, carry);
    carry.slot = -1;
  }

  // This warp's part of max_logit[b, n] for the tile, reduced and published now.
  template <class Softmax, class TensorC>
  __device__ static void MaxLogit(const FwdArgs& args, const Tile& tile, const BlockMask& mask,
                                  const Softmax& softmax, const TensorC& oc) {
    if (args.max_logit == nullptr) return;
    PublishMaxLogit(args, args.max_logit + MaxLogitSlot(args, tile), ThreadMaxLogit(args, tile, mask, softmax, oc));
  }

  // o: this thread's fp32 accumulator fragment of the (kBlockM, H) tile
  // (TiledMmaO's C partition); oc: the (row, col) coordinates of its elements,
  // as a (rows, cols) view. softmax: finalised row statistics.
  // Config::kTmaStoreOut: the normalised rows are converted in registers and
  // written into the warpgroup's half of smem_o by stmatrix (16 bytes per
  // thread and instruction, the 128-byte swizzle of the operand tiles applied
  // by the shared-memory tensor), and one thread stores the half by TMA (rows
  // past T are clipped there); the consumers go on to the next tile while the
  // store runs, and the next tile's epilogue first waits until it has read the
  // half. Otherwise each thread stores its pairs from registers (a quad's 16
  // bytes of a row: half of each 32-byte sector).
  template <class Softmax, class TensorO, class TensorC>
  __device__ static void Store(const FwdArgs& args, const typename Config::TmaO& tma_o, Element* smem_o,
                               const Tile& tile, const BlockMask& mask, const Softmax& softmax, TensorO& o,
                               const TensorC& oc, int consumer_tid) {
    using namespace cute;
    const int m0 = tile.m_block * Config::kBlockM;
    const int lane = consumer_tid % 32;
    const int wg = consumer_tid / 128;
    Element* out = static_cast<Element*>(args.out);
    Tensor o_rc = make_tensor(o.data(), RowColLayout(o.layout()));
    const bool has_sink = args.sink_logits != nullptr;
    const float sink = has_sink ? args.sink_logits[tile.head] : -INFINITY;
    cutlass::NumericArrayConverter<Element, float, 2> convert;
    constexpr int kRows = decltype(size<0>(o_rc))::value;
    float row_inv[kRows];
    bool row_empty[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int i = m0 + get<0>(oc(r, 0));
      // Staged rows past T are written (as zeros: q_valid <= T) and clipped by the TMA store.
      if constexpr (!Config::kTmaStoreOut) {
        if (i >= args.q_len) continue;
      }
      const float sum = softmax.row_sum[r];
      const bool empty = i >= mask.q_valid || sum == 0.0f;
      float inv = empty ? 0.0f : 1.0f / sum;  // NaN stays NaN
      // __logf (MUFU.LG2 and a multiply; sum >= 1 here, so its absolute error is ~1e-7): logf's
      // correctly rounded software sequence was ~25 instructions per row on the tile's critical path.
      float lse = empty ? -INFINITY : softmax.RowLogit(r) + __logf(sum);
      if (has_sink) {
        if (empty) {
          lse = sink;
        } else {
          const float logit = softmax.RowLogit(r);
          const float top = fmaxf(logit, sink);  // sink = -inf or NaN: logit
          const float denom = fmaf(sum, expf(logit - top), expf(sink - top));
          lse = top + logf(denom);
          inv = expf(logit - lse);
        }
      }
      if (args.lse != nullptr && (lane % 4) == 0 && i < args.q_len) {
        args.lse[(static_cast<int64_t>(tile.batch) * args.heads + tile.head) * args.q_len + i] = lse;
      }
      row_inv[r] = inv;
      row_empty[r] = empty;
      if constexpr (!Config::kTmaStoreOut) {
        Element* row = out + ((static_cast<int64_t>(tile.batch) * args.q_len + i) * args.heads + tile.head) *
                                 static_cast<int64_t>(Config::kHeadDim);
        CUTE_UNROLL
        for (int c = 0; c < size<1>(o_rc); c += 2) {
          cutlass::Array<float, 2> pair;
          pair[0] = empty ? 0.0f : o_rc(r, c) * inv;
          pair[1] = empty ? 0.0f : o_rc(r, c + 1) * inv;
          *reinterpret_cast<cutlass::Array<Element, 2>*>(row + get<1>(oc(r, c))) = convert(pair);
        }
      }
    }
    if constexpr (Config::kTmaStoreOut) {
      // An empty row's out is 0 even where its accumulator is not (a NaN value under a masked
      // key), which costs a select per element; only warps that hold an empty row pay for it.
      bool warp_empty = false;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) warp_empty = warp_empty || row_empty[r];
      if (__any_sync(0xffffffffu, warp_empty)) {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          CUTE_UNROLL
          for (int c = 0; c < size<1>(o_rc); ++c) o_rc(r, c) = row_empty[r] ? 0.0f : o_rc(r, c) * row_inv[r];
        }
      } else {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          CUTE_UNROLL
          for (int c = 0; c < size<1>(o_rc); ++c) o_rc(r, c) *= row_inv[r];
        }
      }
      Tensor rO = make_tensor<Element>(o.layout());
      ConvertFragment(o, rO, convert);
      Tensor sO = make_tensor(make_smem_ptr(smem_o + wg * Config::kSmemOHalfElems),
                              typename Config::SmemLayoutOHalf{});
      // The copy's thread slice from the thread index read anew: derived from consumer_tid, the
      // compiler computed the swizzled staging offsets before the main loop and kept them in local
      // memory across it.
      int tid = 0;
      asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
      auto copy_o = make_tiled_copy_C(typename Config::CopyAtomOStaging{},
                                      typename Config::TiledMmaOWarpgroup{});
      auto thr_copy_o = copy_o.get_thread_slice(tid % 128);
      if (consumer_tid % 128 == 0) tma_store_wait<0>();  // the previous tile's store has read the half
      NamedBarrierSync(kFwdBarrierOut + wg, 128);
      copy(copy_o, thr_copy_o.retile_S(rO), thr_copy_o.partition_D(sO));
      tma_store_fence();  // the staged rows are visible to the TMA unit
      NamedBarrierSync(kFwdBarrierOut + wg, 128);
      if (consumer_tid % 128 == 0) {
        Tensor mO = tma_o.get_tma_tensor(make_shape(args.q_len, int32_t{Config::kHeadDim}, args.heads, args.batch));
        Tensor gO = local_tile(mO(_, _, tile.head, tile.batch),
                               Shape<typename Config::WarpgroupRows, typename Config::HeadDim>{},
                               make_coord(tile.m_block * Config::kConsumerWarpgroups + wg, _0{}));
        auto cta_tma = tma_o.get_slice(0);
        copy(tma_o, cta_tma.partition_S(sO), cta_tma.partition_D(gO));
        tma_store_arrive();
      }
    }
  }
};

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_EPILOGUE_H_
