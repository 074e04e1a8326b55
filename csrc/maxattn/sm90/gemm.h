// maxattn sm90: issuing one warpgroup-wide WGMMA GEMM from CuTe fragments,
// and converting an fp32 accumulator fragment to the element type in its own
// register order; shared by the forward and backward consumers.
#ifndef MAXATTN_SM90_GEMM_H_
#define MAXATTN_SM90_GEMM_H_

#include <cute/tensor.hpp>
#include <cutlass/array.h>

namespace maxattn::sm90 {

// Issues one warpgroup-wide GEMM over the K mode of the fragments
// (asynchronous: the caller waits with warpgroup_wait<n>() and then fences
// the accumulator before touching it).
template <bool kZeroInit, bool kARegisters, class TiledMma, class TensorA, class TensorB, class TensorC>
__device__ __forceinline__ void IssueGemm(TiledMma& mma, TensorA& a, const TensorB& b, TensorC& c) {
  using namespace cute;
  if constexpr (kARegisters) warpgroup_fence_operand(a);
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
}

// dst(i) = src(i) in dst's element type, two at a time (one F2FP pack per
// pair): an accumulator fragment holds a row's column pairs next to each other,
// so the packed pairs are those the register operand of a WGMMA (P) or a
// stmatrix (the forward's out tile) reads.
template <class TensorSrc, class TensorDst, class Convert>
__device__ __forceinline__ void ConvertFragment(const TensorSrc& src, TensorDst& dst, Convert& convert) {
  using namespace cute;
  CUTE_UNROLL
  for (int i = 0; i < size(src); i += 2) {
    cutlass::Array<float, 2> pair;
    pair[0] = src(i);
    pair[1] = src(i + 1);
    cutlass::Array<typename TensorDst::value_type, 2> packed = convert(pair);
    dst(i) = packed[0];
    dst(i + 1) = packed[1];
  }
}

}  // namespace maxattn::sm90

#endif  // MAXATTN_SM90_GEMM_H_
