// maxattn sm90: what the backward's consumers write to global memory.
//
// AddDq, every step: the step's dQ tile (fp32 accumulator, not yet scaled) is
// added into dq_accum [B, N, t_pad, H] by vector reductions
// (red.global.add.v2.f32: each thread's pairs of adjacent columns; rows up to
// t_pad exist, so no bounds test). The post-pass (bwd_prepost.h) scales and
// converts it. StoreDkDv, once per CTA: dV and scale * dK of the CTA's keys
// (rows j < S), converted from the fp32 accumulators in registers.
#ifndef MAXATTN_SM90_BWD_EPILOGUE_H_
#define MAXATTN_SM90_BWD_EPILOGUE_H_

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include "maxattn/sm90/bwd_config.h"
#include "maxattn/sm90/tile_scheduler.h"

namespace maxattn::sm90 {

template <class Config>
struct BwdEpilogue {
  using Element = typename Config::Element;

  // dq: the dQ accumulator fragment of the step; coords: each element's (row,
  // column) in the kBlockM x H tile.
  template <class TensorDq, class TensorC>
  __device__ static void AddDq(const BwdArgs& a, int batch, int head, int m_block, const TensorDq& dq,
                               const TensorC& coords) {
    using namespace cute;
    float* tile = a.dq_accum + ((static_cast<int64_t>(batch) * a.heads + head) * a.t_pad +
                                static_cast<int64_t>(m_block) * Config::kBlockM) * Config::kHeadDim;
    CUTE_UNROLL
    for (int i = 0; i < size(dq); i += 2) {
      const int row = get<0>(coords(i)), col = get<1>(coords(i));
      atomicAdd(reinterpret_cast<float2*>(tile + row * Config::kHeadDim + col), make_float2(dq(i), dq(i + 1)));
    }
  }

  // dk, dv: the (key, head dim) accumulators; coords: each element's (key,
  // column) in the kBlockN x H tile.
  template <class TensorAcc, class TensorC>
  __device__ static void StoreDkDv(const BwdArgs& a, const BwdTile& tile, const TensorAcc& dk, const TensorAcc& dv,
                                   const TensorC& coords) {
    using namespace cute;
    cutlass::NumericArrayConverter<Element, float, 2> convert;
    Element* dk_out = static_cast<Element*>(a.dk);
    Element* dv_out = static_cast<Element*>(a.dv);
    const int n0 = tile.n_block * Config::kBlockN;
    CUTE_UNROLL
    for (int i = 0; i < size(dk); i += 2) {
      const int j = n0 + get<0>(coords(i)), col = get<1>(coords(i));
      if (j >= a.kv_len) continue;
      const int64_t offset =
          ((static_cast<int64_t>(tile.batch) * a.kv_len + j) * a.kv_heads + tile.kv_head) * Config::kHeadDim + col;
      cutlass::Array<float, 2> pair;
      pair[0] = dv(i);
      pair[1] = dv(i + 1);
      *reinterpret_cast<cutlass::Array<Element, 2>*>(dv_out + offset) = convert(pair);
      pair[0] = dk(i) * a.scale;
      pair[1] = dk(i + 1) * a.scale;
      *reinterpret_cast<cutlass::Array<Element, 2>*>(dk_out + offset) = convert(pair);
    }
  }
};

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_BWD_EPILOGUE_H_
