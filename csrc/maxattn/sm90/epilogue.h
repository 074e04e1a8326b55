// maxattn sm90: normalises O and writes out, lse and this CTA's max_logit.
//
// Per row: sum == 0 (nothing visible) or a padded row (i >= q_valid) gives
// out 0 and lse -inf; a NaN sum (a NaN logit was visible) gives NaN for out,
// lse and the row's max logit. The raw row maxima times the scale are the
// row's max logits (scale > 0, so max(scale*s) == scale*max(s) in fp32); the
// CTA reduces them by shuffles and shared memory and issues ONE atomic max
// per CTA into max_logit[b, n].
//
// The atomic max and its sentinel are float_max.cuh's. Every CTA of a (b, n)
// issues its atomic, also when it sees nothing.
#ifndef MAXATTN_SM90_EPILOGUE_H_
#define MAXATTN_SM90_EPILOGUE_H_

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include "maxattn/float_max.cuh"
#include "maxattn/sm90/kernel_config.h"
#include "maxattn/sm90/mask.h"
#include "maxattn/sm90/tile_scheduler.h"

namespace maxattn::sm90 {

using ::maxattn::AtomicMaxFloat;
using ::maxattn::NanMax;

// Named barriers among the consumer warpgroups: 1 for the epilogue's
// max_logit reduction, 2 and 3 for the ping-pong turns (mainloop_consumer.h).
__device__ __forceinline__ void NamedBarrierSync(int id, int num_threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}

__device__ __forceinline__ void NamedBarrierArrive(int id, int num_threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}

template <class Config>
struct Epilogue {
  using Element = typename Config::Element;

  // o: (rows, cols) fp32 accumulator view; oc: the (row, col) coordinates of
  // each of its elements in the tile. softmax: finalised row statistics.
  template <class Softmax, class TensorO, class TensorC>
  __device__ static void Store(const FwdArgs& args, const Tile& tile, const BlockMask& mask,
                               const Softmax& softmax, TensorO& o, const TensorC& oc,
                               float* warp_max, int consumer_tid) {
    using namespace cute;
    const int m0 = tile.m_block * Config::kBlockM;
    const int lane = consumer_tid % 32;
    float thread_max = -INFINITY;
    Element* out = static_cast<Element*>(args.out);
    CUTE_UNROLL
    for (int r = 0; r < size<0>(o); ++r) {
      const int i = m0 + get<0>(oc(r, 0));
      const float sum = softmax.row_sum[r];
      const bool valid = i < mask.q_valid;
      const bool empty = !valid || sum == 0.0f;
      const bool has_nan = sum != sum;
      const float inv = empty ? 0.0f : 1.0f / sum;  // NaN stays NaN
      float row_logit = softmax.row_max[r] * args.scale;
      if (has_nan && softmax.row_max[r] != INFINITY) row_logit = __int_as_float(0x7fffffff);
      if (valid) thread_max = NanMax(thread_max, row_logit);
      if (i >= args.q_len) continue;
      if (args.lse != nullptr && (lane % 4) == 0) {
        const float lse = empty ? -INFINITY : softmax.row_max[r] * args.scale + logf(sum);
        args.lse[(static_cast<int64_t>(tile.batch) * args.heads + tile.head) * args.q_len + i] = lse;
      }
      Element* row = out + ((static_cast<int64_t>(tile.batch) * args.q_len + i) * args.heads + tile.head) *
                               static_cast<int64_t>(Config::kHeadDim);
      cutlass::NumericArrayConverter<Element, float, 2> convert;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o); c += 2) {
        cutlass::Array<float, 2> pair;
        pair[0] = empty ? 0.0f : o(r, c) * inv;
        pair[1] = empty ? 0.0f : o(r, c + 1) * inv;
        const int col = get<1>(oc(r, c));
        *reinterpret_cast<cutlass::Array<Element, 2>*>(row + col) = convert(pair);
      }
    }
    if (args.max_logit == nullptr) return;
    CUTE_UNROLL
    for (int offset = 16; offset > 0; offset /= 2) {
      thread_max = NanMax(thread_max, __shfl_xor_sync(0xffffffffu, thread_max, offset));
    }
    if (lane == 0) warp_max[consumer_tid / 32] = thread_max;
    NamedBarrierSync(1, Config::kConsumerThreads);
    if (consumer_tid == 0) {
      float m = warp_max[0];
      CUTE_UNROLL
      for (int w = 1; w < Config::kConsumerThreads / 32; ++w) m = NanMax(m, warp_max[w]);
      AtomicMaxFloat(args.max_logit + static_cast<int64_t>(tile.batch) * args.heads + tile.head, m);
    }
  }
};

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_EPILOGUE_H_
